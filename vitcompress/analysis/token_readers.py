"""Token readers: where something after a block reads its tokens by their position (the model's
output, a reshape to the grid, a head reading patch token 5), so that a reduced model restores the
full token set there. The token axis is followed from the block's output through every op that
keeps it; an op that consumes it either does not care for the order or is a reader."""

from __future__ import annotations

import math
import operator

import torch.fx as fx

from vitcompress.analysis import ops

# Ops that pool over the token axis: they do not care about the tokens' order.
_POOL_NAMES = {
    "mean",
    "sum",
    "amax",
    "amin",
    "max",
    "min",
    "logsumexp",
    "nansum",
    "nanmean",
    "adaptive_avg_pool1d",
    "adaptive_max_pool1d",
    "avg_pool1d",
    "max_pool1d",
}


def _pools_tokens(gm: fx.GraphModule, node: fx.Node) -> bool:
    name = ops.op_name(gm, node)
    base = name.split(".")[0].lower().removesuffix("_")
    if node.op == "call_module":
        return "pool" in base
    return base in _POOL_NAMES or "pool" in base


def _dims(value, ndim: int) -> set[int] | None:
    """A reduction's ``dim`` argument as non-negative axes; ``None`` for all of them."""
    if value is None:
        return None
    values = value if isinstance(value, (tuple, list)) else (value,)
    return {v % ndim for v in values if isinstance(v, int)}


def _follow(gm: fx.GraphModule, user: fx.Node, node: fx.Node, axis: int) -> int | None | str:
    """Where the token axis of ``node`` (at ``axis``) is in ``user``'s output: an int; ``None``
    when ``user`` consumes it without caring for the order (a pool over it, attention over it);
    ``"lost"`` when the axis disappears some other way."""
    in_shape, out_shape = ops.shape(node), ops.shape(user)
    size = in_shape[axis]
    ndim = len(in_shape)
    if ops.is_sdpa(user) or ops.is_softmax(user, gm):
        return None if out_shape is None or size not in out_shape[axis : axis + 1] else axis
    if _pools_tokens(gm, user):
        name = ops.op_name(gm, user).lower()
        if "pool" in name and out_shape is not None and len(out_shape) == ndim:
            # A pool with a window or several bins (avg_pool1d(x, 2), AdaptiveMaxPool1d(4)):
            # whole over the token axis only where it leaves one value there.
            if axis == ndim - 1 and out_shape[axis] != 1:
                return "lost"
            if axis == ndim - 1:
                return None
            return axis
        if user.op == "call_module":
            return None if axis == ndim - 1 else axis
        dim = user.kwargs.get("dim", user.args[1] if len(user.args) > 1 else None)
        dims = _dims(dim, ndim)
        if dims is not None and axis in dims and _reads_indices(user):
            return "lost"  # max(dim).indices: where the largest token is, a position
        if dims is None or axis in dims:
            return None
        keep = user.kwargs.get("keepdim", len(user.args) > 2 and user.args[2] is True)
        return axis if keep else axis - sum(1 for d in dims if d < axis)
    if out_shape is None:  # a tuple (unbind, split): its items are followed
        return _tuple_axis(gm, user, axis, ndim)
    name = ops.op_name(gm, user)
    if name in ("transpose", "swapaxes", "permute") or name.startswith(("transpose", "permute")):
        rest = [a for a in user.args[1:]]
        order = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        if name.startswith("permute") and len(order) == ndim:
            return [o % ndim for o in order].index(axis)
        if len(order) == 2:
            a, b = (o % ndim for o in order)
            return b if axis == a else a if axis == b else axis
    if ops.is_layout(user):
        # A reshape keeps the axis where the dims before it multiply to the same count.
        before = math.prod(in_shape[:axis])
        for i, out_size in enumerate(out_shape):
            if out_size == size and math.prod(out_shape[:i]) == before:
                return i
        return "lost"
    if len(out_shape) == ndim and out_shape[axis] == size:
        if _mixes_tokens(gm, user, node, axis, ndim):
            return "lost"  # the same shape, but each token from others (flip, cumsum, a conv)
        return axis  # per-token ops: norms, linears over channels, adds, activations
    return "lost"


def _reads_indices(user: fx.Node) -> bool:
    """Whether the indices of ``user``, a ``max``/``min`` over a dim (values and indices), are
    read: its item 1, its ``indices``, or the pair itself as an output."""
    for reader in user.users:
        if reader.op == "output":
            return True
        if reader.op == "call_function" and reader.target is operator.getitem:
            if len(reader.args) > 1 and reader.args[1] == 1:
                return True
        if reader.op == "call_function" and reader.target is getattr:
            if len(reader.args) > 1 and reader.args[1] == "indices":
                return True
    return False


# Ops of an unchanged shape that combine or move elements along a dim they are given.
_ALONG_DIM = ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "diff", "argsort", "msort")


def _mixes_tokens(gm: fx.GraphModule, user: fx.Node, node: fx.Node, axis: int, ndim: int) -> bool:
    """Whether ``user``, whose output keeps the shape of ``node`` (tokens on ``axis``), makes a
    token's value from other tokens or puts it at another place: an op that moves elements or
    works along a dim (flip, roll, sort, cumsum), a linear or conv over the token axis, a matmul
    that contracts it, or an operand laid out by token position that does not derive from the
    image (a position table added after the blocks: :func:`_position_operand`)."""
    name = ops.op_name(gm, user).split(".")[0].removesuffix("_")
    if ops.moves_elements(user) or name in _ALONG_DIM:
        return True
    if ops.multiplies(gm, user):
        if ops.is_matmul(user):
            left = user.args[0] is node
            return axis == ndim - 1 if left else axis == ndim - 2
        if ops.is_einsum(user):
            return True
        conv = "conv" in name.lower()
        return axis >= 2 if conv else axis == ndim - 1
    return False


def _tuple_axis(gm: fx.GraphModule, user: fx.Node, axis: int, ndim: int) -> int | str:
    """Where the token axis is in the items of a tuple-valued op: ``unbind`` removes its dim
    (the axis before it shifts down; unbinding the token axis itself reads tokens by position);
    a split along the token axis reads them by position too."""
    name = ops.op_name(gm, user)
    default = 0 if name.startswith("unbind") else None
    dim = user.kwargs.get("dim", user.args[-1] if len(user.args) > 1 else default)
    if name.startswith(("split", "chunk", "tensor_split")) and len(user.args) < 3:
        dim = user.kwargs.get("dim", 0)
    if not isinstance(dim, int):
        return axis
    dim %= ndim
    if dim == axis:
        return "lost"
    if name.startswith("unbind") and dim < axis:
        return axis - 1
    return axis


def _index_reading(node: fx.Node, axis: int) -> object:
    """What a getitem / select takes along ``axis``: an int, a slice, or ``None``."""
    if node.target is operator.getitem:
        index = node.args[1]
        index = index if isinstance(index, tuple) else (index,)
        return index[axis] if axis < len(index) else slice(None)
    if len(node.args) >= 3 and node.args[1] == axis:  # aten.select(x, dim, index)
        return node.args[2]
    return None


def _joined(
    cat: fx.Node, node: fx.Node, axis: int, prefix: int
) -> tuple[str | None, tuple[int, int] | None]:
    """A concatenation along the token axis keeps the tokens' order where they come last (a class
    token prepended: CaiT's class attention); they are then further from the start by the
    tokens put before them, which count as prefix tokens from there on."""
    tensors = cat.args[0] if cat.args else cat.kwargs.get("tensors", ())
    dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    ndim = len(ops.shape(node))
    if not isinstance(dim, int) or dim % ndim != axis:
        return None, (axis, prefix)  # joined on another axis (channels): tokens stay put
    tensors = list(tensors)
    last = bool(tensors) and tensors[-1] is node and tensors.count(node) == 1
    before = tensors[:-1]
    if last and all(isinstance(t, fx.Node) and ops.shape(t) is not None for t in before):
        return None, (axis, prefix + sum(ops.shape(t)[axis] for t in before))
    return (
        f"cat ({cat.name}) joins the {ops.shape(node)[axis]} tokens of "
        f"{tuple(ops.shape(node))[1:]} with others by position"
    ), None


def find_token_readers(
    gm: fx.GraphModule,
    image: fx.Node,
    block_output: fx.Node,
    tokens: int,
    prefix_tokens: int,
    exit_grid: fx.Node | None,
    is_ancestor,
    stop=None,
) -> list[tuple[fx.Node, fx.Node, int, int, str]]:
    """Where something after a block reads its tokens by their position: the model's output, a
    reshape to the grid, a head reading patch token 5. Each as ``(reader, tokens, axis, prefix,
    what)``: the op, the tensor it reads (tokens on ``axis``, ``prefix`` of them prefix tokens),
    and a description. A reduced model restores the full token set there (``modules/restore``).

    ``stop(node)`` says where the following ends without a verdict (the blocks after this one,
    the way into the next stage). From the block's output (tokens on axis 1) the token axis is
    followed through every op that keeps it (norms, linears on channels, transposes, slices over
    all patch tokens). An op that consumes it either does not care for the order (a pool over the
    tokens, attention over them, the stage's exit grid, which restores on its own, or reading a
    prefix token, ``x[:, 0]``) or is a reader: a flatten that merges the token axis into the
    features, reading patch token 5, the model's output itself.
    """
    if tokens <= 1:
        return []  # a class-attention stage: one token, no order
    readers: list[tuple[fx.Node, fx.Node, int, int, str]] = []
    axes: dict[fx.Node, tuple[int, int]] = {block_output: (1, prefix_tokens)}
    frontier = [block_output]
    while frontier:
        node = frontier.pop(0)
        axis, prefix = axes[node]
        for user in node.users:
            if user in axes or user is exit_grid:
                continue
            if stop is not None and stop(user):
                continue
            if not user.meta.get("carries_tensor", True):
                continue  # reads a size only (x.shape)
            if ops.shape(node) is None:  # an item of a tuple of tokens
                if ops.shape(user) is not None and len(ops.shape(user)) > axis:
                    axes[user] = (axis, prefix)
                    frontier.append(user)
                continue
            if user.op == "output":
                shape = tuple(ops.shape(node))[1:]
                readers.append((user, node, axis, prefix, f"the model's output {shape}"))
                continue
            problem, where = _consumed(gm, user, node, axis, prefix, image, is_ancestor)
            if problem is not None:
                readers.append((user, node, axis, prefix, problem))
            elif where is not None:
                axes[user] = where
                frontier.append(user)
    return readers


def _from_the_front(index: slice, size: int) -> slice:
    """``index`` with its negative bounds counted from the front of ``size`` tokens."""

    def bound(value: object) -> object:
        return max(value + size, 0) if isinstance(value, int) and value < 0 else value

    return slice(bound(index.start), bound(index.stop), index.step)


def _consumed(
    gm: fx.GraphModule,
    user: fx.Node,
    node: fx.Node,
    axis: int,
    prefix: int,
    image: fx.Node,
    is_ancestor,
) -> tuple[str | None, tuple[int, int] | None]:
    """(how ``user`` depends on the order of ``node``'s tokens, for the refusal, or ``None``;
    where the token axis and its prefix count are in ``user``'s output, or ``None``)."""
    name = ops.op_name(gm, user)
    shape = tuple(ops.shape(node))
    per_image = shape[1:]  # as the user knows it, without the example's batch
    size = shape[axis]
    if user.op == "call_function" and (
        user.target is operator.getitem or name.startswith("select")
    ):
        index = _index_reading(user, axis)
        if isinstance(index, slice):  # ``x[:, -4:]`` reads the last 4 by position, not all
            index = _from_the_front(index, size)
        if isinstance(index, int) and 0 <= index < prefix:
            return None, None  # a prefix token (cls, distillation): it stays first
        if (
            isinstance(index, slice)
            and index.start in (None, 0)
            and index.step in (None, 1)
            and isinstance(index.stop, int)
            and 0 < index.stop <= prefix
        ):
            return None, None  # prefix tokens only (``x[:, :1]``, HF CvT's cls split)
        if (
            isinstance(index, slice)
            and index.step in (None, 1)
            and index.stop in (None, size)
            and (index.start or 0) <= prefix
        ):
            return None, (axis, prefix - (index.start or 0))  # all patch tokens, in any order
        return f"{name} ({user.name}) reads token(s) {index!r} of the {size} by position", None
    if ops.is_cat(user):
        return _joined(user, node, axis, prefix)
    where = _follow(gm, user, node, axis)
    if where is None:
        return None, None
    if where != "lost":
        table = _position_operand(user, node, axis, image, is_ancestor)
        if table is not None:
            return (
                f"{name} ({user.name}) meets {table.name} {tuple(ops.shape(table))} by token position",
                None,
            )
        return None, (where, prefix)
    if ops.is_layout(user):
        return (
            f"{name} ({user.name}) merges the token axis of {per_image} into features, "
            "so every token's features land at a fixed place"
        ), None
    if ops.is_matmul(user) or ops.is_einsum(user):
        others = [a for a in user.all_input_nodes if a is not node]
        if all(a is image or is_ancestor(image, a) for a in others):
            return None, None  # attention over the tokens, weighted by the tokens themselves
    return f"{name} ({user.name}) combines the {size} tokens of {per_image} by position", None


def _position_operand(
    user: fx.Node, node: fx.Node, axis: int, image: fx.Node, is_ancestor
) -> fx.Node | None:
    """An operand of ``user`` besides ``node`` laid out by token position (its dim that broadcasts
    against the token axis has the token count) and not derived from the image: a position
    table added or multiplied after the blocks, which each token must meet at its own row."""
    shape = tuple(ops.shape(node))
    ndim, size = len(shape), shape[axis]
    for other in user.all_input_nodes:
        if other is node or other is image or is_ancestor(image, other):
            continue
        if not other.meta.get("carries_tensor", True):
            continue
        other_shape = ops.shape(other)
        if other_shape is None or len(other_shape) < ndim - axis:
            continue
        if other_shape[axis - ndim] == size and size > 1:
            return other
    return None
