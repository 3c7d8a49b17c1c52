"""Residual branches that work on each token alone after a windowed block, before the next
mapped block: DaViT's channel-attention blocks close with an MLP on the tokens the spatial
block before them gave back, in the same order.

The block's choice of window slots, made there or carried to it (a method's ``carry_branches``
setting, on by default), can reduce such a branch as it reduces a carried block's MLP: the
branch's input put in the block's windows, the kept tokens run through it, restored. Two things
are checked, not assumed:

- the branch's input holds the block's tokens in the block's order: the graph runs on token
  indices from the block's output (``IndexRun``), through ops that keep every token in place (a
  stride-1 conv over the grid) and through the residual adds on the way (a channel attention's,
  whose branch runs whole on every token: the index follows the skip);
- the branch works on each token alone and on any number of them: its ops run apart from the
  model on random tokens, then on a random subset of them laid out as windows of fewer tokens;
  every token must come out as it did among all of them.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch import Tensor

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, Residual
from vitcompress.analysis.index_run import (
    grid_index,
    holds_seed_tokens,
    in_place_candidates,
    run_indices,
)
from vitcompress.analysis.model_map import Block, PerTokenBranch


def find_per_token_branches(
    gm: fx.GraphModule,
    example: Tensor,
    blocks: list[Block],
    residuals: list[Residual],
    attention_nodes: set[str],
    anc: Ancestry,
) -> None:
    """Fill ``Block.per_token_after`` of every windowed block (not padded): the residual
    branches after it, before the next mapped block, on its tokens in its order, whose branch
    holds no attention and works on each token alone."""
    by_name = anc.by_name
    taken = {name for b in blocks for name in (b.attn_add_node, b.output_node)}
    dtype = torch.float64 if example.dtype == torch.float64 else torch.float32
    for block, following in zip(blocks, blocks[1:] + [None], strict=True):
        if block.windows is None or block.windows.padded:
            continue
        start = by_name[block.output_node]
        shape = ops.shape(start)
        if shape is None:
            continue
        tokens = math.prod(shape[1:-1])
        end = anc.index[by_name[following.input_node]] if following else len(anc.nodes)
        within = [
            r
            for r in residuals
            if anc.index[start] < anc.index[r.add] <= end
            and r.add.name not in taken
            and (r.skip is start or anc.is_ancestor(start, r.skip))
        ]
        candidates = [
            r
            for r in within
            if (skip_shape := ops.shape(r.skip)) is not None
            and math.prod(skip_shape[1:-1]) == tokens
            and skip_shape[-1] == shape[-1]
            and not any(n.name in attention_nodes for n in r.nodes)
        ]
        # A residual inside another one's branch (``h + inner(h)`` within ``x + outer(...)``)
        # is reduced with it: only the outermost are candidates.
        candidates = [
            r for r in candidates if not any(r.add in other.nodes for other in candidates)
        ]
        if not candidates:
            continue
        in_order = _in_order(gm, example, start, candidates, within, anc, dtype)
        block.per_token_after = [
            PerTokenBranch(
                path=_branch_path(r),
                input_node=r.skip.name,
                output_node=r.add.name,
            )
            for r in candidates
            if r.add in in_order and _works_per_token(gm, r, block.windows.count)
        ]


def _in_order(
    gm: fx.GraphModule,
    example: Tensor,
    start: fx.Node,
    candidates: list[Residual],
    within: list[Residual],
    anc: Ancestry,
    dtype: torch.dtype,
) -> set[fx.Node]:
    """The adds of the candidates whose input holds the tokens of ``start`` in their order: run
    on token indices from ``start``; every residual add on the way passes its skip's index on
    (its branch runs on all the tokens, whatever it mixes), a conv over the grid keeps each
    token at its place, every other op runs on the indices as it is."""
    seed = grid_index(ops.shape(start), dtype=dtype)
    skips = {r.add: r.skip for r in within}
    branches = {n for r in within for n in r.nodes}
    on_way = {n for r in candidates for n in anc.between(start, r.skip) + [r.skip]} - branches
    in_place = in_place_candidates(on_way)
    run = run_indices(gm, example, {start: seed}, [r.skip for r in candidates], in_place, skips)
    return {r.add for r in candidates if holds_seed_tokens(run.found.get(r.skip), seed)}


def _works_per_token(gm: fx.GraphModule, residual: Residual, windows: int) -> bool:
    """Whether the residual's branch gives each token what it gave among all the tokens when it
    runs on a random subset of them laid out as ``windows`` windows of fewer tokens (as a
    carried choice hands it). Run apart from the model, one image, random tokens."""
    shape = ops.shape(residual.skip)
    if shape is None or len(shape) != 3:
        return False
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {residual.skip: graph.placeholder("tokens")}
    inside = set(residual.nodes)

    def copy(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        if node.op != "get_attr" and node not in inside and not _reads_shape_of(node, residual):
            raise _NotPerToken
        for parent in node.all_input_nodes:
            copy(parent)
        env[node] = graph.node_copy(node, lambda arg: env[arg])
        return env[node]

    parameter = next(iter(gm.parameters()), None)
    dtype = parameter.dtype if parameter is not None else torch.float32
    device = parameter.device if parameter is not None else None  # a model on a GPU too
    generator = torch.Generator().manual_seed(0)
    try:
        graph.output(copy(residual.branch))
        branch = fx.GraphModule(gm, graph)
        tokens, channels = math.prod(shape[1:-1]), shape[-1]
        per_window = max(1, tokens // windows // 2)
        if per_window * windows >= tokens:
            return False
        every = torch.randn((1, tokens, channels), generator=generator, dtype=dtype).to(device)
        subset = torch.randperm(tokens, generator=generator)[: per_window * windows].to(device)
        with torch.no_grad():
            whole = branch(every).reshape(tokens, -1)
            part = branch(every[0, subset].reshape(windows, per_window, channels))
        part = part.reshape(per_window * windows, -1)
    except (_NotPerToken, RuntimeError, TypeError, ValueError, IndexError):
        return False
    if part.shape != whole[subset].shape:
        return False
    scale = whole.abs().amax().clamp_min(1e-30)
    return bool(((part - whole[subset]).abs() <= 1e-5 * scale).all())


def _branch_path(residual: Residual) -> str:
    """The modules the branch calls, by their common path and what differs below it:
    ``stages.0.blocks.0.1.{norm2,mlp}`` (the block's path alone would name its attention too)."""
    paths = [p for n in residual.nodes if (p := ops.module_path(n))]
    if not paths:
        return residual.add.name
    common = ops.common_path(paths)
    below = list(dict.fromkeys(p[len(common) :].lstrip(".").split(".")[0] for p in paths))
    below = [name for name in below if name]
    if not below:
        return common
    named = below[0] if len(below) == 1 else "{" + ",".join(below) + "}"
    return f"{common}.{named}" if common else named


def _reads_shape_of(node: fx.Node, residual: Residual) -> bool:
    """``x.shape`` or ``x.shape[i]`` of a value in the branch (or its input)."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[0] is residual.skip or node.args[0] in residual.nodes
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and _reads_shape_of(source, residual)
    return False


class _NotPerToken(Exception):
    pass
