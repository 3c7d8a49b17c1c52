"""Refusals and what is left whole: the model-level refusals the analysis raises as
:class:`MappingError` (windowed attention on batched 3-D tensors, attention over channels, a
windowed block that reads its grid in its MLP) and, for every attention core no block maps, why
it runs whole (the model map's ``left_whole``)."""

from __future__ import annotations

import math
import operator

import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Residual, find_window_axis_attention
from vitcompress.analysis.model_map import AttentionCore, Block
from vitcompress.analysis.windows import is_windowed, pooling_blocker, window_tokens
from vitcompress.errors import UserError


class MappingError(UserError):
    """The graph does not look like a ViT this tool can rewrite; says what was found and missing."""


def placeholder(gm: fx.GraphModule) -> fx.Node:
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            return node
    raise MappingError("the graph has no input")


def windowed_batched_attention(gm: fx.GraphModule, image_batch: int) -> str | None:
    """The windowed refusal for attention written on 3-D (batch x heads, N, D) tensors (SAM):
    such a core is not a token-attention core, but where the tokens entering its projection are
    batched as images x windows, the model attends within windows all the same."""
    for node in gm.graph.nodes:
        if ops.is_sdpa(node):
            query = node.args[0]
        elif ops.is_softmax(node, gm):
            query = ops.walk_back(node.args[0], lambda n: ops.is_matmul(n) or ops.is_einsum(n), 8)
        else:
            continue
        shape = ops.shape(query) if query is not None else None
        if shape is None or len(shape) != 3:
            continue
        projection = ops.projection_of(gm, query)
        tokens = ops.shape(projection.args[0]) if projection is not None else None
        if tokens is None or len(tokens) < 3:
            continue
        if tokens[0] > image_batch and tokens[0] % image_batch == 0:
            per_window = math.prod(tokens[1:-1])
            return (
                f"windowed attention: tokens cannot be dropped without breaking the windows "
                f"({ops.module_path(node)} attends within {tokens[0] // image_batch} windows "
                f"of {per_window} tokens per image)"
            )
    return None


def channel_attention(
    by_name: dict[str, fx.Node], cores: list[AttentionCore], residuals: list[Residual]
) -> str | None:
    """The refusal for attention over channels (XCiT's cross-covariance attention): a core whose
    query and key vectors run along the token axis of the residual it lies in, so that its
    softmax weighs channels against channels (C/h x C/h per head) and no token attends to
    another. There is no token attention to score nor a token axis for it to reduce."""
    for core in cores:
        reason = over_channels(core, by_name, residuals)
        if reason is not None:
            return f"cross-covariance attention over channels at {core.path or core.node}: {reason}"
    return None


def over_channels(
    core: AttentionCore, by_name: dict[str, fx.Node], residuals: list[Residual]
) -> str | None:
    """Why ``core`` attends over channels, not tokens, or ``None``."""
    node = by_name[core.node]
    if core.kind == "sdpa":
        query = node.args[0]
    elif core.kind == "matmul_softmax" and core.logits_node is not None:
        query = by_name[core.logits_node].args[0]
    else:
        return None
    q_shape = ops.shape(query) if isinstance(query, fx.Node) else None
    if q_shape is None or len(q_shape) < 3:
        return None
    for residual in residuals:
        tokens = ops.shape(residual.skip)[1]
        if node not in residual.nodes or core.query_tokens == tokens:
            continue
        # The product contracts the tokens: (.., C/h, N) @ (.., N, C/h).
        if q_shape[-1] == tokens and q_shape[-2] == core.query_tokens:
            return (
                f"its softmax weighs {core.query_tokens} x {core.key_tokens} channels per "
                f"head over all {tokens} tokens, so there is no token attention to score "
                "or reduce"
            )
    return None


def unmapped(
    gm: fx.GraphModule,
    found: list[AttentionCore],
    blocks: list[Block],
    residuals: list[Residual],
    image_batch: int,
    by_name: dict[str, fx.Node],
) -> dict[str, str]:
    """Every attention core no block maps, with why: each runs whole, and the model map says so
    (``left_whole``, printed by ``vitcompress inspect``) rather than leaving it out silently."""
    mapped = {b.attention.node for b in blocks} | {c.node for b in blocks for c in b.parallel_cores}
    on_axis = {w.node.name: w for w in find_window_axis_attention(gm, image_batch)}
    reasons: dict[str, str] = {}
    for core in found:
        if core.node in mapped:
            continue
        reason = pooling_blocker(core, is_windowed(core, image_batch)) or over_channels(
            core, by_name, residuals
        )
        if reason is None and core.node in on_axis:
            axis = on_axis[core.node]
            reason = (
                f"it attends within {axis.windows} windows of {axis.tokens} tokens per image "
                "laid out on an axis of their own, which no block is mapped from"
            )
        if reason is None:
            reason = _queries_fewer_than_tokens(gm, core, by_name, image_batch)
        if reason is None:
            reason = (
                "no block is mapped around it (no attention residual followed by an MLP "
                "residual on its tokens)"
            )
        reasons[core.node] = f"{core.path or core.node}: {reason}"
    for name, axis in on_axis.items():  # 5-D attention no core was found for
        if name in mapped or name in reasons:
            continue
        keys = ops.shape(axis.node.args[1]) if ops.is_sdpa(axis.node) else None
        if keys is not None and len(keys) == 5 and keys[3] != axis.tokens:  # Hiera's
            reason = (
                f"its queries are pooled ({axis.tokens} queries against {keys[3]} keys per "
                "window), so the block changes the token count and its windows cannot be "
                "reduced alike"
            )
        else:
            reason = (
                f"it attends within {axis.windows} windows of {axis.tokens} tokens per image "
                "laid out on an axis of their own, which no block is mapped from"
            )
        reasons[name] = f"{axis.path or name}: {reason}"
    return reasons


def _queries_fewer_than_tokens(
    gm: fx.GraphModule, core: AttentionCore, by_name: dict[str, fx.Node], image_batch: int
) -> str | None:
    """Why an attention over the whole grid that pools its queries and keys alike (MViTv2's
    stage-1 transition: 3136 tokens in, 784 queries against 784 keys) is left whole: it gives
    out fewer tokens than it takes; ``None`` where it does not."""
    taken = window_tokens(gm, by_name[core.node])
    shape = ops.shape(taken) if taken is not None else None
    if (
        shape is None
        or len(shape) != 3
        or shape[0] != image_batch
        or core.batch != image_batch
        or core.query_tokens is None
        or core.query_tokens >= shape[1]
    ):
        return None
    return (
        f"its queries are pooled ({shape[1]} tokens in, {core.query_tokens} queries), so the "
        "block changes the token count and no reduction keeps it"
    )


def check_windowed_block(block: Block) -> None:
    """A windowed block runs its MLP on the kept tokens of every window: a conv or a position
    table there would need the grid, which it does not have."""
    mlp_ops = [op for op in block.grid_ops if op.branch == "mlp"]
    mlp_tables = [use for use in block.position_uses if use.branch == "mlp"]
    if mlp_ops or mlp_tables:
        what = f"the {mlp_ops[0].kind} {mlp_ops[0].path}" if mlp_ops else mlp_tables[0].table
        raise MappingError(
            f"windowed block {block.index} ({block.path}) reads the token grid in its MLP "
            f"({what}); reducing within its windows is not supported there"
        )


def attention_maps_out(
    gm: fx.GraphModule, by_name: dict[str, fx.Node], blocks: list[Block]
) -> str | None:
    """The refusal for a block whose attention probabilities leave the attention other than as
    the weights of its sum over the values (a model returning its attention maps, a saliency
    read off them, or an attention rollout, the maps multiplied block after block): their token
    axes are the block's tokens, which a reduction re-sorts and removes, and nothing restores a
    map's two axes."""
    origins: dict[fx.Node, AttentionCore] = {}
    for block in blocks:
        for core in [block.attention, *block.parallel_cores]:
            node = by_name.get(core.node)
            if node is None or core.kind == "sdpa":  # sdpa gives no probabilities out
                continue
            if core.kind == "multihead_attention":  # (output, weights): the weights
                starts = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
            else:
                starts = [node]
            origins.update(dict.fromkeys(starts, core))
    maps = _maps_of(gm, origins)
    for node, core in maps.items():
        if any(user.op == "output" for user in node.users):
            return (
                f"the attention maps of {core.path or core.node} reach the model's "
                f"output ({node.name}, not only as the weights of the attention's "
                "sum): their token axes would change with the kept tokens; return them "
                "from the base model"
            )
    return None


def _maps_of(
    gm: fx.GraphModule, origins: dict[fx.Node, AttentionCore]
) -> dict[fx.Node, AttentionCore]:
    """Every node that still holds attention maps, each with the attention it came from, in one
    pass in graph order (a graph is in topological order). Any op on a map gives a map, but a
    product (``@``, einsum) ends it where it is the attention's weighted sum: a product is a map
    only where its other operands are maps too (a rollout, ``attn @ rollout``) or constants
    that keep its shape (``attn @ eye``, a rollout's start), never where they are the values."""
    maps: dict[fx.Node, AttentionCore] = {}
    for node in gm.graph.nodes:
        if node in origins:
            maps[node] = origins[node]
            continue
        inputs = ops.tensor_inputs(node)
        from_maps = [n for n in inputs if n in maps]
        if not from_maps or node.op == "output":
            continue
        if (ops.is_matmul(node) or ops.is_einsum(node)) and not _keeps_maps(node, inputs, maps):
            continue
        maps[node] = maps[from_maps[0]]
    return maps


def _keeps_maps(product: fx.Node, inputs: list[fx.Node], maps: dict) -> bool:
    """Whether a product of maps with ``inputs`` is a map again: its other operands are maps, or
    constants it keeps the maps' shape with (a rollout's identity)."""
    others = [n for n in inputs if n not in maps]
    if not others:
        return True
    shape = ops.shape(product)
    same_shape = shape is not None and any(shape == ops.shape(n) for n in inputs if n in maps)
    return same_shape and all(_constant(n) for n in others)


def _constant(node: fx.Node) -> bool:
    """Whether ``node`` is computed from no input image: from sizes, constants and buffers."""
    return not any(n.op == "placeholder" for n in ops.reachable(node, ops.tensor_inputs))
