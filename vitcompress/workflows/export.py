"""``export``: write a model's inference path as ONNX, TorchScript or an ExportedProgram, and check
the written file against PyTorch; ``compile_check``: ``torch.compile(fullgraph=True)`` on it.

Every shape in the exported graph is a constant, the batch dimension included: the input is
``(batch_size, *input_size)``, fixed at export time. A compressed model's token counts are
constants for a fixed input size (``PredictorReducer`` keeps ``keep_tokens``; ``AttentionReducer``
computes ``ceil(rho * n)`` from a token count that only depends on the input size), so a fixed
batch is the one choice left, and it is made explicitly rather than left to the tracer. The check
runs the written file on a fresh input (not the example the graph was traced with), so a top-k
selection baked in as constants would show up as a mismatch.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitcompress.artifacts.fingerprint import eval_mode
from vitcompress.errors import UserError
from vitcompress.kernels import method_path
from vitcompress.measure.onnx_runtime import onnx_session

FORMATS = ("onnx", "torchscript", "exported-program")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
ATOL = 1e-4
DEFAULT_OPSET = 17
BATCH_AXIS = "batch"  # the name of the symbolic batch dimension (ONNX dim_param, export Dim)
# With a dynamic batch the graph is traced at this batch (not 1, which torch.export would
# specialise) and checked at two other sizes, 1 included.
DYNAMIC_TRACE_BATCH = 2


class ExportError(UserError):
    """The request cannot be exported as asked (a user error: bad output path, an unsupported
    model output, a model the exporter cannot handle)."""


class ExportCheckError(RuntimeError):
    """The written file does not reproduce PyTorch's output within the tolerance."""


class _Inference(nn.Module):
    """``forward(image) -> logits`` and nothing else: hides optional arguments of the wrapped
    forward (timm's ``attn_mask=None, is_causal=False``), which the TorchScript-based ONNX
    exporter would otherwise turn into graph inputs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # In eval mode itself: exporters that restore the top module's mode after exporting
        # (``torch.onnx.export`` does, recursively) must not switch the model to training.
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def _inputs(batch_size: int, input_size: tuple[int, ...], seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, *input_size, generator=generator)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


# ---------------------------------------------------------------------------------------------
# ONNX: ``aten::sort`` with ``stable=True`` (the reducers' top-k order) has no symbolic in the
# TorchScript-based exporter. ONNX ``TopK`` with k = the axis length, sorted, breaks ties by the
# lower index, which is exactly a stable sort, so it is registered for the export's duration.
def _sort_symbolic(g: Any, self: Any, *args: Any) -> Any:
    from torch.onnx import symbolic_helper as helper

    if len(args) == 3:  # aten::sort.stable(self, stable, dim, descending)
        _, dim, descending = args
    else:  # aten::sort(self, dim, descending)
        dim, descending = args[:2]
    dim = helper._get_const(dim, "i", "dim")
    descending = helper._get_const(descending, "i", "descending")
    length = g.op(
        "Gather",
        g.op("Shape", self),
        g.op("Constant", value_t=torch.tensor([dim], dtype=torch.int64)),
    )
    return g.op(
        "TopK", self, length, axis_i=dim, largest_i=int(bool(descending)), sorted_i=1, outputs=2
    )


# ``aten::rms_norm`` (timm's RmsNorm, e.g. AIMv2) has no symbolic either: ONNX has
# RMSNormalization only from opset 23, beyond the TorchScript-based exporter. It is decomposed as
# torch computes it: x / sqrt(mean(x^2 over the normalized dims) + eps) * weight, with eps (when
# None) the input dtype's machine epsilon.
_ONNX_FLOAT_TYPES = {
    "Float": torch.float32,
    "Double": torch.float64,
    "Half": torch.float16,
    "BFloat16": torch.bfloat16,
}


def _rms_norm_symbolic(
    g: Any, x: Any, normalized_shape: Any, weight: Any, eps: Any, opset: int = DEFAULT_OPSET
) -> Any:
    from torch.onnx import symbolic_helper as helper

    dims = len(helper._get_const(normalized_shape, "is", "normalized_shape"))
    axes = list(range(-dims, 0))
    if helper._is_none(eps):
        scalar = x.type().scalarType() if hasattr(x.type(), "scalarType") else None
        eps_value = torch.finfo(_ONNX_FLOAT_TYPES.get(scalar, torch.float32)).eps
    else:
        eps_value = helper._get_const(eps, "f", "eps")
    squared = g.op("Mul", x, x)
    if opset >= 18:  # ReduceMean takes its axes as an input from opset 18
        axes_input = g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64))
        mean = g.op("ReduceMean", squared, axes_input, keepdims_i=1)
    else:
        mean = g.op("ReduceMean", squared, axes_i=axes, keepdims_i=1)
    epsilon = g.op("CastLike", g.op("Constant", value_t=torch.tensor(eps_value)), x)
    normed = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, epsilon)))
    return normed if helper._is_none(weight) else g.op("Mul", normed, weight)


_ONNX_SYMBOLICS = ("aten::sort", "aten::rms_norm")


@contextlib.contextmanager
def _onnx_symbolics(opset: int) -> Iterator[None]:
    torch.onnx.register_custom_op_symbolic("aten::sort", _sort_symbolic, opset)
    torch.onnx.register_custom_op_symbolic(
        "aten::rms_norm", functools.partial(_rms_norm_symbolic, opset=opset), opset
    )
    try:
        yield
    finally:
        for name in _ONNX_SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


def _export_onnx(
    module: nn.Module, example: Tensor, out: Path, opset: int, dynamic_batch: bool
) -> Callable:
    with _onnx_symbolics(opset), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (example,),
            str(out),
            dynamo=False,
            opset_version=opset,
            input_names=["image"],
            output_names=["logits"],
            dynamic_axes=(
                {"image": {0: BATCH_AXIS}, "logits": {0: BATCH_AXIS}} if dynamic_batch else None
            ),
            do_constant_folding=True,
        )

    def run(x: Tensor) -> Tensor:
        session = onnx_session(out)
        return torch.from_numpy(session.run(None, {"image": x.numpy()})[0])

    return run


def onnx_static_shapes(path: Path) -> bool:
    """Whether every input and output of an ONNX file has only constant dimensions."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return all(
        dim.HasField("dim_value")
        for value in list(graph.input) + list(graph.output)
        for dim in value.type.tensor_type.shape.dim
    )


def _export_torchscript(module: nn.Module, example: Tensor, out: Path) -> Callable:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(module, example, check_trace=False)
        traced.save(str(out))
        return torch.jit.load(str(out))


def _export_program(module: nn.Module, example: Tensor, out: Path, dynamic_batch: bool) -> Callable:
    dynamic_shapes = {"x": {0: torch.export.Dim(BATCH_AXIS, min=1)}} if dynamic_batch else None
    program = torch.export.export(module, (example,), dynamic_shapes=dynamic_shapes, strict=False)
    torch.export.save(program, str(out))
    return torch.export.load(str(out)).module()


def _require(*packages: str) -> None:
    import importlib.util

    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(
            f"this format needs {' and '.join(missing)}: pip install {' '.join(missing)}"
        )


def export_model(
    model: nn.Module,
    input_size: tuple[int, ...],
    fmt: str,
    out: str | Path,
    batch_size: int = 1,
    opset: int = DEFAULT_OPSET,
    check: bool = True,
    dynamic_batch: bool = False,
) -> dict[str, Any]:
    """Export ``model``'s inference path (eval mode; its mode is restored afterwards) for inputs of
    shape ``(batch_size, *input_size)`` and, with ``check``, run the written file on a fresh input
    and compare with PyTorch (``max_abs_diff``; :class:`ExportCheckError` above ``ATOL``).

    ``fmt``: ``onnx`` (``torch.onnx.export``, TorchScript-based exporter, checked with
    onnxruntime), ``torchscript`` (``torch.jit.trace``), ``exported-program``
    (``torch.export.export`` + ``torch.export.save``, reloaded with ``torch.export.load``).

    ``dynamic_batch``: the batch dimension is symbolic (ONNX ``dynamic_axes``, a ``torch.export``
    ``Dim``; a TorchScript trace reads it at run time anyway); token counts stay constants. The
    graph is traced at batch :data:`DYNAMIC_TRACE_BATCH` and checked at two other batch sizes
    (``checked_batch_sizes``), so a batch baked into the graph shows up as an error or a mismatch
    (:class:`ExportCheckError`). ``batch_size`` is then not used.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if batch_size < 1:
        raise ExportError(f"batch size must be at least 1, got {batch_size}")
    out = Path(out)
    if out.is_dir():
        raise ExportError(
            f"--out {out} is a directory; give a file such as {out / ('model' + SUFFIXES[fmt])}"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create {out.parent}: {e.strerror or e}") from e
    if fmt == "onnx":
        _require("onnx", "onnxruntime")
    input_size = tuple(int(v) for v in input_size)
    trace_batch = DYNAMIC_TRACE_BATCH if dynamic_batch else batch_size
    check_batches = [1, DYNAMIC_TRACE_BATCH + 1] if dynamic_batch else [batch_size]
    example = _inputs(trace_batch, input_size, seed=0)
    start = time.perf_counter()
    with eval_mode(model), method_path(model), torch.no_grad():
        module = _Inference(model)
        if not isinstance(module(example), Tensor):
            raise ExportError(
                "the model's output is not a single tensor; only image -> tensor "
                "models can be exported"
            )
        try:
            if fmt == "onnx":
                run = _export_onnx(module, example, out, opset, dynamic_batch)
            elif fmt == "torchscript":
                run = _export_torchscript(module, example, out)
            else:
                run = _export_program(module, example, out, dynamic_batch)
        except OSError as e:
            raise ExportError(f"cannot write {out}: {e.strerror or e}") from e
        except Exception as e:
            raise ExportError(f"{fmt} export failed: {_one_line(e)}") from e
        seconds = time.perf_counter() - start
        result: dict[str, Any] = {
            "format": fmt,
            "out": str(out),
            "bytes": out.stat().st_size,
            "input_shape": [BATCH_AXIS if dynamic_batch else batch_size, *input_size],
            "batch": "dynamic" if dynamic_batch else "fixed",
            "export_seconds": round(seconds, 3),
            "checked": False,
            "checked_batch_sizes": [],
            "max_abs_diff": None,
            "atol": ATOL,
        }
        if fmt == "onnx":
            result["opset"] = opset
            result["static_shapes"] = onnx_static_shapes(out)
        if check:
            diff = 0.0
            for seed, batch in enumerate(check_batches, start=1):
                fresh = _inputs(batch, input_size, seed=seed)
                try:
                    got = run(fresh)
                except Exception as e:
                    if not dynamic_batch:
                        raise
                    # A batch read as a constant somewhere in the graph fails here.
                    raise ExportCheckError(
                        f"the {fmt} file does not run at batch {batch} (traced at "
                        f"{trace_batch}): {_one_line(e)}"
                    ) from e
                diff = max(diff, _max_diff(got, module(fresh)))
            result.update(checked=True, checked_batch_sizes=check_batches, max_abs_diff=diff)
            if not diff <= ATOL:
                raise ExportCheckError(
                    f"{fmt} output differs from PyTorch by {diff:.3g} (tolerance {ATOL:g})"
                    + (f" at batch sizes {check_batches}" if dynamic_batch else "")
                )
    return result


def compile_check(
    model: nn.Module, input_size: tuple[int, ...], batch_size: int = 2, backend: str = "eager"
) -> dict[str, Any]:
    """``torch.compile(model, fullgraph=True)`` in eval mode, run on two batches of the same size.

    Reports ``graph_break`` (fullgraph raises on the first one; its reason is kept), ``frames``
    (graphs dynamo compiled, from ``torch._dynamo.utils.counters``), ``recompiles`` (frames beyond
    the first; 0 means the second batch reused the first graph) and ``max_abs_diff`` to eager.
    ``backend="eager"`` checks capture only (dynamo's part: breaks and guards); ``"inductor"``
    also generates code, which on CPU needs a C++ compiler and takes far longer.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    batches = [_inputs(batch_size, tuple(input_size), seed=s) for s in (1, 2)]
    result: dict[str, Any] = {
        "backend": backend,
        "fullgraph": True,
        "graph_break": False,
        "reason": None,
        "frames": 0,
        "recompiles": 0,
        "max_abs_diff": None,
    }
    torch._dynamo.reset()
    counters.clear()
    with eval_mode(model), torch.no_grad():
        module = _Inference(model)
        compiled = torch.compile(module, fullgraph=True, backend=backend)
        try:
            outputs = [compiled(x) for x in batches]
        except Exception as e:  # dynamo raises on a graph break under fullgraph
            result.update(graph_break=True, reason=_one_line(e))
        else:
            result["max_abs_diff"] = max(
                _max_diff(o, module(x)) for o, x in zip(outputs, batches, strict=True)
            )
        frames = int(counters["stats"]["unique_graphs"])
        result.update(frames=frames, recompiles=max(0, frames - 1))
    torch._dynamo.reset()
    return result
