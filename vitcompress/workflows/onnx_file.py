"""What an ONNX file holds, read without running it: ``onnx.checker``'s verdict and the element
types (:func:`onnx_structure`), whether its shapes are static, and the op audit against a
deployment runtime's operator list (:func:`onnx_op_audit`). The export writes files; this reads
them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vitcompress.errors import one_line


def onnx_structure(path: str | Path, dtype: str) -> dict[str, Any]:
    """A check of an ONNX file that does not run it: ``onnx.checker`` with ``full_check`` (every
    node's types against its schema at the file's opset, and strict shape inference), the image
    input's and the logits output's element types, and the element types of the weights.
    ``passed`` when the checker accepts it and the input and output are at ``dtype``."""
    import onnx

    model = onnx.load(str(path))
    result: dict[str, Any] = {"checker": "passed", "error": None}
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # onnx raises ValidationError, or InferenceError for types
        result.update(checker="failed", error=one_line(e))
    names = {v: k.lower() for k, v in onnx.TensorProto.DataType.items()}
    graph = model.graph
    result["input_dtype"] = names[graph.input[0].type.tensor_type.elem_type]
    result["output_dtype"] = names[graph.output[0].type.tensor_type.elem_type]
    weights: dict[str, int] = {}
    for tensor in graph.initializer:
        kind = names[tensor.data_type]
        weights[kind] = weights.get(kind, 0) + 1
    result["weight_dtypes"] = dict(sorted(weights.items()))
    result["passed"] = (
        result["checker"] == "passed"
        and result["input_dtype"] == dtype
        and result["output_dtype"] == dtype
    )
    return result


def onnx_static_shapes(path: Path) -> bool:
    """Whether every input and output of an ONNX file has only constant dimensions."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return all(
        dim.HasField("dim_value")
        for value in list(graph.input) + list(graph.output)
        for dim in value.type.tensor_type.shape.dim
    )


# ---------------------------------------------------------------------------------------------
# The op audit: which ONNX ops a file uses, and whether each is one a deployment runtime's core
# runs. The reference is TensorRT's ONNX parser, the strictest common target: the operators its
# docs/operators.md (onnx-tensorrt, TensorRT 10.15) marks supported, in the default domain.
PORTABLE_REFERENCE = "TensorRT 10.15 ONNX parser, onnx-tensorrt docs/operators.md"
PORTABLE_OPS = frozenset(
    """
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool
    BatchNormalization BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape
    Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum
    Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm
    GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
    GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If
    ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log
    LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
    MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
    ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
    RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
    ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence
    RMSNormalization RNN RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter
    ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus
    Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TensorScatter ThresholdedRelu Tile
    TopK Transpose Trilu Unsqueeze Upsample Where Xor
    """.split()
)
# Attributes that decide whether a listed op runs in TensorRT's core: a value other than the
# one given needs a plugin or is refused. Scatter reductions: the core runs ScatterElements and
# ScatterND only without one (NVIDIA/TensorRT #2396, #3650; the ScatterElements plugin's README;
# operators.md's ScatterND row). TopK: "sorted must be 1".
PORTABLE_ATTRIBUTES: dict[str, dict[str, Any]] = {
    "ScatterElements": {"reduction": "none"},
    "ScatterND": {"reduction": "none"},
    "TopK": {"sorted": 1},
}
# The ONNX defaults of those attributes, for nodes that leave them out.
_ATTRIBUTE_DEFAULTS: dict[str, dict[str, Any]] = {
    "ScatterElements": {"reduction": "none"},
    "ScatterND": {"reduction": "none"},
    "TopK": {"sorted": 1},
}


def _graph_nodes(graph: Any) -> Iterator[Any]:
    """Every node of ``graph`` and of the subgraphs its nodes hold (If, Loop, Scan bodies)."""
    import onnx

    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graph_nodes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _graph_nodes(sub)


def _op_name(node: Any) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def onnx_op_audit(path: str | Path) -> dict[str, Any]:
    """The ops an ONNX file uses and whether all are portable (:data:`PORTABLE_OPS`, with the
    attribute values of :data:`PORTABLE_ATTRIBUTES`).

    ``ops``: node count per op type (``domain::Op`` outside the default domain), subgraphs
    included; ``attributes``: for the ops whose attributes decide portability, the count per
    value (``{"ScatterElements": {"reduction": {"add": 6}}}``, ONNX defaults filled in);
    ``not_portable``: one entry per op type, or op type and attribute value, outside the list;
    ``portable``: whether that is empty.
    """
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    ops: dict[str, int] = {}
    attributes: dict[str, dict[str, dict[str, int]]] = {}
    for node in _graph_nodes(graph):
        name = _op_name(node)
        ops[name] = ops.get(name, 0) + 1
        if name not in PORTABLE_ATTRIBUTES:
            continue
        given = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for key, default in _ATTRIBUTE_DEFAULTS[name].items():
            value = given.get(key, default)
            value = value.decode() if isinstance(value, bytes) else value
            counts = attributes.setdefault(name, {}).setdefault(key, {})
            counts[str(value)] = counts.get(str(value), 0) + 1
    not_portable = [
        {"op": name, "count": count, "why": f"not among {PORTABLE_REFERENCE}'s operators"}
        for name, count in sorted(ops.items())
        if name not in PORTABLE_OPS
    ]
    for name, keys in sorted(attributes.items()):
        for key, values in sorted(keys.items()):
            wanted = str(PORTABLE_ATTRIBUTES[name][key])
            not_portable += [
                {
                    "op": name,
                    "count": count,
                    "attribute": {key: value},
                    "why": f"{key}={value}: {PORTABLE_REFERENCE} runs only {key}={wanted}",
                }
                for value, count in sorted(values.items())
                if value != wanted
            ]
    return {
        "reference": PORTABLE_REFERENCE,
        "ops": dict(sorted(ops.items())),
        "attributes": attributes,
        "portable": not not_portable,
        "not_portable": not_portable,
    }
