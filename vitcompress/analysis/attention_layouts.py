"""Attention written in other layouts, rewritten to the (B x windows, heads, N, D) one every later
step reads: SAM's heads folded into the batch (``heads_apart``), NesT's windows on an axis of
their own (``windows_into_batch``), Hiera's mask units cut after the projection
(``mask_units_before_projection``, which makes them NesT's layout first).

SAM's encoder folds the heads into the batch before ``scaled_dot_product_attention``:
``qkv.reshape(3, B * heads, N, D)``. Every later step (finding the attention core, scoring
tokens by the attention they receive, reducing, counting) reads attention as
(B, heads, N, D). The same attention on ``q.unflatten(0, (-1, heads))`` gives the same numbers,
since attention is computed for each leading index alone, so the captured graph is written that
way, with the output flattened back. The images' axis must come first in the folded batch (else
a row of the unflattened tensor would mix images): that is read off an index run (the
projections' outputs seeded with their row number), not assumed. Where it does not hold, the
graph is left as it was.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from vitcompress.analysis import ops
from vitcompress.analysis.index_run import IndexRun, run_indices


def _row_index(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A tensor of ``shape`` holding, everywhere in row ``b``, the number ``b + 1``."""
    rows = torch.arange(1, shape[0] + 1, dtype=dtype)
    return rows.reshape(-1, *([1] * (len(shape) - 1))).expand(*shape).clone()


def _folded(gm: fx.GraphModule, node: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """``(heads, projections)`` for an SDPA on 3-D operands whose batch is the projections'
    batch times a head count, else ``None``."""
    operands = list(node.args[:3])
    shapes = [ops.shape(o) if isinstance(o, fx.Node) else None for o in operands]
    if any(s is None or len(s) != 3 for s in shapes):
        return None
    projections = [ops.projection_of(gm, o) for o in operands]
    if any(p is None for p in projections):
        return None
    rows = {ops.shape(p)[0] for p in projections if ops.shape(p)}
    if len(rows) != 1:
        return None
    batch = rows.pop()
    folded = shapes[0][0]
    if folded == batch or folded % batch or any(s[0] != folded for s in shapes):
        return None
    return folded // batch, list(dict.fromkeys(projections))


def _images_first(run: IndexRun, node: fx.Node, heads: int, dtype: torch.dtype) -> bool:
    """Whether row ``b * heads + h`` of every operand of ``node`` holds row ``b`` of its
    projection, in an index run that seeded the projections with their row numbers."""
    for operand in node.args[:3]:
        value = run.found.get(operand)
        if value is None or operand not in run.indexed:
            return False
        rows = value.unflatten(0, (-1, heads))
        if not torch.equal(rows, _row_index(rows.shape, dtype)):
            return False
    return True


def _unflatten(graph: fx.Graph, value: object, heads: int, folded: int) -> object:
    """A 3-D operand or mask batched as the queries are, unflattened; anything else as it is (a
    2-D mask broadcasts over the batch, whatever its first size)."""
    shape = ops.shape(value) if isinstance(value, fx.Node) else None
    if shape is not None and len(shape) == 3 and shape[0] == folded:
        return graph.call_method("unflatten", (value, 0, (-1, heads)))
    return value


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _shape_args(node: fx.Node) -> list:
    args = list(node.args[1:])
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else args


def mask_units_before_projection(gm: fx.GraphModule) -> int:
    """Hiera's mask-unit attention cuts its windows from the (B, L, C) tokens after the
    projection, interleaved: ``qkv(x).reshape(B, n, W, 3, heads, D).permute(3, 0, 4, 2, 1, 5)``
    puts token ``i * W + w`` in window ``w``, and the output goes back by ``transpose(1, 3)
    .reshape(B, L, C)``. The projection works on each token alone, so cutting the windows
    before it, ``x.reshape(B, n, W, C).transpose(1, 2)`` (B, W, n, C), and giving the output its
    (B, W, n, C) layout before putting it back, gives the same numbers, in the layout NesT's
    windows come in (``windows_into_batch`` then folds them). The window's token count is left
    to the reshapes (``-1``), so that a predictor can hand the projection fewer tokens per
    window. Returns how many were rewritten."""
    rewritten = 0
    graph = gm.graph
    for node in list(graph.nodes):
        match = _mask_unit_attention(gm, node)
        if match is not None:
            _cut_before_projection(graph, node, match)
            rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten


@dataclass(frozen=True)
class _MaskUnits:
    """Hiera's mask-unit attention as matched: its nodes from the tokens to the output put back,
    and its sizes."""

    tokens: fx.Node  # (B, L, C), entering the projection
    projection: fx.Node
    cut: fx.Node  # the reshape to (B, n, W, 3, heads, D)
    order: fx.Node  # its permute (3, 0, 4, 2, 1, 5)
    leaving: fx.Node  # the output's transpose(1, 3)
    back: fx.Node  # its reshape to (B, L, C)
    windows: int
    heads: int
    dim: int


def _mask_unit_attention(gm: fx.GraphModule, node: fx.Node) -> _MaskUnits | None:
    """``node`` as Hiera's mask-unit attention (``mask_units_before_projection``), or ``None``."""
    if not ops.is_sdpa(node) or len(node.args) != 3 or set(node.kwargs) - {"dropout_p"}:
        return None
    shape = ops.shape(node.args[0])
    projection = ops.projection_of(gm, node.args[0])
    if shape is None or len(shape) != 5 or projection is None or projection.op != "call_module":
        return None
    tokens = projection.args[0] if projection.args else None
    cut = _only_user(projection)
    order = _only_user(cut) if cut is not None else None
    if not isinstance(tokens, fx.Node) or cut is None or order is None:
        return None
    layout, cut_shape = ops.shape(tokens), ops.shape(cut)
    if (
        layout is None
        or len(layout) != 3
        or cut_shape is None
        or len(cut_shape) != 6
        or cut.op != "call_method"
        or cut.target not in ("reshape", "view")
        or order.op != "call_method"
        or order.target != "permute"
        or tuple(_shape_args(order)) != (3, 0, 4, 2, 1, 5)
    ):
        return None
    batch, inner, windows, three, heads, dim = cut_shape
    if (batch, inner * windows) != tuple(layout[:2]) or three != 3 or windows < 2:
        return None
    leaving = _only_user(node)
    back = _only_user(leaving) if leaving is not None else None
    if (
        leaving is None
        or back is None
        or leaving.op != "call_method"
        or leaving.target != "transpose"
        or sorted(_shape_args(leaving)) != [1, 3]
        or back.op != "call_method"
        or back.target not in ("reshape", "view")
        or ops.shape(back) != (batch, inner * windows, heads * dim)
    ):
        return None
    return _MaskUnits(tokens, projection, cut, order, leaving, back, windows, heads, dim)


def _cut_before_projection(graph: fx.Graph, node: fx.Node, m: _MaskUnits) -> None:
    """Cut the windows before the projection and give the output its (B, W, n, C) layout
    before putting it back (``mask_units_before_projection``)."""
    channels = ops.shape(m.tokens)[-1]
    windows, heads, dim = m.windows, m.heads, m.dim
    with graph.inserting_before(m.projection):
        sizes = graph.call_function(getattr, (m.tokens, "shape"))
        images = graph.call_function(operator.getitem, (sizes, 0))
        split = graph.call_method("reshape", (m.tokens, images, -1, windows, channels))
        in_windows = graph.call_method("transpose", (split, 1, 2))
        projected = graph.node_copy(
            m.projection,
            lambda arg, old=m.tokens, new=in_windows: new if arg is old else arg,
        )
        recut = graph.call_method("reshape", (projected, images, windows, -1, 3, heads, dim))
        reordered = graph.call_method("permute", (recut, 3, 0, 4, 1, 2, 5))
    m.order.replace_all_uses_with(reordered)
    with graph.inserting_before(m.leaving):
        moved = graph.call_method("permute", (node, 0, 2, 3, 1, 4))
        out_windows = graph.call_method("reshape", (moved, images, windows, -1, heads * dim))
        interleaved = graph.call_method("transpose", (out_windows, 1, 2))
        flat = graph.call_method("reshape", (interleaved, images, -1, heads * dim))
    m.back.replace_all_uses_with(flat)
    for dead in (m.back, m.leaving, m.order, m.cut, m.projection):
        if not dead.users:
            graph.erase_node(dead)


def windows_into_batch(gm: fx.GraphModule) -> int:
    """Fold the window axis of every SDPA on 5-D (B, heads, windows, N, D) operands (NesT's, with
    the windows on an axis of their own) into the batch: q, k, v as (B x windows, heads, N, D)
    (``q.transpose(1, 2).flatten(0, 1)``), the output unfolded back; the same numbers, since
    each window's attention is computed alone either way, and the form a windowed block is
    mapped in. Returns how many were rewritten; the caller records the shapes again."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        # q, k, v only: a mask (positional or not) would need folding too, which none needs yet.
        if not ops.is_sdpa(node) or len(node.args) != 3 or set(node.kwargs) - {"dropout_p"}:
            continue
        operands = list(node.args[:3])
        shapes = [ops.shape(o) if isinstance(o, fx.Node) else None for o in operands]
        if any(s is None or len(s) != 5 for s in shapes):
            continue
        windows = shapes[0][2]
        if any(s[:3] != shapes[0][:3] for s in shapes):
            continue
        # Only where the tokens are laid out in their windows before the projection, (B,
        # windows, N, C): Hiera's mask units are cut from the (B, L, C) tokens after it, by a
        # view that interleaves them, and stay as they are.
        projection = ops.projection_of(gm, operands[0])
        tokens = ops.shape(projection.args[0]) if projection is not None else None
        if tokens is None or tuple(tokens[:3]) != (shapes[0][0], windows, shapes[0][3]):
            continue
        graph = gm.graph
        with graph.inserting_before(node):
            folded = []
            for operand in operands:
                moved = graph.call_method("transpose", (operand, 1, 2))
                folded.append(graph.call_method("flatten", (moved, 0, 1)))
        node.args = (*folded, *node.args[3:])
        with graph.inserting_after(node):
            unfolded = graph.call_method("unflatten", (node, 0, (-1, windows)))
        with graph.inserting_after(unfolded):
            back = graph.call_method("transpose", (unfolded, 1, 2))
        node.replace_all_uses_with(
            back, delete_user_cb=lambda user, first=unfolded: user is not first
        )
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def heads_apart(gm: fx.GraphModule, example: Tensor) -> int:
    """Give every SDPA on (images x heads, N, D) operands its heads axis: its q, k, v (and an
    ``attn_mask`` batched the same way) unflattened to (B, heads, N, D), its output flattened
    back. Returns how many were rewritten; the caller records the shapes again."""
    candidates = []
    for node in gm.graph.nodes:
        found = _folded(gm, node) if ops.is_sdpa(node) else None
        if found is not None:
            candidates.append((node, *found))
    if not candidates:
        return 0
    # One index run for them all (a seed replaces its projection's output, whatever fed it).
    dtype = torch.float64 if example.dtype == torch.float64 else torch.float32
    seeds = {p: _row_index(ops.shape(p), dtype) for _, _, ps in candidates for p in ps}
    wanted = [operand for node, _, _ in candidates for operand in node.args[:3]]
    run = run_indices(gm, example, seeds, wanted)
    rewritten = 0
    for node, heads, _ in candidates:
        if not _images_first(run, node, heads, dtype):
            continue
        folded = ops.shape(node.args[0])[0]
        graph = gm.graph
        with graph.inserting_before(node):
            args = tuple(_unflatten(graph, a, heads, folded) for a in node.args)
            kwargs = {k: _unflatten(graph, v, heads, folded) for k, v in node.kwargs.items()}
        node.args, node.kwargs = args, kwargs
        with graph.inserting_after(node):
            flat = graph.call_method("flatten", (node, 0, 1))
        node.replace_all_uses_with(flat, delete_user_cb=lambda user, flat=flat: user is not flat)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
