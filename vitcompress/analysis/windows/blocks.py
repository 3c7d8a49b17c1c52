"""Map every windowed core's block with its window order (the package's docstring says how):
pair each core with its windows and residuals, run the graph once on token indices, then read
each block's window order and its attention's blockers off that run."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch import Tensor

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, GraphFacts, Residual
from vitcompress.analysis.index_run import IndexRun, grid_index, run_indices
from vitcompress.analysis.model_map import AttentionCore
from vitcompress.analysis.positions import find_position_uses
from vitcompress.analysis.query_bias import QueryBias, find_query_bias
from vitcompress.analysis.window_map import (
    ReducedAttention,
    WholeAttention,
    WindowAttention,
    WindowLayout,
    Windows,
)
from vitcompress.analysis.windows.attention import (
    WindowedBlock,
    WindowError,
    attention_at,
    is_windowed,
    pooling_blocker,
)
from vitcompress.analysis.windows.checks import WindowFacts, attention_blocker
from vitcompress.analysis.windows.order import check_mlp_order, check_return, window_order
from vitcompress.analysis.windows.paths import (
    attention_input,
    grid_residual_after,
    is_window_shaped,
    partial_residual,
    residual_after,
    residual_past_grid,
    through_layout,
    window_axis,
    window_output,
    window_tokens,
)
from vitcompress.analysis.windows.sizes import (
    full_window_reads,
    global_query,
    query_path,
    size_reads,
    spatial_reads,
)
from vitcompress.analysis.windows.slots import find_slot_inputs

GLOBAL_QUERY = (
    "its queries do not come from its window tokens (a global query), so the windows entering "
    "it cannot be reduced"
)


@dataclass
class _Paired:
    """A windowed core with its windows' way in and out and its block's residuals."""

    core: AttentionCore
    windows_in: fx.Node  # the tokens entering the query projection (the keys' for a global query)
    back: fx.Node  # the attention's output in the windows' own layout
    attn: Residual
    mlp: Residual
    query_blocker: str | None  # GCViT's queries, made without the window tokens


def find_windowed_blocks(
    graph: GraphFacts, cores: list[AttentionCore], residuals: list[Residual]
) -> list[WindowedBlock]:
    """Map every windowed core's block with its window order, or raise :class:`WindowError`."""
    gm, example, image_batch, anc = graph.gm, graph.example, graph.image_batch, graph.anc
    paired = [_pair(gm, core, residuals, image_batch, anc) for core in cores]
    dtype = torch.float64 if example.dtype == torch.float64 else torch.float32
    seeds: dict[fx.Node, Tensor] = {}
    for p in paired:
        seeds[p.attn.skip] = grid_index(ops.shape(p.attn.skip), dtype=dtype)
        seeds[p.back] = grid_index(ops.shape(p.back), dtype=dtype)
    wanted = [p.windows_in for p in paired] + [p.attn.branch for p in paired]
    run = run_indices(gm, example, seeds, wanted)
    check_mlp_order(gm, example, [(p.core, p.attn, p.mlp) for p in paired], anc, dtype, image_batch)
    return [_windowed_block(gm, p, run, image_batch, anc) for p in paired]


def _windows_entering(
    gm: fx.GraphModule, node: fx.Node, core: AttentionCore
) -> tuple[fx.Node | None, str | None]:
    """The tokens entering the core's query projection, laid out as its windows; and, for
    GCViT's global query attention, the keys' instead with why the queries block a reduction:
    the queries come from a global token generator, the keys and values from the window tokens.
    Scored after it, the attention runs whole and reducing its MLP is exact; the windows
    entering it cannot be reduced."""
    windows_in = window_tokens(gm, node)
    batch, tokens = core.batch, core.query_tokens
    if windows_in is not None and is_window_shaped(ops.shape(windows_in), batch, tokens):
        return windows_in, None
    keys_in = window_tokens(gm, node, operand=1)
    if keys_in is not None and is_window_shaped(ops.shape(keys_in), batch, tokens):
        return keys_in, GLOBAL_QUERY
    return windows_in, None


def _pair(
    gm: fx.GraphModule,
    core: AttentionCore,
    residuals: list[Residual],
    image_batch: int,
    anc: Ancestry,
) -> _Paired:
    """The core's windows, the residual add closing them and the MLP residual after it; each
    failure is one line naming the attention."""
    node = anc.by_name[core.node]
    where = attention_at(core, image_batch)
    windows_in, query_blocker = _windows_entering(gm, node, core)
    if windows_in is None or ops.shape(windows_in) is None:
        raise WindowError(f"{where}: its query projection is not found")
    pooled = pooling_blocker(core, is_windowed(core, image_batch))
    if pooled is not None:  # the analysis leaves these whole before it gets here
        raise WindowError(f"{where}: {pooled}")
    if not is_window_shaped(ops.shape(windows_in), core.batch, core.query_tokens):
        raise WindowError(
            f"{where}: its tokens {ops.shape(windows_in)} are not "
            f"laid out as {core.batch} windows of {core.query_tokens}"
        )
    closing = residual_after(node, windows_in, anc)
    if closing is None:
        raise WindowError(
            f"{where}: " + (partial_residual(node, anc) or "no residual add closes it")
        )
    add, skip, branch = closing
    stream = ops.shape(skip) or ()
    if stream and stream[0] != image_batch:
        # TNT's pixel tokens, MobileViT's unfolded patches: the residual stream itself is
        # batched as windows, so there are no per-image tokens to put back.
        raise WindowError(
            f"{where}: its block's tokens are themselves cut into "
            f"windows ({stream[0]} rows of {math.prod(stream[1:-1])} tokens for "
            f"{image_batch} images, between blocks too), which is not supported"
        )
    mlp = _mlp_after(add, residuals, anc)
    if mlp is None:
        raise WindowError(f"{where}: no MLP residual on its block's tokens follows it")
    back = window_output(branch, node, ops.shape(windows_in), anc)
    if back is None:
        raise WindowError(f"{where}: its output never leaves the windows")
    attn = Residual(add, skip, branch, anc.between(skip, add))
    return _Paired(core, windows_in, back, attn, mlp, query_blocker)


def _mlp_after(add: fx.Node, residuals: list[Residual], anc: Ancestry) -> Residual | None:
    """The MLP residual after the attention's residual ``add``: on its tokens through layout
    ops, on the grid itself, channels last (MaxViT), or past a conv over the grid (DaViT's,
    TinyViT's: ``check_mlp_order`` checks it keeps every token at its place)."""
    mlp = next(
        (r for r in residuals if anc.index[r.add] > anc.index[add] and through_layout(r.skip, add)),
        None,
    )
    if mlp is None:
        mlp = grid_residual_after(add, anc)
    if mlp is None:
        mlp = residual_past_grid(add, residuals, anc)
    return mlp


def _windowed_block(
    gm: fx.GraphModule, p: _Paired, run: IndexRun, image_batch: int, anc: Ancestry
) -> WindowedBlock:
    """The block's windows as the index run found them, with what its attention reads by
    window position and why its windows cannot be reduced before it (``attention_blocker``)."""
    core, windows_in, back, attn = p.core, p.windows_in, p.back, p.attn
    by_name = anc.by_name
    where = attention_at(core, image_batch)
    tokens = math.prod(ops.shape(attn.skip)[1:-1])
    between = set(anc.between(attn.skip, windows_in))
    order = window_order(run, windows_in, between, core, image_batch, tokens, where)
    check_return(run, attn.branch, order, core, image_batch, where)
    count = core.batch // image_batch
    image = next(n for n in gm.graph.nodes if n.op == "placeholder")
    inside = anc.between(windows_in, back) + [back]
    tables = find_position_uses(
        gm, image, {"attention": inside}, core, core.query_tokens, 0, anc.is_ancestor, False
    )
    entering = attention_input(gm, windows_in, attn)
    core_node = by_name[core.node]
    axis = all(window_axis(n, core.batch, core.query_tokens) for n in (windows_in, entering, back))
    bias = find_query_bias(gm, core_node, entering, core.query_tokens, image_batch)
    made = {by_name[name] for name in bias.nodes} if isinstance(bias, QueryBias) else set()
    query = global_query(core, by_name, entering) if p.query_blocker is not None else None
    if query is not None:
        made |= query_path(query, core, by_name)
    full = full_window_reads(size_reads(entering), made, back, anc)
    blocker = p.query_blocker if query is None else None
    # In WindowFacts' field order.
    found = (core, core_node, windows_in, entering, order, count, axis, bias, blocker)
    facts = WindowFacts(*found, tables, made, full, anc, query)
    facts = replace(facts, slot_inputs=find_slot_inputs(facts))
    reason = attention_blocker(facts)
    attention: WindowAttention = (
        WholeAttention(reason)
        if reason is not None
        else ReducedAttention(_layout(axis, entering), facts.slot_inputs, entering.name, back.name)
    )
    windows = Windows(
        count=count,
        tokens=core.query_tokens,
        order=tuple(order.tolist()),
        attention=attention,
        mlp_input_node=p.mlp.skip.name,
    )
    return WindowedBlock(core=core, attn=attn, mlp=p.mlp, windows=windows)


def _layout(axis: bool, entering: fx.Node) -> WindowLayout:
    """How the windows enter the attention: on an axis of their own, read as spatial sizes
    (only as their product: the checks refuse any other read), or as a batch."""
    if axis:
        return WindowLayout.WINDOW_AXIS
    return WindowLayout.SPATIAL if spatial_reads(entering) else WindowLayout.BATCH
