"""int8 ONNX: an exported float32 file quantized with ``onnxruntime.quantization``, the reducers
kept in float.

Two modes (:data:`QUANTIZE_MODES`): ``int8``, ``quantize_dynamic`` (weights int8 per output
channel, activations quantized per tensor at run time), and ``int8-static``, ``quantize_static``
in the QDQ format with activation ranges calibrated on images (:class:`ImageCalibration`).
Only ``MatMul`` and ``Gemm`` with a constant weight are quantized (:data:`QUANTIZED_OPS`,
:func:`weight_layers`): the linear layers, which hold nearly all of a ViT's work. Everything
else, the attention's activation-by-activation products included, stays float.

What a reducer decides must not move by quantization: its scores, its top-k, the gathers of
the kept tokens, the squeeze weights and the one-hot sums of the squeeze and the merge. By op
type they are not quantized at all (``TopK``, ``GatherElements``, ``Equal``, ``Where``, ...); the
``MatMul`` among them (similarities, one-hot sums) and the linear layers of a score predictor
are excluded by node name: the exporter names a node after the modules it was called in
(``/model/tps.0/MatMul_1``), so the nodes of every module the rewrite inserted
(:func:`inserted_module_scopes`) are passed as ``nodes_to_exclude``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from vitcompress.errors import UserError, one_line
from vitcompress.status import quiet_logger

QUANTIZE_MODES = ("int8", "int8-static")
QUANTIZED_OPS = ("MatMul", "Gemm")
WEIGHT_TYPES = ("int8", "uint8")
DEFAULT_CALIBRATION_IMAGES = 256
# The batch of calibration images fed to a file exported with a symbolic batch.
DYNAMIC_CALIBRATION_BATCH = 8
# The ops a quantized MatMul or Gemm becomes: QOperator (dynamic) and the fused forms
# onnxruntime's optimiser makes of QDQ pairs.
INTEGER_OPS = frozenset(
    {"MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat"}
)
# The modules the rewrite inserts live here (reducers, score predictors, attention hooks).
_INSERTED_PACKAGES = ("vitcompress.modules", "vitcompress.kernels")

__all__ = [
    "DEFAULT_CALIBRATION_IMAGES",
    "QUANTIZED_OPS",
    "QUANTIZE_MODES",
    "ImageCalibration",
    "QuantizeError",
    "calibration_indices",
    "float_node_names",
    "inserted_module_scopes",
    "quantize_onnx_file",
    "weight_layers",
]


class QuantizeError(UserError):
    """The file cannot be quantized as asked (bad mode, missing calibration, a reducer whose
    nodes cannot be found to keep them float)."""


def inserted_module_scopes(model: nn.Module) -> dict[str, str]:
    """``{qualified name: exporter scope}`` of the outermost modules the rewrite inserted
    (classes from ``vitcompress.modules`` / ``vitcompress.kernels``): ``tps.0`` -> ``tps.0``,
    ``tps_hooks.attn1`` -> ``attn1``.

    The scope is what the TorchScript-based exporter names the module in node names: the
    qualified name from its last non-numeric atom on (``_unqualified_variable_name`` in
    ``torch.onnx``), the rule reproduced here.
    """
    scopes: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or not type(module).__module__.startswith(_INSERTED_PACKAGES):
            continue
        if any(name.startswith(outer + ".") for outer in scopes):
            continue  # inside an inserted module: its nodes are under the outer scope
        atoms = name.split(".")
        start = max((i for i, atom in enumerate(atoms) if not atom.isnumeric()), default=0)
        scopes[name] = ".".join(atoms[start:])
    return scopes


def float_node_names(graph: Any, scopes: dict[str, str]) -> tuple[list[str], list[str]]:
    """The names of ``graph``'s nodes called inside any of ``scopes`` (a path component of the
    node's name equal to the scope, or to the scope with the exporter's ``_N`` suffix for a
    repeated name), and the qualified names of the scopes no node was found for.

    A base module with the same name as an inserted one is kept float too: less quantized, never
    wrong."""
    patterns = {name: re.compile(rf"^{re.escape(scope)}(_\d+)?$") for name, scope in scopes.items()}
    found: set[str] = set()
    names: list[str] = []
    for node in graph.node:
        parts = node.name.split("/")[:-1]
        hits = {name for name, pattern in patterns.items() if any(map(pattern.match, parts))}
        if hits:
            names.append(node.name)
            found |= hits
    return names, [name for name in scopes if name not in found]


def weight_layers(graph: Any, excluded: Sequence[str]) -> list[str]:
    """The ``MatMul`` and ``Gemm`` nodes of ``graph`` whose second input is a weight (an
    initializer), less ``excluded``: the linear layers, the nodes quantized."""
    weights = {tensor.name for tensor in graph.initializer}
    skip = set(excluded)
    return [
        node.name
        for node in graph.node
        if node.op_type in QUANTIZED_OPS
        and node.name not in skip
        and len(node.input) > 1
        and node.input[1] in weights
    ]


def calibration_indices(length: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(length)`` (all of them when ``count`` is
    not smaller): a folder sorted by class then gives every class its share."""
    if count >= length:
        return list(range(length))
    return sorted({round(i * (length - 1) / max(1, count - 1)) for i in range(count)})


class ImageCalibration:
    """A ``CalibrationDataReader`` for ``quantize_static``: ``count`` images of ``dataset``
    (already brought to the model by its own preprocessing), evenly spread, in batches of
    ``batch_size`` as the file takes them; the last batch is filled up from the first images
    (repeating an image changes no range the calibration records beyond its own)."""

    def __init__(
        self, dataset: Dataset, count: int, batch_size: int, input_name: str = "image"
    ) -> None:
        length = len(dataset)  # type: ignore[arg-type]
        if length == 0:
            raise QuantizeError("the calibration data holds no images")
        self.indices = calibration_indices(length, count)
        self.dataset = dataset
        self.batch_size = batch_size
        self.input_name = input_name
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[dict[str, Any]]:
        indices = list(self.indices)
        while len(indices) % self.batch_size:
            indices.append(self.indices[len(indices) % len(self.indices)])
        for start in range(0, len(indices), self.batch_size):
            images = [self._image(i) for i in indices[start : start + self.batch_size]]
            yield {self.input_name: torch.stack(images).float().numpy()}

    def _image(self, index: int) -> torch.Tensor:
        item = self.dataset[index]
        return item[0] if isinstance(item, tuple | list) else item

    def get_next(self) -> dict[str, Any] | None:
        return next(self._batches, None)

    def rewind(self) -> None:
        self._batches = self._iterate()


def quantize_onnx_file(
    source: str | Path,
    target: str | Path,
    mode: str,
    float_scopes: dict[str, str] | None = None,
    calibration: ImageCalibration | None = None,
    per_channel: bool = True,
    weight_type: str = "int8",
) -> dict[str, Any]:
    """Quantize the float32 ONNX file ``source`` into ``target`` (``mode``: ``int8`` or
    ``int8-static``, which needs ``calibration``), keeping float every node in ``float_scopes``
    (:func:`inserted_module_scopes`). Scopes of which no node is found at all are refused:
    the reducers' nodes could not be kept float.

    Returns plain data: the mode and format, the ops quantized (``quantized_ops``: the source's
    ``MatMul``/``Gemm`` count, how many became integer, ``integer_nodes`` per op type), the nodes
    kept float (``float_nodes``: count, per op type and their names; ``float_scopes``), file sizes.
    ``weight_type``: ``int8`` (the default: signed weights, onnxruntime's U8S8 kernels on x86)
    or ``uint8``; ``per_channel``: a scale per output channel (else one per weight).
    """
    if weight_type not in WEIGHT_TYPES:
        raise QuantizeError(
            f"unknown weight type {weight_type!r}; choose one of {', '.join(WEIGHT_TYPES)}"
        )
    if mode not in QUANTIZE_MODES:
        raise QuantizeError(
            f"unknown --quantize {mode!r}; choose one of {', '.join(QUANTIZE_MODES)}"
        )
    if mode == "int8-static" and calibration is None:
        raise QuantizeError("--quantize int8-static calibrates on images: give --data DIR")
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    source, target = Path(source), Path(target)
    graph = onnx.load(str(source), load_external_data=False).graph
    scopes = dict(float_scopes or {})
    excluded, missing = float_node_names(graph, scopes)
    if scopes and len(missing) == len(scopes):
        # A reducer at keep 1 exports to nothing, but an attention hook always computes its
        # attention: no node at all means the exporter named them otherwise than expected.
        raise QuantizeError(
            f"no node of the inserted modules ({', '.join(scopes)}) found in {source.name} by "
            "name: the reducers cannot be kept float, so the file is not quantized"
        )
    common = _quantizer_arguments(graph, excluded, per_channel, weight_type)
    try:
        # onnxruntime.quantization logs a line per skipped node and recommends pre-processing on
        # the root logger: noise in a command's output, where the result says what was quantized.
        with quiet_logger():
            if mode == "int8":
                quantize_dynamic(source, target, **common)
            else:
                quantize_static(
                    source,
                    target,
                    calibration,
                    quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8 if weight_type == "int8" else QuantType.QUInt8,
                    **common,
                )
    except Exception as e:
        raise QuantizeError(f"onnxruntime could not quantize {source.name}: {one_line(e)}") from e
    written = onnx.load(str(target), load_external_data=False).graph
    return {
        "mode": mode,
        "format": "QOperator" if mode == "int8" else "QDQ",
        "weights": f"{weight_type}, per {'channel' if per_channel else 'tensor'}",
        "activations": (
            "uint8, per tensor, at run time" if mode == "int8" else f"{weight_type}, calibrated"
        ),
        "calibration_images": None if calibration is None else len(calibration.indices),
        "quantized_ops": _quantized_ops(graph, written, excluded),
        "float_nodes": _float_nodes(graph, written, excluded, target),
        "float_scopes": scopes,
        # Modules that exported to no node, e.g. a reducer at keep 1, which passes tokens on.
        "scopes_without_nodes": missing,
        "fp32_bytes": source.stat().st_size,
        "bytes": target.stat().st_size,
    }


def _quantizer_arguments(
    graph: Any, excluded: list[str], per_channel: bool, weight_type: str
) -> dict[str, Any]:
    """The arguments ``quantize_dynamic`` and ``quantize_static`` share."""
    from onnxruntime.quantization import QuantType

    return {
        "op_types_to_quantize": list(QUANTIZED_OPS),
        "per_channel": per_channel,
        "weight_type": QuantType.QInt8 if weight_type == "int8" else QuantType.QUInt8,
        # Named, not left to MatMulConstBOnly, which the QDQ quantizer does not read: the same
        # layers are quantized in both modes.
        "nodes_to_quantize": _with_gemm_splits(graph, weight_layers(graph, excluded)),
        "nodes_to_exclude": _with_gemm_splits(graph, excluded),
        "extra_options": {"MatMulConstBOnly": True},
    }


# quantize_dynamic first rewrites each Gemm as a MatMul named ``<name>_MatMul`` (and an Add),
# then picks nodes by name: a Gemm is listed under both names.
_GEMM_SPLIT = "_MatMul"


def _with_gemm_splits(graph: Any, names: Sequence[str]) -> list[str]:
    gemms = {node.name for node in graph.node if node.op_type == "Gemm"}
    return list(names) + [name + _GEMM_SPLIT for name in names if name in gemms]


def _fed_by_dequantize(graph: Any) -> set[str]:
    """Names of ``MatMul``/``Gemm`` nodes of a QDQ graph whose weight comes from a
    ``DequantizeLinear``: quantized ones, which onnxruntime fuses into integer kernels."""
    dequantized = {
        out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output
    }
    return {
        node.name
        for node in graph.node
        if node.op_type in QUANTIZED_OPS and len(node.input) > 1 and node.input[1] in dequantized
    }


def _quantized_ops(source: Any, target: Any, excluded: Sequence[str]) -> dict[str, Any]:
    integer: dict[str, int] = {}
    for node in target.node:
        if node.op_type in INTEGER_OPS:
            integer[node.op_type] = integer.get(node.op_type, 0) + 1
    qdq = _fed_by_dequantize(target)
    if qdq:
        integer["MatMul/Gemm after DequantizeLinear"] = len(qdq)
    candidates = sum(node.op_type in QUANTIZED_OPS for node in source.node)
    return {
        "matmul_gemm": candidates,
        "quantized": sum(integer.values()),
        "kept_float_by_name": sum(
            node.op_type in QUANTIZED_OPS and node.name in set(excluded) for node in source.node
        ),
        "integer_nodes": dict(sorted(integer.items())),
    }


def _float_nodes(
    source: Any, target: Any, excluded: Sequence[str], target_path: Path
) -> dict[str, Any]:
    """The excluded nodes as they are in the quantized graph: each must be there, same op, and
    read no ``DequantizeLinear`` weight; :class:`QuantizeError` otherwise, with the file at
    ``target_path`` removed (never a reducer quantized unnoticed)."""
    kept = {node.name: node.op_type for node in target.node}
    wanted = {node.name: node.op_type for node in source.node if node.name in set(excluded)}
    changed = [
        name
        for name, op in wanted.items()
        if kept.get(name) != op
        and not (op == "Gemm" and kept.get(name + _GEMM_SPLIT) == "MatMul")  # split, float
    ]
    changed += sorted(set(wanted) & _fed_by_dequantize(target))
    if changed:
        target_path.unlink(missing_ok=True)
        raise QuantizeError(f"the reducer node {changed[0]} was quantized despite its exclusion")
    ops: dict[str, int] = {}
    for op in wanted.values():
        ops[op] = ops.get(op, 0) + 1
    return {"count": len(wanted), "ops": dict(sorted(ops.items())), "names": sorted(wanted)}
