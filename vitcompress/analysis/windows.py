"""Windowed attention (Swin, SAM's windowed blocks, ...): which window slot each token takes.

A block attends within windows when its attention core's batch is the images' batch times a
window count. Its tokens reach the core through ops that only move them (a shift, a partition
into windows, reshapes) and per-token ops (a norm), and its output goes back to the grid the same
way. Where that holds, the block is mapped with its window order: for every window slot, the index
of the token (in the order of the block's MLP input) it holds. A reduction then keeps the same
number of tokens in every window, which keeps the windows' batch a static shape.

The order is not derived from the ops' names or arguments: the graph is run once on the example
with token indices in place of the tokens (``IndexRun``), ops that work per token passing them
through, and what arrives at the core is read off. The same run checks that the attention's
output goes back to where its tokens came from. Padding (a grid that does not divide into its
windows) is read as slots that hold no token (-1). Anything else (a token in two windows, an op
that mixes tokens on the way) is refused in one line naming it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor, nn

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, Residual
from vitcompress.analysis.index_run import (
    IndexRun,
    grid_index,
    holds_seed_tokens,
    in_place_candidates,
    run_indices,
)
from vitcompress.analysis.model_map import AttentionCore, PositionUse, QueryBias, Windows
from vitcompress.analysis.positions import find_position_uses, gather_layout
from vitcompress.analysis.query_bias import find_query_bias, shape_read
from vitcompress.errors import UserError


class WindowError(UserError):
    """A windowed block whose windows cannot be kept whole under a reduction; one line."""


@dataclass
class WindowedBlock:
    """A windowed block as the analysis pairs it: its core, its attention residual (any rank:
    Swin's is on the (B, H, W, C) grid), its MLP residual on (B, L, C) tokens, and its windows."""

    core: AttentionCore
    attn: Residual
    mlp: Residual
    windows: Windows
    # Why no attention of the block scores its tokens (a factorised attention's, ``factorised.py``)
    score_blocker: str | None = None


def pooling_blocker(core: AttentionCore, windowed: bool = True) -> str | None:
    """Why a windowed core's block cannot be reduced, or ``None``: SAM2-Hiera's stage
    transitions pool the queries within each window (mask unit), so the block leaves fewer
    tokens than it takes and no window keeps its token count. Such a block is left whole: the
    blocks around it restore their tokens before their outputs, so it sees the full grid. Keys
    pooled in a window (or over a grid laid out from the tokens: NextViT's) are left whole too:
    reducing the tokens the window's keys are pooled from is not followed. ``windowed=False``:
    one attention over the whole grid (MViTv2's stage transitions), said without windows."""
    if core.key_tokens is None or core.query_tokens is None:
        return None
    if core.query_tokens == core.key_tokens:
        return None
    counts = f"{core.query_tokens} queries against {core.key_tokens} keys"
    if core.query_tokens > core.key_tokens:  # keys pooled, as PVT's reduction does
        where = "within each window" if windowed else "from its grid"
        return (
            f"its keys are pooled {where} ({counts}), and reducing the tokens they are "
            "pooled from is not supported there"
        )
    if not windowed:
        return (
            f"its queries are pooled ({counts}), so the block changes the token count and no "
            "reduction keeps it"
        )
    return (
        f"its queries are pooled ({counts} per window), so the block changes the token count "
        "and its windows cannot be reduced alike"
    )


def is_windowed(core: AttentionCore, image_batch: int) -> bool:
    """Whether ``core`` attends within windows: its batch is a multiple of the images'."""
    return core.batch is not None and core.batch > image_batch and core.batch % image_batch == 0


def attention_at(core: AttentionCore, image_batch: int) -> str:
    """How a refusal names ``core``: ``windowed attention at blocks.0.attn``, or, for one
    attention over a grid it was laid out from (NextViT's, MViTv2's), ``attention over its
    whole grid at ...``: the window analysis takes both."""
    kind = (
        "windowed attention" if is_windowed(core, image_batch) else "attention over its whole grid"
    )
    return f"{kind} at {core.path or core.node}"


def _closed_windows(
    gm: fx.GraphModule, core: AttentionCore, anc: Ancestry
) -> tuple[fx.Node, tuple[fx.Node, fx.Node, fx.Node]] | None:
    """The tokens entering ``core``'s query projection, laid out as its windows, and the
    residual add closing it (``_residual_after``); ``None`` where either is not found."""
    node = next(n for n in gm.graph.nodes if n.name == core.node)
    if core.batch is None or core.query_tokens is None:
        return None
    windows_in = None
    for operand in (0, 1):  # the keys' where the queries are global (GCViT's)
        found = window_tokens(gm, node, operand)
        if found is not None and _is_window_shaped(ops.shape(found), core.batch, core.query_tokens):
            windows_in = found
            break
    if windows_in is None:
        return None
    closing = _residual_after(node, windows_in, anc)
    return (windows_in, closing) if closing is not None else None


def closes_no_residual(gm: fx.GraphModule, core: AttentionCore, anc: Ancestry) -> bool:
    """Whether no residual add closes ``core``'s windows (or they are not found)."""
    return _closed_windows(gm, core, anc) is None


def on_grid(gm: fx.GraphModule, core: AttentionCore, anc: Ancestry) -> bool:
    """Whether ``core``'s residual add is on a grid of tokens, (B, H, W, C), not on (B, N, C)."""
    found = _closed_windows(gm, core, anc)
    return found is not None and len(ops.shape(found[1][0]) or ()) > 3


def through_grid(gm: fx.GraphModule, core: AttentionCore, anc: Ancestry) -> bool:
    """Whether ``core`` attends over its block's whole grid as one window while its tokens reach
    it laid out on that grid, (B, H, W, C) channels last: HF's Swin views a stage one window wide
    as its grid to partition it, with the grid's size taken from the stage, not the tokens, so
    its block reads the token count as the grid and must be mapped with its (one) window."""
    found = _closed_windows(gm, core, anc)
    if found is None:
        return False
    windows_in, (_, skip, _) = found
    channels = ops.shape(windows_in)[-1]
    for between in anc.between(skip, windows_in):
        shape = ops.shape(between)
        if (
            shape is not None
            and len(shape) > 3
            and shape[0] == core.batch
            and shape[-1] == channels
            and math.prod(shape[1:-1]) == core.query_tokens
        ):
            return True
    return False


def window_tokens(gm: fx.GraphModule, core_node: fx.Node, operand: int = 0) -> fx.Node | None:
    """The tokens entering the core's query projection (``operand`` 1: its key projection):
    (B * windows, tokens, C)."""
    if ops.is_sdpa(core_node):
        query = core_node.args[operand]
    else:
        query = ops.walk_back(core_node.args[0], lambda n: ops.is_matmul(n) or ops.is_einsum(n))
        if operand and query is not None:
            query = query.args[operand] if isinstance(query.args[operand], fx.Node) else None
    node = query
    for _ in range(16):
        if node is None:
            return None
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        functional = node.op == "call_function" and getattr(node.target, "__name__", "") == "linear"
        if isinstance(module, nn.Linear) or functional:  # SwinV2 calls F.linear with its biases
            return node.args[0] if node.args else node.kwargs.get("input")
        # Through tuple outputs too (``qkv.unbind(0)``): the first input of each op.
        inputs = node.all_input_nodes
        node = inputs[0] if inputs else None
    return None


def _is_window_shaped(shape: tuple | None, batch: int, tokens: int) -> bool:
    """(B * windows, tokens..., C), or the windows on an axis of their own, (B, windows, N, C)
    (NesT's): leading dims that make the batch, then the window's tokens, then the channels."""
    if shape is None or len(shape) < 3:
        return False
    return any(
        math.prod(shape[:split]) == batch and math.prod(shape[split:-1]) == tokens
        for split in range(1, len(shape) - 1)
    )


def window_axis(node: fx.Node, batch: int, tokens: int) -> bool:
    """Whether ``node`` holds windows on an axis of their own, (B, windows, N, C), the images
    times the windows being the attention's ``batch`` (NesT's): a predictor hands the attention
    (B, windows, K, C), which an attention written for that layout reads as it reads N."""
    shape = ops.shape(node) or ()
    return len(shape) == 4 and shape[0] * shape[1] == batch and shape[2] == tokens


def _window_axis_blocker(windows_in: fx.Node, batch: int) -> str | None:
    """Why a predictor cannot hand the attention fewer tokens per window, or ``None``: windows
    laid out on an axis of their own, (B, windows, N, C), are read by the attention as such (its
    reshapes name the window count and size), not as a batch of windows."""
    shape = ops.shape(windows_in) or ()
    if not shape or shape[0] == batch:
        return None
    return (
        f"its windows enter it on an axis of their own, {tuple(shape)}, not as a batch of "
        f"{batch} windows"
    )


def _residual_after(
    core: fx.Node, windows_in: fx.Node, anc: Ancestry
) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """The add closing the core's residual: ``(add, skip, branch)``, the skip an ancestor of the
    window tokens, the branch a descendant of the core, both of one shape."""
    for node in anc.nodes[anc.index[core] + 1 :]:
        if not ops.is_add(node) or not anc.is_ancestor(core, node):
            continue
        args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if len(args) != 2 or ops.shape(args[0]) != ops.shape(args[1]):
            continue
        for skip, branch in (args, args[::-1]):
            if anc.is_ancestor(skip, windows_in) and (
                branch is core or anc.is_ancestor(core, branch)
            ):
                return node, skip, branch
    return None


def _partial_residual(core: fx.Node, anc: Ancestry) -> str | None:
    """Why no residual add closes ``core`` where the first add after it is on a slice of the
    token axis of (B, N, C) tokens, ``x[:, 1:]`` (TimeSformer's time attention, whose windows
    leave the class token out and add back to the patch tokens alone, inside its block), or
    ``None``. Only asked once no residual closes the core: it names the failure, nothing maps
    differently."""
    for node in anc.nodes[anc.index[core] + 1 :]:
        if not ops.is_add(node) or not anc.is_ancestor(core, node):
            continue
        for skip in node.args[:2]:
            if (
                isinstance(skip, fx.Node)
                and skip.target is operator.getitem
                and not anc.is_ancestor(core, skip)
                and isinstance(skip.args[1], tuple)
                and len(skip.args[1]) > 1
                and isinstance(skip.args[1][1], slice)
            ):
                whole = ops.shape(skip.args[0]) or ()
                part = ops.shape(skip) or ()
                if len(whole) == 3 and len(part) == 3 and part[1] < whole[1]:
                    cut = skip.args[1][1]
                    step = f":{cut.step}" if cut.step is not None else ""
                    where = f"x[:, {_bound(cut.start)}:{_bound(cut.stop)}{step}]"
                    return (
                        f"its residual add ({node.name}) is on {part[1]} of its block's "
                        f"{whole[1]} tokens ({where}), so it closes no block of the residual "
                        "stream (a factorised attention, e.g. TimeSformer's time attention, "
                        "is not supported)"
                    )
        return None  # only the first add after the core
    return None


def _bound(value: object) -> str:
    return "" if value is None else str(value)


def _before_norms(gm: fx.GraphModule, windows_in: fx.Node) -> fx.Node:
    """The window tokens before the norms the attention applies itself (TinyViT normalises
    inside its attention, after reading the token count off its input): a predictor reduces
    there, so that what the attention reads its sizes from is already reduced."""
    node = windows_in
    while ops.is_norm(gm, node) and node.all_input_nodes:
        source = node.all_input_nodes[0]
        if ops.shape(source) != ops.shape(node):
            break
        node = source
    return node


def _window_output(branch: fx.Node, core: fx.Node, layout: tuple, anc: Ancestry) -> fx.Node | None:
    """The attention's output in the windows' own layout (``layout``: the shape of the tokens
    entering the query projection, (B * windows, tokens, C) or MaxViT's (B * windows, h, w, C)),
    the last such on the way back to the grid: after the output projection, before the windows
    are reshaped. Only the run of such nodes that follows the heads' merge counts: a view that
    splits the tokens into rows (Swin's (B * windows, h, w, C), or the one window of a grid as
    large as it) works on the full window only. The way back follows, at an op of several
    tensors (a concatenation with tokens the windows do not hold), the one the attention made."""
    chain = []
    node: fx.Node | None = branch
    for _ in range(64):
        if node is None or node is core:
            break
        chain.append(node)
        tensors = [n for n in node.all_input_nodes if ops.shape(n) is not None]
        node = next((n for n in tensors if n is core or anc.is_ancestor(core, n)), None)
    if node is not core:
        return None
    chain.reverse()  # from the core towards the grid
    first = next((i for i, n in enumerate(chain) if ops.shape(n) == layout), None)
    if first is None:
        return None
    last = first
    while (
        last + 1 < len(chain)
        and ops.shape(chain[last + 1]) == layout
        and not _moves_axes(chain[last + 1])
    ):
        last += 1
    return chain[last]


def _moves_axes(node: fx.Node) -> bool:
    """A transpose or permute: it lays a tensor out anew even where the shape stays (Hiera's
    (B, windows, N, C) put back as (B, N, windows, C) when there are as many windows as tokens
    in each)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in ("transpose", "permute", "swapaxes", "movedim")


def through_layout(node: fx.Node, start: fx.Node) -> bool:
    """Whether ``node`` is ``start`` or comes from it through layout ops only: Swin flattens its
    (B, H, W, C) grid into the MLP's (B, L, C) tokens, and reshapes them back for the next block."""
    for _ in range(8):
        if node is start:
            return True
        if not ops.is_layout(node):
            return False
        node = node.all_input_nodes[0]
    return False


def _channels_stay_last(node: fx.Node, start: fx.Node) -> bool:
    """Whether no transpose or permute on the layout path from ``start`` to ``node`` moves the
    last (channel) dim: DaViT's (B, C, H, W) grid after its attention is not channels last,
    though its sizes may read as if it were (C = W)."""
    while node is not start:
        rank = len(ops.shape(node.all_input_nodes[0]) or ())
        name = str(getattr(node.target, "__name__", node.target))
        dims = [a for a in node.args[1:] if isinstance(a, int)]
        if node.args[1:] and isinstance(node.args[1], (tuple, list)):
            dims = list(node.args[1])
        if "transpose" in name and any(d % rank == rank - 1 for d in dims):
            return False
        if "permute" in name and dims and dims[-1] % rank != rank - 1:
            return False
        node = node.all_input_nodes[0]
    return True


def _grid_residual_after(start: fx.Node, anc: Ancestry) -> Residual | None:
    """The residual whose skip is ``start`` (or a view of it) on tokens of any layout with the
    channels last, the first one after it: a block's MLP residual on its (B, H, W, C) grid."""
    shape = ops.shape(start)
    for node in anc.nodes[anc.index[start] + 1 :]:
        if not ops.is_add(node) or not anc.is_ancestor(start, node):
            continue
        args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if len(args) != 2 or ops.shape(args[0]) != ops.shape(args[1]):
            continue
        for skip, branch in (args, args[::-1]):
            if (
                through_layout(skip, start)
                and _channels_stay_last(skip, start)
                and anc.is_ancestor(skip, branch)
            ):
                if math.prod(ops.shape(skip)[1:-1]) != math.prod(shape[1:-1]):
                    return None
                return Residual(node, skip, branch, anc.between(skip, node))
    return None


def _residual_past_grid(add: fx.Node, residuals: list[Residual], anc: Ancestry) -> Residual | None:
    """The first residual on (B, L, C) tokens of the attention's token count after ``add``
    whose skip comes from it (through ops over the grid, which must keep every token at its
    place: ``_check_mlp_order``), with no attention on the way."""
    tokens = math.prod((ops.shape(add) or (0, 0))[1:-1])
    for residual in residuals:
        if anc.index[residual.add] <= anc.index[add] or not anc.is_ancestor(add, residual.skip):
            continue
        if ops.shape(residual.skip)[1] != tokens:
            return None
        return residual
    return None


def _check_mlp_order(
    gm: fx.GraphModule,
    example: Tensor,
    found: list,
    anc: Ancestry,
    dtype: torch.dtype,
    image_batch: int,
) -> None:
    """A block whose MLP input is not its attention's output through layout ops (a conv over
    the grid between them) reduces that input in the attention's windows: it must hold the
    same tokens in the same order. Run on indices, the ops in between passing a token's index
    on where they keep it at its place."""
    checks = [
        (core, attn, mlp)
        for core, _, _, attn, mlp in found
        if not through_layout(mlp.skip, attn.add) and mlp.skip is not attn.add
    ]
    if not checks:
        return
    seeds = {attn.add: grid_index(ops.shape(attn.add), dtype=dtype) for _, attn, _ in checks}
    in_place = in_place_candidates(
        n for _, attn, mlp in checks for n in anc.between(attn.add, mlp.skip) + [mlp.skip]
    )
    run = run_indices(gm, example, seeds, [mlp.skip for _, _, mlp in checks], in_place)
    for core, attn, mlp in checks:
        where = attention_at(core, image_batch)
        mixing = [p for n, p in run.mixing.items() if n in in_place]
        if mixing or not holds_seed_tokens(run.found.get(mlp.skip), seeds[attn.add]):
            blocker = f" ({mixing[0]} moves them)" if mixing else ""
            raise WindowError(
                f"{where}: the MLP after it does not read its tokens in their order{blocker}"
            )


def find_windowed_blocks(
    gm: fx.GraphModule,
    example: Tensor,
    cores: list[AttentionCore],
    residuals: list[Residual],
    image_batch: int,
    anc: Ancestry,
) -> list[WindowedBlock]:
    """Map every windowed core's block with its window order, or raise :class:`WindowError`."""
    by_name = {n.name: n for n in gm.graph.nodes}
    image = next(n for n in gm.graph.nodes if n.op == "placeholder")
    found: list[tuple[AttentionCore, fx.Node, fx.Node, Residual, Residual]] = []
    query_blockers: dict[str, str] = {}
    for core in cores:
        node = by_name[core.node]
        where = attention_at(core, image_batch)
        windows_in = window_tokens(gm, node)
        batch, tokens = core.batch, core.query_tokens
        global_query = None
        if windows_in is None or not _is_window_shaped(ops.shape(windows_in), batch, tokens):
            # GCViT's global query attention: the queries come from a global token generator,
            # the keys and values from the window tokens. Scored after it, the attention runs
            # whole and reducing its MLP is exact; the windows entering it cannot be reduced.
            keys_in = window_tokens(gm, node, operand=1)
            if keys_in is not None and _is_window_shaped(ops.shape(keys_in), batch, tokens):
                windows_in = keys_in
                global_query = (
                    "its queries do not come from its window tokens (a global query), so the "
                    "windows entering it cannot be reduced"
                )
        if windows_in is None or ops.shape(windows_in) is None:
            raise WindowError(f"{where}: its query projection is not found")
        pooled = pooling_blocker(core, is_windowed(core, image_batch))
        if pooled is not None:  # the analysis leaves these whole before it gets here
            raise WindowError(f"{where}: {pooled}")
        if not _is_window_shaped(ops.shape(windows_in), batch, tokens):
            raise WindowError(
                f"{where}: its tokens {ops.shape(windows_in)} are not "
                f"laid out as {batch} windows of {tokens}"
            )
        closing = _residual_after(node, windows_in, anc)
        if closing is None:
            raise WindowError(
                f"{where}: " + (_partial_residual(node, anc) or "no residual add closes it")
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
        attn = Residual(add, skip, branch, anc.between(skip, add))
        mlp = next(
            (
                r
                for r in residuals
                if anc.index[r.add] > anc.index[add] and through_layout(r.skip, add)
            ),
            None,
        )
        if mlp is None:  # on the grid itself, channels last (MaxViT)
            mlp = _grid_residual_after(add, anc)
        if mlp is None:  # past a conv over the grid (DaViT's, TinyViT's): checked below
            mlp = _residual_past_grid(add, residuals, anc)
        if mlp is None:
            raise WindowError(f"{where}: no MLP residual on its block's tokens follows it")
        back = _window_output(branch, node, ops.shape(windows_in), anc)
        if back is None:
            raise WindowError(f"{where}: its output never leaves the windows")
        found.append((core, windows_in, back, attn, mlp))
        if global_query is not None:
            query_blockers[core.node] = global_query

    seeds: dict[fx.Node, Tensor] = {}
    dtype = torch.float64 if example.dtype == torch.float64 else torch.float32
    for _, _, back, attn, _ in found:
        seeds[attn.skip] = grid_index(ops.shape(attn.skip), dtype=dtype)
        seeds[back] = grid_index(ops.shape(back), dtype=dtype)
    wanted = [w for _, w, _, _, _ in found] + [a.branch for _, _, _, a, _ in found]
    run = run_indices(gm, example, seeds, wanted)
    _check_mlp_order(gm, example, found, anc, dtype, image_batch)
    blocks = []
    for core, windows_in, back, attn, mlp in found:
        where = attention_at(core, image_batch)
        tokens = math.prod(ops.shape(attn.skip)[1:-1])
        between = set(anc.between(attn.skip, windows_in))
        order = _window_order(run, windows_in, between, core, image_batch, tokens, where)
        _check_return(run, attn.branch, order, core, image_batch, where)
        count = core.batch // image_batch
        inside = anc.between(windows_in, back) + [back]
        tables = find_position_uses(
            gm, image, {"attention": inside}, core, core.query_tokens, 0, anc.is_ancestor, False
        )
        entering = _attention_input(gm, windows_in, attn)
        core_node = by_name[core.node]
        axis = all(
            window_axis(n, core.batch, core.query_tokens) for n in (windows_in, entering, back)
        )
        bias = find_query_bias(gm, core_node, entering, core.query_tokens, image_batch)
        query_bias = bias if isinstance(bias, QueryBias) else None
        made = {by_name[name] for name in query_bias.nodes} if query_bias else set()
        global_query = None
        if core.node in query_blockers:
            global_query = _global_query(core, by_name, entering)
            if global_query is not None:
                del query_blockers[core.node]
                made |= _query_path(global_query, core, by_name)
        full = _full_window_reads(_size_reads(entering), made, back, anc)
        blocks.append(
            WindowedBlock(
                core=core,
                attn=attn,
                mlp=mlp,
                windows=Windows(
                    count=count,
                    tokens=core.query_tokens,
                    order=tuple(order.tolist()),
                    mlp_input_node=mlp.skip.name,
                    attention_input_node=entering.name,
                    attention_output_node=back.name,
                    tables=tables,
                    attention_blocker=query_blockers.get(core.node)
                    or _padded_blocker(order)
                    or (None if axis else _window_axis_blocker(windows_in, core.batch))
                    or (bias if isinstance(bias, str) else None)
                    or (None if axis else _spatial_shape_blocker(entering, core_node, anc, full))
                    or _tables_blocker(tables, by_name, core.batch, count)
                    or _unexplained_mask_blocker(core_node, tables, by_name, made),
                    spatial_product=not axis and bool(spatial_reads(entering)),
                    window_axis=axis,
                    query_bias=query_bias,
                    global_query=global_query.name if global_query is not None else None,
                    full_window_reads=tuple(sorted(n.name for n in full)),
                ),
            )
        )
    return blocks


def _padded_blocker(order: Tensor) -> str | None:
    """Why the windows entering a padded block's attention cannot be reduced, or ``None``: the
    windows at the grid's edges hold fewer tokens than the others, so no one count kept per
    window leaves the windows' batch whole and the padding untouched (after the attention, the
    windows are regrouped by their token counts: ``Windows.groups``)."""
    if bool((order >= 0).all()):
        return None
    return (
        "its windows are padded (the grid does not divide into its windows), so they enter the "
        "attention with different numbers of tokens"
    )


def _attention_input(gm: fx.GraphModule, windows_in: fx.Node, attn: Residual) -> fx.Node:
    """Where a predictor reduces the windows: before the norms that lead into the attention,
    but never on the residual stream itself (a one-window block that norms the stream, VOLO's):
    the stream also feeds the residual add, which keeps every token."""
    entering = _before_norms(gm, windows_in)
    entering = windows_in if entering is attn.skip else entering
    # SAM's ``x.reshape(B, H * W, C)`` of (B * windows, h, w, C) with the sizes read off x:
    # reduced there, the sizes it reads would not follow the kept tokens.
    spatial = _flattened_from(entering)
    if spatial is not None and spatial is not attn.skip and spatial_reads(spatial):
        return spatial
    return entering


def _flattened_from(node: fx.Node) -> fx.Node | None:
    """The (B, h, w, C) tensor ``node`` flattens to (B, h * w, C) by a reshape, or ``None``."""
    if not (node.op == "call_method" and node.target in ("reshape", "view") and node.args):
        return None
    source = node.args[0]
    shape = ops.shape(node) or ()
    before = ops.shape(source) if isinstance(source, fx.Node) else None
    if before is None or len(before) < 4 or len(shape) != 3:
        return None
    if shape != (before[0], math.prod(before[1:-1]), before[-1]):
        return None
    return source


def _global_query(
    core: AttentionCore, by_name: dict[str, fx.Node], entering: fx.Node
) -> fx.Node | None:
    """GCViT's global query as its attention's logits take it, (B * windows, heads, N, D), or
    ``None`` where it is not one: made without the window tokens, its rows by window slot (the
    attention's output rows, which go back to the slots: ``_check_return``). With fewer tokens
    per window its rows are gathered by the kept slots; the ops making it read the window's
    token count at the full window."""
    node = by_name[core.node]
    logits = by_name.get(core.logits_node or "") if not ops.is_sdpa(node) else node
    if logits is None or not logits.args or not isinstance(logits.args[0], fx.Node):
        return None
    query = logits.args[0]
    shape = ops.shape(query) or ()
    if _reads_values_of(query, entering) or len(shape) != 4:
        return None
    if shape[0] != core.batch or shape[2] != core.query_tokens:
        return None
    return query


def _reads_values_of(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` depends on ``source``'s values, not on its shape alone."""
    seen, frontier = {node}, [node]
    while frontier:
        current = frontier.pop()
        if current is source:
            return True
        if current.op == "call_function" and current.target is getattr:
            continue  # x.shape: the sizes, not the values
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                frontier.append(parent)
    return False


def _query_path(query: fx.Node, core: AttentionCore, by_name: dict[str, fx.Node]) -> set[fx.Node]:
    """The ops that make a global query and not the keys."""
    node = by_name[core.node]
    logits = node if ops.is_sdpa(node) else by_name[core.logits_node]
    keys = logits.args[1]
    return ops.ancestors(query) - (ops.ancestors(keys) if isinstance(keys, fx.Node) else set())


def _size_reads(entering: fx.Node) -> list[fx.Node]:
    """The reads of the windows' spatial sizes, or of their token count where they enter as
    (B * windows, N, C)."""
    reads = spatial_reads(entering)
    if reads or len(ops.shape(entering) or ()) != 3:
        return reads
    return [
        read
        for shape in entering.users
        for read in shape.users
        if shape_read(read, entering) in (1, -2)
    ]


def _full_window_reads(
    reads: list[fx.Node], made: set[fx.Node], back: fx.Node, anc: Ancestry
) -> set[fx.Node]:
    """The uses of the windows' spatial sizes that read them at the full window when the
    windows enter the attention reduced: the ops making a term from the queries by window
    position (``made``), guards on the sizes (the capture's checks that the input is the size
    it was captured at), and anything after the attention's output ``back``, which sees every
    token again."""
    return {
        user
        for read in reads
        for user in read.users
        if user in made or _only_guards(user) or anc.is_ancestor(back, user)
    }


def _only_guards(node: fx.Node) -> bool:
    """Whether ``node`` leads to nothing but ``torch._assert`` calls, through no tensor."""
    seen: set[fx.Node] = set()
    frontier = [node]
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.meta.get("is_tensor"):
            return False
        if not current.users and not (
            current.op == "call_function" and current.target is torch._assert
        ):
            return False
        frontier.extend(current.users)
    return True


def spatial_reads(entering: fx.Node) -> list[fx.Node]:
    """The reads of the windows' spatial sizes off their shape (``B, H, W, C = x.shape``,
    SAM2-Hiera's and VOLO's attention) that something uses, in axis order."""
    shape = ops.shape(entering) or ()
    if len(shape) <= 3:
        return []
    reads: dict[int, fx.Node] = {}
    for user in entering.users:
        if user.op != "call_function" or user.target is not getattr or user.args[1:] != ("shape",):
            continue
        for read in user.users:
            index = read.args[1] if len(read.args) > 1 else None
            if read.users and isinstance(index, int) and 0 < index % len(shape) < len(shape) - 1:
                reads.setdefault(index % len(shape), read)
    return [reads[axis] for axis in sorted(reads)]


def _spatial_shape_blocker(
    entering: fx.Node, core: fx.Node, anc: Ancestry, full: set[fx.Node]
) -> str | None:
    """Why the windows entering the attention cannot be handed over with fewer tokens, or
    ``None``. An attention that reads their spatial sizes (``B, H, W, C = x.shape``) takes the
    kept tokens as (B * windows, K, 1, C) instead. That is exact where it uses the sizes only as
    their product (``reshape(B, H * W, ...)``), and, after its softmax, to lay its output back
    out as its input was (``reshape(B, H, W, C)``). Any other use would treat K kept tokens as
    a K x 1 grid and is refused: a row read alone, or NesT's (B, T, N, C) read as windows T and
    tokens N, which a reshape before its softmax keeps apart. The uses in ``full`` read the
    sizes at the full window (``_full_window_reads``)."""
    shape = ops.shape(entering) or ()
    reads = spatial_reads(entering)
    if not reads:
        return None
    axes = set(range(1, len(shape) - 1))
    if len(reads) == len(axes) and all(
        _only_product_or_layout(read, reads, core, anc, full) for read in reads
    ):
        return None
    return (
        f"its attention reads the windows' spatial size off {entering.name} "
        f"({tuple(shape[1:-1])}) other than as their product, and fewer tokens per window have "
        "no such size"
    )


def _product_factors(node: object, reads: list[fx.Node]) -> list[fx.Node] | None:
    """The spatial reads a product of them multiplies (``H * W``, ``T * H * W``), or ``None``
    when ``node`` is anything else."""
    if isinstance(node, fx.Node) and node in reads:
        return [node]
    if not (
        isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.mul
    ):
        return None
    left, right = (_product_factors(arg, reads) for arg in node.args)
    return None if left is None or right is None else left + right


def _only_product_or_layout(
    read: fx.Node,
    reads: list[fx.Node],
    core: fx.Node,
    anc: Ancestry,
    full: set[fx.Node],
) -> bool:
    """Whether every use of one spatial read is the product of all of them, or a reshape after
    the attention core that lays a token axis out as the window's grid: the spatial sizes side
    by side in their order (``reshape(B, H, W, C)`` as the windows came in, HF SAM's
    ``view(B, heads, H, W, -1)``), so that K kept tokens are laid out K x 1; the uses in
    ``full`` aside."""
    for user in read.users:
        if user in full:
            continue
        if user.op == "call_method" and user.target in ("reshape", "view"):
            args = list(user.args[1:])
            if len(args) == 1 and isinstance(args[0], (list, tuple)):
                args = list(args[0])
            at = args.index(reads[0]) if reads[0] in args else -1
            side_by_side = at >= 0 and args[at : at + len(reads)] == reads
            others = [a for i, a in enumerate(args) if not at <= i < at + len(reads)]
            if not side_by_side or any(a in reads for a in others):
                return False
            if not anc.is_ancestor(core, user):
                return False
            continue
        product = user
        while True:
            factors = _product_factors(product, reads)
            if factors is None:
                return False
            if sorted(factors, key=reads.index) == reads and len(factors) == len(reads):
                break
            if len(product.users) != 1:
                return False
            product = next(iter(product.users))
    return True


def _unexplained_mask_blocker(
    core: fx.Node, tables: list[PositionUse], by_name: dict[str, fx.Node], made: set[fx.Node]
) -> str | None:
    """Why the attention cannot run on fewer or reordered tokens per window because of a term it
    adds to its logits that no table found by position explains, or ``None``. SAM's decomposed
    relative position is such a term: a bias made from the queries and two tables indexed by
    row and column offsets, laid out by where each query and key sits in its window, which a
    reduction would silently shuffle. Any parameter or buffer the mask is built from, other than
    through the queries, keys and values, must be one the found tables are built from, or make a
    term from the queries by window position (``made``: see ``query_bias.py``)."""
    if not ops.is_sdpa(core):
        return None
    mask = core.args[3] if len(core.args) > 3 else core.kwargs.get("attn_mask")
    if not isinstance(mask, fx.Node):
        return None
    explained = set(made)
    for use in tables:
        table = by_name.get(use.table_node)
        if table is not None:
            explained |= ops.ancestors(table)
    # Not what reaches the mask through the queries, keys or values: that is everything
    # upstream (a position embedding, earlier blocks' tables).
    for operand in core.args[:3]:
        if isinstance(operand, fx.Node):
            explained |= ops.ancestors(operand)
    unexplained = sorted(
        str(n.target) for n in ops.ancestors(mask) if n.op == "get_attr" and n not in explained
    )
    if not unexplained:
        return None
    return (
        f"its attention adds to its logits a term made from {unexplained[0]} that no table laid "
        "out by token position explains (it may depend on where each token sits in its window)"
    )


def _tables_blocker(
    tables: list[PositionUse], by_name: dict[str, fx.Node], batch: int, count: int
) -> str | None:
    """Why a window's attention cannot run on its kept tokens, or ``None``: every table it reads
    by position must be an attention bias on the logits, batched as the windows are, either
    (B * windows, heads, N, N) or viewed (B, windows, heads, N, N), so that each window's rows
    and columns can be gathered by its own kept positions (``modules/windows.py``)."""
    for use in tables:
        shape = ops.shape(by_name[use.node]) or ()
        if use.kind != "attention bias":
            return f"the {use.kind} {use.table} meets its {use.path} elsewhere than the logits"
        blocker = use.blocker
        if blocker is not None and len(use.shape) == 4 and use.shape[0] == batch:
            # Batched as the windows are (HF Swin adds its shift mask to the table first): it
            # is gathered per window, not per image.
            layout = gather_layout((1, *use.shape[1:]), 4, use.kind, use.shape[-1], 0)
            blocker = layout if isinstance(layout, str) else None
        if blocker is not None:
            return f"the table {use.table} at {use.path}: {blocker}"
        if len(shape) == 4 and shape[0] in (1, batch):
            continue
        if len(shape) == 5 and shape[1] == count and shape[0] * count == batch:
            continue
        return (
            f"the table {use.table} at {use.path} meets logits of shape {tuple(shape)}, not "
            f"batched as {count} windows per image"
        )
    return None


def _window_order(
    run: IndexRun,
    windows_in: fx.Node,
    between: set[fx.Node],
    core: AttentionCore,
    image_batch: int,
    total: int,
    where: str,
) -> Tensor:
    """The token index each window slot holds, windows one after another (one image's)."""
    if windows_in not in run.found:
        raise WindowError(f"{where}: its windows could not be traced")
    mixing = [p for n, p in run.mixing.items() if n in between or n is windows_in]
    values = run.found[windows_in]
    count, tokens = core.batch // image_batch, core.query_tokens
    values = values.reshape(image_batch, count * tokens, -1)
    if mixing or not torch.equal(values, values[..., :1].expand_as(values)):
        blocker = f" ({mixing[0]} mixes tokens)" if mixing else ""
        raise WindowError(
            f"{where}: the way from the block's tokens into its windows "
            f"is not a rearrangement{blocker}"
        )
    # A padded slot (the grid does not divide into windows) holds the padding's 0: index -1.
    index = values[..., 0].round().long() - 1
    order = index[0]
    real = order >= 0
    for b in range(image_batch):
        expected = torch.where(real, order + b * total, order)
        if not torch.equal(index[b], expected):
            raise WindowError(f"{where}: its windows mix tokens of different images")
    held = order[real].sort().values
    outside = total - held.numel()
    if 0 < outside < total and torch.equal(held, torch.arange(outside, total)):
        # A class token beside windows that cut the grid (ViTDet-like with a cls): each window
        # would need the prefix's count of its own, and a prefix token its own reduction.
        raise WindowError(
            f"{where}: {count} windows beside {outside} prefix token(s), which no window holds"
        )
    if not torch.equal(held, torch.arange(total)):
        raise WindowError(f"{where}: its windows do not hold each token exactly once")
    return order


def _check_return(
    run: IndexRun,
    branch: fx.Node,
    order: Tensor,
    core: AttentionCore,
    image_batch: int,
    where: str,
) -> None:
    """The attention's output must go back where its tokens came from: slot ``s`` to token
    ``order[s]``."""
    values = run.found.get(branch)
    if values is None:
        raise WindowError(f"{where}: its output could not be traced")
    real = order >= 0
    slots_in_all = order.numel()
    tokens = int(real.sum())
    values = values.reshape(image_batch, tokens, -1)
    slots = values[..., 0].round().long() - 1
    expected = torch.empty_like(order[real])
    expected[order[real]] = torch.arange(slots_in_all)[real]
    for b in range(image_batch):
        if not torch.equal(slots[b], expected + b * slots_in_all):
            raise WindowError(
                f"{where}: its output does not return to the tokens its windows were made from"
            )
