"""Analytic MACs of a plan, from the token counts each block sees: no forward per candidate.

One measured profile of the base (MACs per block, split by kind of work) is scaled by the token
counts a plan leaves each block with. Per block:

* attention products (``q @ k^T`` and ``attn @ v``: SDPA kernels, ``bmm``), what acts on the
  (queries x keys) map between them (CaiT's talking heads) and what runs on a table of (query,
  key) pairs that a reduction gathers by the kept tokens (ConViT's positional scores), grow
  with queries x keys: quadratically in the block's tokens when it attends over its own tokens,
  linearly when its keys are pooled from the full grid (spatial-reduction attention keeps its
  key count);
* convolutions and pools run on the grid, which a reduced stage gets back padded at inference,
  and so does what runs between a reshape to the grid and its flatten at the same resolution
  (CvT's BatchNorm after its query's conv): constant;
* the keys' and values' own projections scale with the keys (constant when they are pooled);
* everything else (linear layers, norms) is per token, split at the residual add closing the
  attention: the attention branch sees the tokens the block was entered with, the MLP branch
  those left after an in-block reduction (eTPS/EViT; a parallel block's MLP reads the block's
  input, so it sees those the block was entered with too).

Which node's work is which is read off the captured graph, node by node (``graph_profile.py``):
the block is what runs between its input and its output, work that does not depend on the image
(a position table built from coordinates) belongs to no block. Where the graph cannot be run so,
the split falls back to module paths.

Where a reduced stage's tokens are read by position, the rewrite gives them back in full, and
what it runs then follows the method's restore rule (``method/restore.py``), as the profile
reads off the graph: a rule that restores the residual stream (``value``, ``delta``) runs the
per-token ops between the stream and the reader again on the full tokens (the norm before PVT's
spatial-reduction conv and CvT's conv projections, a stage's norm before its exit grid), its
originals running on as long as something else reads them; a rule that restores the tokens
where they are read (``host``, ``zero``, and a method's local rule where a layer runs between)
leaves those ops on the tokens left (``graph_profile.Restore``, ``ExitRestore``).

The reducers a plan inserts add their own work, which each method counts from dimensions
(``Variant.location_macs``: its scorer's and its fuse's): the predictor's MLP over the patch
tokens present (dTPS/DynamicViT), the donor-host similarity of squeezing (``donors x hosts x C``:
dTPS/eTPS), the cls-row attention score (eTPS/EViT on SDPA), the spread of pooled keys' scores
to the tokens their overlapping windows read (eTPS/EViT in CvT's first two stages: ``2 x keys x
kernel area``) and ToMe's bipartite similarity (``ceil(t/2) x floor(t/2) x head dim`` in every
merging block; its size-weighted averages and ``log s`` bias are not multiply-accumulates). A
method that cannot count its work is not searched.
Everything before the blocks (patch embedding, a pyramid's next patch embedding on the full grid)
is constant. What runs after the last block that can reduce (its keys its own or pooled from its
grid; the "tail": class attention (CaiT), an attention-pooling head (SigLIP, PE), the final norm
and the head) is constant plus a cost per token leaving that block, measured once: the base's
graph is run from that block's output with a quarter of the tokens dropped, and the MACs saved
divided by the tokens dropped. A tail that cannot run on fewer tokens, or that the compressed
model gives the full tokens back to (a block's ``readers``, its stage's exit grid), costs the
same at any keep but for the restore above. The search's cross-check (``driver.py``) compares
the result with the counted MACs of compressed models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.plan import Location, Plan
from vitcompress.measure.macs import run_counter
from vitcompress.method import KeyPool
from vitcompress.method.restore import RESTORES_ANYWHERE
from vitcompress.search.graph_profile import (
    ATTENTION,
    GRID,
    GRID_OPS,
    KEYS,
    KINDS,
    MLP,
    PRODUCT_OPS,
    PRODUCTS,
    BlockSplit,
    ExitRestore,
    GraphProfile,
    Restore,
    add_ops,
    is_op,
    tail_cost,
)
from vitcompress.variants import BEFORE_BLOCK, ScoringCost


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
    token_grid: tuple[int, ...] = ()  # the stage's grid, on which its keys are pooled
    key_pool: KeyPool | None = None  # what pools its keys there (``AttentionCore.key_pool``)

    # Its grid ops' restores once its stage is reduced (``graph_profile.Restore``).
    restores: tuple[Restore, ...] = ()

    def macs(
        self,
        attention_tokens: int,
        mlp_tokens: int,
        reduced: tuple[str, ...] = (),
        rules: tuple[str, str] | None = None,
    ) -> float:
        """Its MACs with its attention entered with ``attention_tokens`` and its MLP seeing
        ``mlp_tokens``; ``reduced``: the branches ("attention", "mlp") whose residual stream
        follows a reduction in the stage, whose grid ops the rewrite restores by ``rules`` (the
        method's rule and its local rule, where a layer runs between the stream and the grid)."""
        total = self._scaled(
            {
                PRODUCTS: self.attention_products,
                ATTENTION: self.attention_linear,
                KEYS: self.key_linear,
                MLP: self.mlp_linear,
                GRID: self.grid,
            },
            attention_tokens,
            mlp_tokens,
        )
        for restore in self.restores:
            if restore.branch not in reduced or restore.in_place or rules is None:
                continue
            rule = rules[1] if restore.multiplies else rules[0]
            if rule in RESTORES_ANYWHERE:  # the grid op's tokens restored where they are read
                continue
            # The stream restored: the ops up to the grid op run again on the full tokens, and
            # the originals nothing reads any more are gone.
            total += restore.copied - self._scaled(restore.erased, attention_tokens, mlp_tokens)
        return total

    def _scaled(self, kinds: dict[str, float], attention_tokens: int, mlp_tokens: int) -> float:
        keys = attention_tokens if self.own_keys else self.key_tokens
        queries_keys = (attention_tokens * keys) / (self.tokens * self.key_tokens)
        return (
            kinds.get(PRODUCTS, 0.0) * queries_keys
            + kinds.get(ATTENTION, 0.0) * attention_tokens / self.tokens
            + kinds.get(KEYS, 0.0) * keys / self.key_tokens
            + kinds.get(MLP, 0.0) * mlp_tokens / self.tokens
            + kinds.get(GRID, 0.0)
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
    # Tokens leaving a block for what reads them by position (a stage's exit grid, the output),
    # after that block: what runs before the reader, at the base's tokens in ``outside``, runs
    # on other tokens once the stage is reduced (``graph_profile.ExitRestore``).
    exits: tuple[tuple[int, ExitRestore], ...] = ()

    def macs(self, plan: Plan) -> float:
        """MACs of ``plan`` at batch size 1, in :func:`vitcompress.measure.count_macs`'s
        convention."""
        at = {loc.block: loc for loc in plan.locations}
        rules = (plan.method.restore_rule, plan.method.local_restore_rule)
        total = self.outside
        present: dict[int, int] = {}  # stage -> non-prefix tokens present now
        for index in range(len(self.blocks)):
            total += self._block_macs(index, at.get(index), plan, rules, present)
            stage = self.stage_of[index]
            for after, exit_ in self.exits:
                if after == index and stage in present:
                    total += _exit_change(exit_, present[stage], rules[0])
        if self.tail_per_token and self.tail_after >= 0:
            last = self.blocks[self.tail_after]
            leaving = last.prefix_tokens + present.get(
                self.stage_of[self.tail_after], last.patch_tokens
            )
            total += self.tail_per_token * (leaving - self.tail_tokens)
        return total

    def _block_macs(
        self,
        index: int,
        loc: Location | None,
        plan: Plan,
        rules: tuple[str, str],
        present: dict[int, int],
    ) -> float:
        """Block ``index``'s MACs under ``plan`` (a reducer at ``loc`` included); updates the
        tokens ``present`` in its stage."""
        block = self.blocks[index]
        if index > self.tail_after >= 0:  # in the tail: its base MACs, the change in macs()
            return block.macs(block.tokens, block.tokens)
        method = plan.method
        stage = self.stage_of[index]
        n = present.get(stage, block.patch_tokens)
        p = block.prefix_tokens
        # The branches whose stream follows a reduction in the stage (the rewrite's
        # ``reduced``): a reducer before this block or in an earlier one.
        earlier = stage in present
        if loc is None:
            return block.macs(p + n, p + n, ("attention", "mlp") if earlier else (), rules)
        after = method.tokens_after(n, loc)
        # The reducer's own work (scoring, fusing), which the method counts.
        extra = method.location_macs(self._scoring(index, n), after)
        if extra is None:
            raise ValueError(f"{method.name} has no analytic MACs")
        present[stage] = after
        if method.placement == BEFORE_BLOCK:  # the whole block sees the tokens kept
            return extra + block.macs(p + after, p + after, ("attention", "mlp"), rules)
        # Reduced after the attention: only the MLP sees fewer, unless it reads the block's
        # input beside the attention.
        mlp = p + n if block.parallel_mlp else p + after
        return extra + block.macs(p + n, mlp, ("attention", "mlp") if earlier else ("mlp",), rules)

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
            grid=block.token_grid,
            key_pool=None if block.own_keys else block.key_pool,
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
            split = by_node[block.index]
        else:
            split = _module_split(block, ops)
        kinds = split.macs
        keys = block.attention.key_tokens or block.tokens
        stage = model_map.stages[block.stage]
        blocks.append(
            BlockCost(
                tokens=block.tokens,
                key_tokens=keys,
                own_keys=keys == block.tokens,
                attention_products=kinds[PRODUCTS],
                attention_linear=kinds[ATTENTION],
                key_linear=kinds[KEYS],
                mlp_linear=kinds[MLP],
                grid=kinds[GRID],
                dim=block.dim,
                # q k^T's width from the graph's shapes; else from products = 2 (q k^T and
                # attn v) x queries x keys x width, which takes v as wide as q
                attention_width=graph.query_key_width(block)
                or (kinds[PRODUCTS] / (2 * block.tokens * keys) if kinds[PRODUCTS] else 0.0),
                heads=block.heads,
                prefix_tokens=block.prefix_tokens,
                patch_tokens=math.prod(stage.grid),
                parallel_mlp=block.parallel_mlp,
                token_grid=tuple(block.grid),
                key_pool=block.attention.key_pool,
                restores=split.restores,
            )
        )
        scores.append(block.attention.kind in ("sdpa", "multihead_attention"))
        inside += sum(kinds.values())
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
        exits=tuple(graph.exits(model_map)),
    )


def _exit_change(exit_: ExitRestore, patch_tokens: int, rule: str) -> float:
    """The change from the base's MACs of what runs between a reduced stage's block and a
    reader of its tokens, ``patch_tokens`` left (``graph_profile.ExitRestore``)."""
    base_patches = exit_.tokens - exit_.prefix_tokens
    left = ((exit_.prefix_tokens + patch_tokens) / exit_.tokens, patch_tokens / base_patches)
    if exit_.in_place or rule in RESTORES_ANYWHERE:  # restored after it: on the tokens left
        return sum(macs * (share - 1) for macs, share in zip(exit_.between, left, strict=True))
    # The stream restored: the copy on the full tokens is the base's; the originals something
    # else still reads run on the tokens left.
    return sum(macs * share for macs, share in zip(exit_.kept, left, strict=True))


def _module_split(block: Any, ops: Any) -> BlockSplit:
    """A block's MACs by kind, by module path (where the graph could not be run node by node):
    the attention is its cores' modules, its products the product ops there; no key side."""
    block_ops = ops(block.path)
    attention_ops: dict[Any, int] = {}
    for path in {core.path for core in [block.attention, *block.parallel_cores]}:
        if path and path != block.path:
            add_ops(attention_ops, ops(path))
    if not attention_ops:
        attention_ops = {op: n for op, n in block_ops.items() if is_op(op, PRODUCT_OPS)}
    kinds: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    for op, n in block_ops.items():
        in_attention = attention_ops.get(op, 0)
        if is_op(op, GRID_OPS):
            kinds[GRID] += n
        elif is_op(op, PRODUCT_OPS):
            kinds[PRODUCTS] += in_attention
            kinds[MLP] += n - in_attention
        else:
            kinds[ATTENTION] += in_attention
            kinds[MLP] += n - in_attention
    return BlockSplit(kinds)


def _device(model: nn.Module) -> Any:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else "cpu"


def relative_error(analytic: float, measured: float) -> float:
    return abs(analytic - measured) / measured if measured else math.inf
