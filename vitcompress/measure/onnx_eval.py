"""An exported ONNX classifier as a model that :func:`~vitcompress.training.evaluate.evaluate` runs:
an ``nn.Module`` whose forward is one onnxruntime call per batch, so that the accuracy of what is
deployed is counted by the same loop, on the same images in the same order, as a PyTorch model's.

What the file says of itself is read here: its input shape (channels, height, width; a fixed or
symbolic batch), its class count (the output's last dimension) and the preprocessing recorded in
its ``metadata_props`` under :data:`PREPROCESSING_KEY` (the data config as JSON:
``mean``, ``std``, ``interpolation``, ``crop_pct``, ``crop_mode``), which
:func:`preprocessing_props` writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import Tensor, nn

from vitcompress.data.config import check_fields
from vitcompress.errors import UserError, one_line
from vitcompress.measure.onnx_runtime import onnx_session, require_export_extra

__all__ = [
    "PREPROCESSING_KEY",
    "OnnxClassifier",
    "OnnxFileError",
    "OnnxFileFacts",
    "is_onnx_path",
    "preprocessing_props",
    "read_onnx_facts",
]

# The metadata_props key whose value is the data config (JSON) the file's input expects.
PREPROCESSING_KEY = "vitcompress.data_config"
ONNX_SUFFIX = ".onnx"


class OnnxFileError(UserError):
    """The file is not an ONNX classifier this project can evaluate (one line says why)."""


def is_onnx_path(spec: str) -> bool:
    """``spec`` names an ONNX file (by its suffix): what ``eval --model`` runs in onnxruntime."""
    return spec.lower().endswith(ONNX_SUFFIX)


def preprocessing_props(config: Mapping[str, Any]) -> dict[str, str]:
    """The ``metadata_props`` entry that records ``config`` (a data config's ``to_json()``) in an
    ONNX file, as :func:`read_onnx_facts` reads it back."""
    return {PREPROCESSING_KEY: json.dumps(dict(config), sort_keys=True)}


@dataclass(frozen=True)
class OnnxFileFacts:
    """What an ONNX classifier file states: ``batch`` (None: symbolic), ``input_size`` (C, H, W),
    ``classes`` (None when the output's last dimension is symbolic), and ``preprocessing``: the
    recorded data config fields (empty when none is recorded)."""

    path: str
    input_name: str
    batch: int | None
    input_size: tuple[int, int, int]
    classes: int | None
    preprocessing: dict[str, Any]
    bytes: int

    @property
    def where(self) -> str:
        """Where the preprocessing was read from, as a data config source names it."""
        return f"{self.path} (metadata_props {PREPROCESSING_KEY})"


def _dims(value_info: Any) -> list[int | None]:
    shape = value_info.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]


def read_onnx_facts(path: str | Path) -> OnnxFileFacts:
    """The input shape, class count and recorded preprocessing of the ONNX file at ``path``;
    :class:`OnnxFileError` for a missing file, one that is not ONNX, or one that is not an
    image classifier (one image input (B, C, H, W) with fixed C, H, W; one (B, classes) output).
    """
    require_export_extra("onnx", "onnxruntime")
    import onnx

    path = Path(path)
    if not path.is_file():
        raise OnnxFileError(f"--model {path}: no such file")
    try:
        # The weights are not needed to read the graph's interface (a file with external data
        # may keep them elsewhere).
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError, or an OSError
        raise OnnxFileError(f"{path} is not an ONNX file ({one_line(e)})") from e
    graph = model.graph
    # Protobuf parses many byte strings as an empty message: a file with no graph is not ONNX.
    if model.ir_version == 0 or not graph.output:
        raise OnnxFileError(f"{path} is not an ONNX file (no graph in it)")
    initializers = {init.name for init in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise OnnxFileError(
            f"{path} has {len(inputs)} inputs and {len(graph.output)} outputs; eval runs an "
            "image classifier (one image input, one logits output)"
        )
    in_dims, out_dims = _dims(inputs[0]), _dims(graph.output[0])
    if len(in_dims) != 4 or None in in_dims[1:]:
        raise OnnxFileError(
            f"{path}: input {inputs[0].name!r} has shape {_shown(in_dims)}; eval needs "
            "(batch, channels, height, width) with fixed channels, height and width"
        )
    if len(out_dims) != 2:
        raise OnnxFileError(
            f"{path}: output has shape {_shown(out_dims)}, not (batch, classes): eval runs "
            "classifiers"
        )
    props = {p.key: p.value for p in model.metadata_props}
    preprocessing: dict[str, Any] = {}
    if PREPROCESSING_KEY in props:
        where = f"{path} (metadata_props {PREPROCESSING_KEY})"
        try:
            recorded = json.loads(props[PREPROCESSING_KEY])
        except json.JSONDecodeError as e:
            raise OnnxFileError(f"{where} is not JSON: {e.msg}") from e
        preprocessing = check_fields(recorded, where)
    return OnnxFileFacts(
        path=str(path),
        input_name=inputs[0].name,
        batch=in_dims[0],
        input_size=(int(in_dims[1]), int(in_dims[2]), int(in_dims[3])),  # type: ignore[arg-type]
        classes=out_dims[1],
        preprocessing=preprocessing,
        bytes=path.stat().st_size,
    )


def _shown(dims: list[int | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


class OnnxClassifier(nn.Module):
    """The ONNX file as a module: ``forward(images) -> logits`` through one onnxruntime CPU
    session (full graph optimisation, ``threads`` intra-op threads).

    A file exported at a fixed batch B is run in chunks of B; a last short chunk is padded with
    zeros and the padding's outputs dropped. That is exact where every image of a batch is
    computed on its own (a float32 or float16 export, an ``int8-static`` file, whose scales are
    constants), and not for a dynamic ``int8`` file: its ``DynamicQuantizeLinear`` takes one
    scale for the whole batch, so the zero images change the short chunk's scales and its logits
    (by as much as the quantization's own error), as any other images of a batch would (a file
    with a symbolic batch is run on each batch as it comes, unpadded). The images are fed at the
    file's input type (float32, or float16 / bfloat16 for a half-precision export) and the
    logits returned as float32.
    ``vitcompress_data_config`` (what the file records) is set for
    :func:`~vitcompress.data.config.stated_data_config`, so the data is brought to the file as to
    any model that states its preprocessing.
    """

    def __init__(self, facts: OnnxFileFacts, threads: int | None = None) -> None:
        super().__init__()
        self.facts = facts
        try:
            self.session = onnx_session(facts.path, threads)
        except UserError:
            raise
        except Exception as e:  # onnxruntime's own error for a file it cannot load
            raise OnnxFileError(f"onnxruntime cannot load {facts.path}: {one_line(e)}") from e
        element = self.session.get_inputs()[0].type  # "tensor(float16)"
        if element not in _FED_TYPES:
            raise OnnxFileError(
                f"{facts.path}: input {facts.input_name!r} is {element}; eval feeds images as "
                f"{', '.join(_FED_TYPES)}"
            )
        self.input_type = element
        if facts.preprocessing:
            self.vitcompress_data_config = dict(facts.preprocessing)
            self.vitcompress_data_config_from = facts.where

    def forward(self, images: Tensor) -> Tensor:
        array = images.detach().cpu().float()
        batch = self.facts.batch
        if batch is None or array.shape[0] == batch:
            return self._run(array)
        outputs = []
        for start in range(0, array.shape[0], batch):
            chunk = array[start : start + batch]
            short = batch - chunk.shape[0]
            if short:
                chunk = torch.cat([chunk, chunk.new_zeros((short, *chunk.shape[1:]))])
            outputs.append(self._run(chunk)[: batch - short])
        return torch.cat(outputs)

    def _run(self, images: Tensor) -> Tensor:
        feed = _as_numpy(images, self.input_type)
        (logits,) = self.session.run(None, {self.facts.input_name: feed})
        return torch.from_numpy(numpy.asarray(logits).astype(numpy.float32))


# The input element types eval feeds (onnxruntime's names), rounded from float32 images.
_FED_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)")


def _as_numpy(images: Tensor, element: str) -> Any:
    """Float32 ``images`` as the NumPy array onnxruntime takes for an input of type ``element``
    (bfloat16 through ``ml_dtypes``, an onnx dependency: NumPy has none)."""
    array = images.numpy()
    if element == "tensor(float16)":
        return array.astype(numpy.float16)
    if element == "tensor(double)":
        return array.astype(numpy.float64)
    if element == "tensor(bfloat16)":
        import ml_dtypes

        return array.astype(ml_dtypes.bfloat16)
    return array
