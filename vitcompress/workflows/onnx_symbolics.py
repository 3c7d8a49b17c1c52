"""ONNX forms for the aten ops the TorchScript-based exporter has none for, registered for an
export's duration (:func:`onnx_symbolics`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


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
    scalar = self.type().scalarType() if hasattr(self.type(), "scalarType") else None
    if scalar == "BFloat16":
        # ONNX TopK takes bfloat16 only from opset 24, beyond this exporter: sort a float32 copy
        # (widening is exact, so the order and its ties are the same) and narrow the values back.
        values, indices = g.op(
            "TopK",
            g.op("Cast", self, to_i=_ONNX_FLOAT),
            length,
            axis_i=dim,
            largest_i=int(bool(descending)),
            sorted_i=1,
            outputs=2,
        )
        return g.op("Cast", values, to_i=_ONNX_BFLOAT16), indices
    return g.op(
        "TopK", self, length, axis_i=dim, largest_i=int(bool(descending)), sorted_i=1, outputs=2
    )


_ONNX_FLOAT, _ONNX_BFLOAT16 = 1, 16  # onnx.TensorProto.FLOAT, .BFLOAT16


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
    g: Any, x: Any, normalized_shape: Any, weight: Any, eps: Any, opset: int
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
def onnx_symbolics(opset: int) -> Iterator[None]:
    torch.onnx.register_custom_op_symbolic("aten::sort", _sort_symbolic, opset)
    torch.onnx.register_custom_op_symbolic(
        "aten::rms_norm", functools.partial(_rms_norm_symbolic, opset=opset), opset
    )
    try:
        yield
    finally:
        for name in _ONNX_SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(name, opset)
