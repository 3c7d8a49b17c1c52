"""What a graph node does, for both torch-level (symbolic trace) and aten-level (export) graphs."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn


def _aten(name: str) -> set:
    """All overloads of ``torch.ops.aten.<name>`` that exist in this torch."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return set()
    return {packet} | {getattr(packet, o) for o in packet.overloads()}


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def _is_call(node: fx.Node, functions: set, methods: set[str]) -> bool:
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


_ADD_FUNCS = {operator.add, operator.iadd, torch.add} | _aten("add")
_SDPA_FUNCS = {F.scaled_dot_product_attention} | _aten("scaled_dot_product_attention")
_SOFTMAX_FUNCS = {F.softmax, torch.softmax} | _aten("softmax") | _aten("_softmax")
_MATMUL_FUNCS = {operator.matmul, torch.matmul, torch.bmm} | _aten("matmul") | _aten("bmm")
_EINSUM_FUNCS = {torch.einsum} | _aten("einsum")
_CAT_FUNCS = {torch.cat, torch.concat, torch.concatenate} | _aten("cat")
_CONV_FUNCS = (
    {F.conv1d, F.conv2d, F.conv3d} | _aten("conv2d") | _aten("conv3d") | _aten("convolution")
)
# 3-D pools and convs: a video's (B, C, T, H, W) token grid.
_POOL_FUNCS = (
    {F.avg_pool2d, F.max_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
    | {F.avg_pool3d, F.max_pool3d, F.adaptive_avg_pool3d, F.adaptive_max_pool3d}
    | _aten("avg_pool2d")
    | _aten("max_pool2d")
    | _aten("adaptive_avg_pool2d")
    | _aten("avg_pool3d")
    | _aten("max_pool3d")
    | _aten("adaptive_avg_pool3d")
)
_POOL_MODULES = (
    nn.AvgPool2d,
    nn.MaxPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.AvgPool3d,
    nn.MaxPool3d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool3d,
)


def is_add(node: fx.Node) -> bool:
    return _is_call(node, _ADD_FUNCS, {"add", "add_"})


def is_sdpa(node: fx.Node) -> bool:
    return _is_call(node, _SDPA_FUNCS, set())


def is_softmax(node: fx.Node, gm: fx.GraphModule | None = None) -> bool:
    """A softmax call, or (given the graph module) a call of an ``nn.Softmax`` module."""
    if gm is not None and isinstance(_module(gm, node), nn.Softmax):
        return True
    return _is_call(node, _SOFTMAX_FUNCS, {"softmax"})


def softmax_dim(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """The dimension a softmax node normalises over."""
    module = _module(gm, node)
    if isinstance(module, nn.Softmax):
        return module.dim
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


def is_matmul(node: fx.Node) -> bool:
    return _is_call(node, _MATMUL_FUNCS, {"matmul", "bmm", "__matmul__"})


def is_einsum(node: fx.Node) -> bool:
    return _is_call(node, _EINSUM_FUNCS, set())


def reads_size(node: fx.Node) -> bool:
    """``x.shape`` or ``x.size(...)``: a read of a tensor's sizes, not of its values."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1:] == ("shape",)
    return node.op == "call_method" and node.target == "size"


def is_cat(node: fx.Node) -> bool:
    return _is_call(node, _CAT_FUNCS, {"cat"})


def is_multihead_attention(gm: fx.GraphModule, node: fx.Node) -> bool:
    return isinstance(_module(gm, node), nn.MultiheadAttention)


def multiplies(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is a layer with multiply-accumulates over its features: a linear, a
    product, a conv (what a restore must not run twice)."""
    module = _module(gm, node)
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return True
    name = getattr(node.target, "__name__", str(node.target)) if node.op != "call_module" else ""
    return (
        is_matmul(node)
        or is_einsum(node)
        or _is_call(node, _CONV_FUNCS, set())
        or (node.op in ("call_function", "call_method") and name.split(".")[-1] == "linear")
    )


def grid_op_kind(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """``"conv"`` or ``"pool"`` for an op that works on a spatial grid, else ``None``."""
    module = _module(gm, node)
    if isinstance(module, (nn.Conv2d, nn.Conv3d)) or _is_call(node, _CONV_FUNCS, set()):
        return "conv"
    if isinstance(module, _POOL_MODULES) or _is_call(node, _POOL_FUNCS, set()):
        return "pool"
    return None


def shape(node: fx.Node) -> tuple | None:
    """The tensor shape recorded for ``node``, or ``None`` for non-tensors and tuples."""
    value = node.meta.get("shape")
    if node.meta.get("is_tensor") and isinstance(value, tuple):
        return value
    return None


def nodes_by_name(graph: fx.Graph) -> dict[str, fx.Node]:
    """``graph``'s nodes by their names, which fx keeps unique within a graph. The map is not
    updated when the graph is edited: build it after the edits it must see."""
    return {node.name: node for node in graph.nodes}


def input_nodes(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def module_path(node: fx.Node) -> str:
    """The innermost module the node was traced in (``""`` at the top level)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1]
    # nn_module_stack values are (qualified path, type); export prefixes some paths with "L__self__".
    path = path[0] if isinstance(path, tuple) else str(path)
    return _clean_path(path)


def _clean_path(path: str) -> str:
    for prefix in ("L['self'].", "L__self__."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
    return path


def common_path(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common: list[str] = []
    for items in zip(*parts, strict=False):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def walk_back(node: fx.Node, stop: Callable[[fx.Node], bool], limit: int = 64) -> fx.Node | None:
    """Follow first tensor inputs backwards until ``stop`` holds; ``None`` if it never does."""
    current: fx.Node | None = node
    for _ in range(limit):
        if current is None:
            return None
        if stop(current):
            return current
        tensors = [n for n in current.all_input_nodes if shape(n) is not None]
        current = tensors[0] if tensors else None
    return None


def is_select_first_token(node: fx.Node) -> bool:
    """``aten.select(x, 1, 0)`` as an exported graph writes ``x[:, 0]``."""
    if node.op != "call_function" or node.target not in _aten("select"):
        return False
    return tuple(node.args[1:3]) == (1, 0)


_LAYOUT_METHODS = {"transpose", "permute", "reshape", "view", "contiguous", "flatten", "unflatten"}
_LAYOUT_FUNCS = (
    {torch.transpose, torch.permute, torch.reshape, torch.flatten}
    | _aten("transpose")
    | _aten("permute")
    | _aten("reshape")
    | _aten("view")
    | _aten("flatten")
    | _aten("clone")
    | _aten("contiguous")
)


_MOVER_NAMES = (
    "flip",
    "fliplr",
    "flipud",
    "roll",
    "rot90",
    "index_select",
    "gather",
    "take_along_dim",
    "scatter",
    "sort",
)
_MOVER_FUNCS = (
    {getattr(torch, name) for name in _MOVER_NAMES if hasattr(torch, name)}
    | {operator.getitem}
    | {f for name in _MOVER_NAMES for f in _aten(name)}
    | _aten("index")
)


def moves_elements(node: fx.Node) -> bool:
    """An op that may put an element elsewhere in a tensor of the same shape (a flip, a roll, an
    indexing): an index run must run it on the indices, never pass them through as in place."""
    return _is_call(node, _MOVER_FUNCS, {*_MOVER_NAMES, "__getitem__"})


def is_layout(node: fx.Node) -> bool:
    """An op that only rearranges elements (transpose, permute, reshape, flatten ...)."""
    return _is_call(node, _LAYOUT_FUNCS, _LAYOUT_METHODS)


_NORM_FUNCS = (
    {F.layer_norm, F.group_norm, torch.layer_norm, torch.group_norm}
    | {f for f in (getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)) if f}
    | _aten("layer_norm")
    | _aten("native_layer_norm")
    | _aten("rms_norm")
    | _aten("group_norm")
    | _aten("native_group_norm")
)
_NORM_MODULES = tuple(m for m in (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None)) if m)


def is_norm(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A layer/RMS/group norm: a functional call, or a call of such a module kept whole (its
    subclasses included: what it computes counts, not what it is called)."""
    return isinstance(_module(gm, node), _NORM_MODULES) or _is_call(
        node, _NORM_FUNCS, {"layer_norm", "rms_norm", "group_norm"}
    )


def reachable(start: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]]) -> Iterator[fx.Node]:
    """``start`` and every node reached from it by ``step`` (a node's inputs, its users, ...),
    each once, depth first; a caller that has found what it looks for stops the walk."""
    seen: set[fx.Node] = set()
    frontier = [start]
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        frontier.extend(step(node))


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node`` computes from, not those it only reads a size of (``x.shape``)."""
    return [n for n in node.all_input_nodes if n.meta.get("carries_tensor", True)]


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it depends on."""
    return set(reachable(node, lambda n: n.all_input_nodes))


def projection_of(gm: fx.GraphModule, operand: fx.Node) -> fx.Node | None:
    """The linear projection an attention operand (a query, key or value) is computed by,
    through layout ops, per-token norms and tuple items (first inputs only)."""
    node: fx.Node | None = operand
    for _ in range(16):
        if node is None:
            return None
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Linear):
            return node
        if node.op == "call_function" and (
            node.target is F.linear or getattr(node.target, "__name__", "").startswith("linear")
        ):
            return node
        inputs = node.all_input_nodes
        node = inputs[0] if inputs else None
    return None


def op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """The name of what ``node`` calls: a module's class, a method, a function's last part."""
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    name = getattr(target, "__name__", str(target))
    return str(name).split(".")[-1] if "." in str(name) else str(name)


def shape_read(node: fx.Node, of: fx.Node) -> int | None:
    """The axis of ``of``'s shape that ``node`` reads (``x.shape[i]``), or ``None``."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return None
    source, axis = node.args[0], node.args[1]
    if not (
        isinstance(source, fx.Node)
        and source.op == "call_function"
        and source.target is getattr
        and source.args == (of, "shape")
        and isinstance(axis, int)
    ):
        return None
    return axis
