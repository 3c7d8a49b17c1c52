"""Analytic MACs of a plan, from the token counts each block sees: no forward per candidate.

One measured profile of the base (MACs per block, split by kind of work) is scaled by the token
counts a plan leaves each block with. Per block:

* attention products (``q @ k^T`` and ``attn @ v``: SDPA kernels, ``bmm``) grow with queries x
  keys: quadratically in the block's tokens when it attends over its own tokens, linearly when its
  keys are pooled from the full grid (spatial-reduction attention keeps its key count);
* convolutions and pools run on the grid, which a reduced stage gets back padded at inference:
  constant;
* the keys' and values' own projections scale with the keys (constant when they are pooled);
* everything else (linear layers, norms) is per token, split at the residual add closing the
  attention: the attention branch sees the tokens the block was entered with, the MLP branch
  those left after an in-block reduction (eTPS/EViT; a parallel block's MLP reads the block's
  input, so it sees those the block was entered with too).

Which node's work is which is read off the captured graph, node by node (``graph_profile.py``):
the block is what runs between its input and its output, work that does not depend on the image
(a position table built from coordinates) belongs to no block. Where the graph cannot be run so,
the split falls back to module paths.

The reducers a plan inserts add their own work, which each method counts from dimensions
(``Variant.location_macs``: its scorer's and its fuse's): the predictor's MLP over the patch
tokens present (dTPS/DynamicViT), the donor-host similarity of squeezing (``donors x hosts x C``:
dTPS/eTPS), the cls-row attention score (eTPS/EViT on SDPA) and ToMe's bipartite similarity
(``ceil(t/2) x floor(t/2) x head dim`` in every merging block; its size-weighted averages and
``log s`` bias are not multiply-accumulates). A method that cannot count its work is not searched.
Everything before the blocks (patch embedding, a pyramid's next patch embedding on the full grid)
is constant. What runs after the last block that attends over its own tokens (the "tail": class
attention (CaiT), an attention-pooling head (SigLIP, PE), the head) is constant plus a cost per
token leaving that block, measured once: the base's graph is run from that block's output with
a quarter of the tokens dropped, and the MACs saved divided by the tokens dropped. A tail that
cannot run on fewer tokens (it reshapes them to the grid), or that the compressed model gives
the full tokens back to (a block's ``readers``), costs the same at any keep. :func:`cross_check`
compares the result with the counted MACs of compressed models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.plan import Plan
from vitcompress.measure.macs import run_counter
from vitcompress.search.graph_profile import GraphProfile, add_ops, tail_cost
from vitcompress.variants import BEFORE_BLOCK, ScoringCost

# aten ops whose work is the attention products (counted by FlopCounterMode as 2 FLOPs per MAC).
_ATTENTION_PRODUCT_OPS = ("bmm", "baddbmm", "scaled_dot_product", "_flash_attention", "_efficient")
_GRID_OPS = ("convolution", "pool")


def _is(op: Any, names: tuple[str, ...]) -> bool:
    text = str(op)
    return any(name in text for name in names)


@dataclass(frozen=True)
class BlockCost:
    """One block's base MACs by kind of work (see the module's docstring)."""

    tokens: int  # tokens (prefix included) the block sees in the base
    key_tokens: int  # keys its attention sees in the base
    own_keys: bool  # keys are the block's own tokens (False: pooled from the full grid)
    attention_products: float
    attention_linear: float  # attention branch, per token
    key_linear: float  # the keys' and values' own projections, per key
    mlp_linear: float  # the rest of the block, per token
    grid: float  # convolutions/pools on the (padded) grid
    dim: int
    attention_width: float  # heads x head dim, from the attention products
    heads: int
    prefix_tokens: int
    patch_tokens: int  # the stage's N0
    parallel_mlp: bool = False  # ``x + attn(h) + mlp(h)``: the MLP sees the block's input

    def macs(self, attention_tokens: int, mlp_tokens: int) -> float:
        keys = attention_tokens if self.own_keys else self.key_tokens
        products = (
            self.attention_products * (attention_tokens * keys) / (self.tokens * self.key_tokens)
        )
        return (
            products
            + self.attention_linear * attention_tokens / self.tokens
            + self.key_linear * keys / self.key_tokens
            + self.mlp_linear * mlp_tokens / self.tokens
            + self.grid
        )


@dataclass(frozen=True)
class CostModel:
    """The base's profile; :meth:`macs` gives a plan's MACs from it."""

    blocks: tuple[BlockCost, ...]
    stage_of: tuple[int, ...]
    outside: float  # MACs outside the blocks
    base_macs: int  # the base's counted MACs
    cls_token: bool
    sdpa_scores: tuple[bool, ...]  # per block: eTPS/EViT scoring recomputes a cls row/all rows
    # The tail (module docstring): its MACs per token leaving block ``tail_after``, which leaves
    # the base with ``tail_tokens`` tokens; the tail's MACs at those are in ``outside``.
    tail_after: int = -1
    tail_tokens: int = 0
    tail_per_token: float = 0.0

    def macs(self, plan: Plan) -> float:
        """MACs of ``plan`` at batch size 1, in :func:`vitcompress.measure.count_macs`'s
        convention."""
        at = {loc.block: loc for loc in plan.locations}
        method = plan.method
        total = self.outside
        present: dict[int, int] = {}  # stage -> non-prefix tokens present now
        for index, block in enumerate(self.blocks):
            if index > self.tail_after >= 0:  # in the tail: its base MACs, the change below
                total += block.macs(block.tokens, block.tokens)
                continue
            stage = self.stage_of[index]
            n = present.get(stage, block.patch_tokens)
            p = block.prefix_tokens
            loc = at.get(index)
            if loc is None:
                total += block.macs(p + n, p + n)
                continue
            after = method.tokens_after(n, loc)
            # The reducer's own work (scoring, fusing), which the method counts.
            extra = method.location_macs(self._scoring(index, n), after)
            if extra is None:
                raise ValueError(f"{method.name} has no analytic MACs")
            if method.placement == BEFORE_BLOCK:  # the whole block sees the tokens kept
                total += extra + block.macs(p + after, p + after)
            elif block.parallel_mlp:  # the MLP beside the attention reads the block's input
                total += extra + block.macs(p + n, p + n)
            else:  # reduced after the attention: only the MLP sees fewer
                total += extra + block.macs(p + n, p + after)
            present[stage] = after
        if self.tail_per_token and self.tail_after >= 0:
            last = self.blocks[self.tail_after]
            leaving = last.prefix_tokens + present.get(
                self.stage_of[self.tail_after], last.patch_tokens
            )
            total += self.tail_per_token * (leaving - self.tail_tokens)
        return total

    def _scoring(self, index: int, patch_tokens: int) -> ScoringCost:
        """What a method's scorer needs to count its work at block ``index``."""
        block = self.blocks[index]
        return ScoringCost(
            prefix_tokens=block.prefix_tokens,
            patch_tokens=patch_tokens,
            dim=block.dim,
            heads=block.heads,
            attention_width=block.attention_width,
            key_tokens=None if block.own_keys else block.key_tokens,
            cls_token=self.cls_token,
            fused_attention=self.sdpa_scores[index],
        )

    def tokens_per_block(self, plan: Plan) -> list[int]:
        """Tokens each block is entered with under ``plan`` (inference)."""
        at = {loc.block: loc for loc in plan.locations}
        method = plan.method
        present: dict[int, int] = {}
        tokens = []
        for index, block in enumerate(self.blocks):
            stage = self.stage_of[index]
            n = present.get(stage, block.patch_tokens)
            loc = at.get(index)
            after = n if loc is None else method.tokens_after(n, loc)
            # A reducer before the block: the block is entered with the tokens it kept.
            entered = after if loc is not None and method.placement == BEFORE_BLOCK else n
            tokens.append(block.prefix_tokens + entered)
            present[stage] = after
        return tokens


def profile(model: nn.Module, model_map: ModelMap) -> CostModel:
    """Count the base's MACs once (in total, and node by node on its graph) and split each
    block's share by kind of work."""
    counter = run_counter(model, tuple(model_map.input_size), _device(model))
    graph = GraphProfile(model, model_map)
    counts = counter.get_flop_counts()
    root = type(model).__name__

    def ops(path: str) -> dict[Any, int]:
        key = f"{root}.{path}" if path else root
        return {op: flops // 2 for op, flops in counts.get(key, {}).items()}

    base_total = counter.get_total_flops() // 2
    blocks: list[BlockCost] = []
    scores: list[bool] = []
    inside = 0
    by_node = graph.branch_ops(model_map)
    for block in model_map.blocks:
        if by_node is not None:
            block_ops, attention_ops, key_ops = by_node[block.index]
        else:
            (block_ops, attention_ops), key_ops = _module_ops(block, ops), {}
        products = sum(n for op, n in attention_ops.items() if _is(op, _ATTENTION_PRODUCT_OPS))
        grid = sum(n for op, n in block_ops.items() if _is(op, _GRID_OPS))
        attention_grid = sum(n for op, n in attention_ops.items() if _is(op, _GRID_OPS))
        key_linear = sum(
            n for op, n in key_ops.items() if not _is(op, _ATTENTION_PRODUCT_OPS + _GRID_OPS)
        )
        attention_linear = sum(attention_ops.values()) - products - attention_grid - key_linear
        mlp_linear = sum(block_ops.values()) - sum(attention_ops.values()) - (grid - attention_grid)
        keys = block.attention.key_tokens or block.tokens
        stage = model_map.stages[block.stage]
        blocks.append(
            BlockCost(
                tokens=block.tokens,
                key_tokens=keys,
                own_keys=keys == block.tokens,
                attention_products=float(products),
                attention_linear=float(attention_linear),
                key_linear=float(key_linear),
                mlp_linear=float(mlp_linear),
                grid=float(grid),
                dim=block.dim,
                # q k^T's width from the graph's shapes; else from products = 2 (q k^T and
                # attn v) x queries x keys x width, which takes v as wide as q
                attention_width=graph.query_key_width(block)
                or (products / (2 * block.tokens * keys) if products else 0.0),
                heads=block.heads,
                prefix_tokens=block.prefix_tokens,
                patch_tokens=math.prod(stage.grid),
                parallel_mlp=block.parallel_mlp,
            )
        )
        scores.append(block.attention.kind in ("sdpa", "multihead_attention"))
        inside += sum(block_ops.values())
    tail_after, tail_per_token = tail_cost(model_map, graph)
    return CostModel(
        blocks=tuple(blocks),
        stage_of=tuple(b.stage for b in model_map.blocks),
        outside=float(base_total - inside),
        base_macs=int(base_total),
        cls_token=model_map.cls_token,
        sdpa_scores=tuple(scores),
        tail_after=tail_after,
        tail_tokens=model_map.blocks[tail_after].tokens if tail_after >= 0 else 0,
        tail_per_token=tail_per_token,
    )


def _module_ops(block: Any, ops: Any) -> tuple[dict[Any, int], dict[Any, int]]:
    """A block's MACs by op, and its attention's, by module path (where the graph could not be
    run node by node): the attention is its cores' modules."""
    block_ops = ops(block.path)
    attention_ops: dict[Any, int] = {}
    for path in {core.path for core in [block.attention, *block.parallel_cores]}:
        if path and path != block.path:
            add_ops(attention_ops, ops(path))
    if not attention_ops:
        attention_ops = {op: n for op, n in block_ops.items() if _is(op, _ATTENTION_PRODUCT_OPS)}
    return block_ops, attention_ops


def _device(model: nn.Module) -> Any:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else "cpu"


def relative_error(analytic: float, measured: float) -> float:
    return abs(analytic - measured) / measured if measured else math.inf
