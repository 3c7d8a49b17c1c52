"""Where a window attention's tokens enter it and leave it: the tokens entering its query
projection, the residual add closing it, its output in the windows' own layout, the MLP residual
after it (on (B, L, C) tokens, on the grid itself, or past a conv over the grid), and where a
predictor reduces the windows."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator

import torch.fx as fx
from torch import nn

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, Residual
from vitcompress.analysis.model_map import AttentionCore
from vitcompress.analysis.windows.sizes import spatial_reads


def _closed_windows(
    gm: fx.GraphModule, core: AttentionCore, anc: Ancestry
) -> tuple[fx.Node, tuple[fx.Node, fx.Node, fx.Node]] | None:
    """The tokens entering ``core``'s query projection, laid out as its windows, and the
    residual add closing it (``residual_after``); ``None`` where either is not found."""
    node = anc.by_name[core.node]
    if core.batch is None or core.query_tokens is None:
        return None
    windows_in = None
    for operand in (0, 1):  # the keys' where the queries are global (GCViT's)
        found = window_tokens(gm, node, operand)
        if found is not None and is_window_shaped(ops.shape(found), core.batch, core.query_tokens):
            windows_in = found
            break
    if windows_in is None:
        return None
    closing = residual_after(node, windows_in, anc)
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


def is_window_shaped(shape: tuple | None, batch: int, tokens: int) -> bool:
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


def _adds_after(start: fx.Node, anc: Ancestry) -> Iterator[tuple[fx.Node, list[fx.Node]]]:
    """The adds after ``start`` that depend on it, of two tensors of one shape, in graph order:
    each with its two operands (a residual add's candidates)."""
    for node in anc.nodes[anc.index[start] + 1 :]:
        if not ops.is_add(node) or not anc.is_ancestor(start, node):
            continue
        args = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if len(args) == 2 and ops.shape(args[0]) == ops.shape(args[1]):
            yield node, args


def residual_after(
    core: fx.Node, windows_in: fx.Node, anc: Ancestry
) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """The add closing the core's residual: ``(add, skip, branch)``, the skip an ancestor of the
    window tokens, the branch a descendant of the core, both of one shape."""
    for node, args in _adds_after(core, anc):
        for skip, branch in (args, args[::-1]):
            if anc.is_ancestor(skip, windows_in) and (
                branch is core or anc.is_ancestor(core, branch)
            ):
                return node, skip, branch
    return None


def partial_residual(core: fx.Node, anc: Ancestry) -> str | None:
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


def window_output(branch: fx.Node, core: fx.Node, layout: tuple, anc: Ancestry) -> fx.Node | None:
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


def grid_residual_after(start: fx.Node, anc: Ancestry) -> Residual | None:
    """The residual whose skip is ``start`` (or a view of it) on tokens of any layout with the
    channels last, the first one after it: a block's MLP residual on its (B, H, W, C) grid."""
    shape = ops.shape(start)
    for node, args in _adds_after(start, anc):
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


def residual_past_grid(add: fx.Node, residuals: list[Residual], anc: Ancestry) -> Residual | None:
    """The first residual on (B, L, C) tokens of the attention's token count after ``add``
    whose skip comes from it (through ops over the grid, which must keep every token at its
    place: ``check_mlp_order``), with no attention on the way."""
    tokens = math.prod((ops.shape(add) or (0, 0))[1:-1])
    for residual in residuals:
        if anc.index[residual.add] <= anc.index[add] or not anc.is_ancestor(add, residual.skip):
            continue
        if ops.shape(residual.skip)[1] != tokens:
            return None
        return residual
    return None


def attention_input(gm: fx.GraphModule, windows_in: fx.Node, attn: Residual) -> fx.Node:
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
