"""Grid ops: the convs and pools inside a block whose input is its tokens laid out on their grid,
each with the tokens it was made from and the tokens it flattens back to; and pooling attention
(MViTv2's), whose grid is made per head inside the attention, so that it runs on every token."""

from __future__ import annotations

import math

import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, Residual
from vitcompress.analysis.model_map import GridOp
from vitcompress.analysis.refusals import MappingError


def find_grid_ops(
    gm: fx.GraphModule,
    attn: Residual,
    mlp: Residual | None,
    anc: Ancestry,
    attention_whole: bool,
) -> list[GridOp]:
    """The ops of a block that read its token grid; an attention that runs on every token
    (``attention_whole``) needs no grid given back, so its ops are not among them."""
    found = []
    branches = (("mlp", mlp),) if attention_whole else (("attention", attn), ("mlp", mlp))
    for branch_name, residual in branches:
        for node, kind, in_shape in _grid_nodes(gm, residual) if residual is not None else []:
            grid = tuple(in_shape[2:])  # (H, W), or a video's (T, H, W)
            found_tokens = tokens_before_grid(node.args[0], math.prod(grid))
            if found_tokens is None:
                reason = _per_head_grid(node, kind, in_shape, residual)
                if reason is not None:  # a pooling attention's block runs it whole: not here
                    raise MappingError(
                        f"{reason}, in the block's {branch_name} branch, where it cannot run "
                        "whole; the block's tokens cannot be reduced"
                    )
                continue
            tokens_node, to_grid = found_tokens
            from_grid = _flatten_back(node, math.prod(grid), len(in_shape))
            found.append(
                GridOp(
                    path=ops.module_path(node) if node.op == "call_module" else node.name,
                    kind=kind,
                    branch=branch_name,
                    grid=grid,
                    to_grid_node=to_grid.name,
                    tokens_node=tokens_node.name,
                    op_node=node.name,
                    from_grid_node=from_grid.name if from_grid is not None else None,
                )
            )
    return found


def _per_head_grid(node: fx.Node, kind: str, in_shape: tuple, residual: Residual) -> str | None:
    """Pooling attention (MViTv2): queries, keys or values split into heads, each head's laid
    out on the token grid ((images x heads, C/h, H, W)) and pooled by a conv there. No (B, N, C)
    tokens lead to that grid through layout ops alone, so the grid cannot be given back to
    reduced tokens before the op (as it is for PVT's spatial reduction, which pools the tokens
    themselves): the attention must run on every token. Returns why, or ``None`` where the op
    is not such a grid: one of more cells than the block has tokens is not of its tokens."""
    images, tokens = ops.shape(residual.skip)[0], ops.shape(residual.skip)[1]
    cells = math.prod(in_shape[2:])
    if in_shape[0] % images or cells > tokens:
        return None
    path = ops.module_path(node) if node.op == "call_module" else node.name
    heads = in_shape[0] // images
    return (
        f"pooling attention at {path}: the {kind} pools queries, keys or values split into "
        f"{heads} head{'s' if heads > 1 else ''} on the {'x'.join(map(str, in_shape[2:]))} "
        "token grid, a grid made per head inside the attention, not laid out from the block's "
        "(B, N, C) tokens"
    )


def pooling_attention(gm: fx.GraphModule, attn: Residual) -> str | None:
    """Why an attention residual's attention must run on every token because it pools on a grid
    made per head (``_per_head_grid``), or ``None``."""
    for node, kind, in_shape in _grid_nodes(gm, attn):
        if tokens_before_grid(node.args[0], math.prod(in_shape[2:])) is not None:
            continue
        reason = _per_head_grid(node, kind, in_shape, attn)
        if reason is not None:
            return f"{reason}, so the attention runs on every token"
    return None


def _grid_nodes(gm: fx.GraphModule, residual: Residual) -> list[tuple[fx.Node, str, tuple]]:
    """The residual's ops on a grid of 2 or more dims ((B, C, H, W) or a video's (B, C, T, H,
    W)): each with its kind and its input's shape."""
    found = []
    for node in residual.nodes:
        kind = ops.grid_op_kind(gm, node)
        if kind is None:
            continue
        in_shape = ops.shape(node.args[0])
        if in_shape is not None and len(in_shape) >= 4:
            found.append((node, kind, in_shape))
    return found


def tokens_before_grid(grid_node: fx.Node, cells: int) -> tuple[fx.Node, fx.Node] | None:
    """Walk back from a (B, C, H, W) tensor through layout ops to the (B, H*W, C) tokens it was
    made from; return them and the node on the path that consumes them.

    Of the 3-D tensors on the way, the earliest with H*W in dim 1 wins, so (B, C, N) tensors
    whose C happens to equal H*W are passed over.
    """
    child, node = grid_node, grid_node
    found: tuple[fx.Node, fx.Node] | None = None
    for _ in range(16):
        shape = ops.shape(node)
        if shape is not None and len(shape) == 3:
            if shape[1] == cells:
                found = (node, child)
            if not ops.is_layout(node):
                return found
        elif found is not None:
            return found
        parents = [p for p in node.all_input_nodes if ops.shape(p) is not None]
        if not parents:
            return found
        child, node = node, parents[0]
    return found


def _flatten_back(op: fx.Node, cells: int, rank: int = 4) -> fx.Node | None:
    """Follow the single-user chain after a grid op through grid-shaped ops (of ``rank`` dims:
    4 for (B, C, H, W)) and layout ops to the (B, H*W, C) tokens it flattens back to: the last
    such tensor before real compute resumes."""
    out_shape = ops.shape(op)
    if out_shape is None or len(out_shape) != rank or math.prod(out_shape[2:]) != cells:
        return None  # a strided conv or a pool changes the resolution: nothing to gather
    node, found = op, None
    for _ in range(16):
        # Reading the grid's size (``b, c, h, w = x.shape``, HF CvT) does not use its data.
        users = [u for u in node.users if u.meta.get("carries_tensor", True)]
        if len(users) != 1:
            break
        node = users[0]
        shape = ops.shape(node)
        if shape is None:
            break
        if not ops.is_layout(node) and len(shape) == 3:
            break
        if len(shape) == 3 and shape[1] == cells:
            found = node
        elif len(shape) != rank and len(shape) != 3:
            break
    return found
