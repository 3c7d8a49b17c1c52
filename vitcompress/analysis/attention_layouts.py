"""Attention written in other layouts, rewritten to the (B x windows, heads, N, D) one every later
step reads: SAM's heads folded into the batch (``heads_apart``), NesT's windows on an axis of
their own (``windows_into_batch``).

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
