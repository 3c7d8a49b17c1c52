"""How a method scores tokens, as an object: where it sits in a block, what the block's attention
must hand it, what its scoring costs and which models it cannot score.

A :class:`~vitcompress.variants.base.Variant` holds one scorer and one fuse
(``variants/fuses.py``); callers ask the variant, which asks these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vitcompress.method import KeyPool
from vitcompress.method.score import pooled_key_grid, pools_own_cell, window_spread_padding
from vitcompress.variants.placement import (
    AFTER_ATTENTION,
    ATTENTION_GIVES_KEYS,
    ATTENTION_GIVES_NOTHING,
    ATTENTION_GIVES_SCORE,
    BEFORE_BLOCK,
    COUNT_MERGED,
    COUNT_OF_INITIAL,
    COUNT_OF_PRESENT,
)

if TYPE_CHECKING:
    from vitcompress.variants.protocols import ModelMap, Plan


@dataclass(frozen=True)
class ScoringCost:
    """What the search's cost model knows of one location, for a scorer's analytic MACs."""

    prefix_tokens: int
    patch_tokens: int  # present before the location
    dim: int
    heads: int
    attention_width: float  # queries x keys products per token pair (heads x head width)
    key_tokens: int | None  # keys the block attends over when they are not its own tokens
    cls_token: bool  # the model has a class token (eTPS/EViT score with its row)
    fused_attention: bool  # the attention is one fused kernel: its weights are recomputed
    # The block's token grid and what pools its keys on it (kernel, stride, padding per grid
    # dim; ``None``: its keys are its own, or no pooling op was found and each pooled key
    # stands for its cell).
    grid: tuple[int, ...] = ()
    key_pool: KeyPool | None = None


@dataclass(frozen=True)
class Scorer:
    """How tokens are scored. ``label`` is for help texts and docs only: nothing compares it."""

    label: str
    placement: str  # BEFORE_BLOCK or AFTER_ATTENTION
    attention_gives: str = ATTENTION_GIVES_NOTHING  # what the located block's attention returns
    learned: bool = False  # trains a predictor: training keeps every token under a keep mask
    keep_count: str = COUNT_OF_PRESENT  # how the kept tokens are counted (see placement.py)

    def macs(self, cost: ScoringCost) -> float | None:
        """The MACs of scoring at one location, in ``count_macs``'s convention; ``None`` when
        this scorer has no analytic count (its method is then left out of the search)."""
        return None

    def refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        """One line when this scorer cannot score the model as planned, else ``None``."""
        return None


@dataclass(frozen=True)
class PredictorScorer(Scorer):
    """DynamicViT's learned predictor, before the block (dTPS, DynamicViT)."""

    label: str = "learned predictor"
    placement: str = BEFORE_BLOCK
    learned: bool = True
    keep_count: str = COUNT_OF_INITIAL

    def macs(self, cost: ScoringCost) -> float:
        """ScorePredictor on the patch tokens: LayerNorm (5 per element, as counted), C->C, the
        local half C/2->C/2 per token plus the global half once, C/2->C/4, C/4->2."""
        dim = cost.dim
        half, quarter = dim // 2, dim // 4
        per_token = 5 * dim + dim * dim + half * half + half * quarter + quarter * 2
        return cost.patch_tokens * per_token + half * half

    def refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        """In training every token stays and the pruned ones are masked out of the attention of
        the later blocks of their stage. A later block whose keys come from elsewhere (CaiT's class
        attention over the patch tokens of the stage before) lies outside that mask: it would
        attend to pruned tokens in training and not at inference, so the fine-tune would learn
        another model than the one served."""
        found = keys_from_an_earlier_stage(model_map, plan)
        if found is not None:
            where, first = found
            return (
                f"{where}, which {plan.variant}'s training path cannot mask after the reduction "
                f"at block {first}: fine-tuning would attend to pruned tokens, so "
                f"{plan.variant} is refused; use a method scored by attention"
            )
        return None


@dataclass(frozen=True)
class AttentionScorer(Scorer):
    """The block's own attention: the class token's row, or the attention each token receives
    without one (eTPS, EViT), after the attention residual add."""

    label: str = "class-token attention"
    placement: str = AFTER_ATTENTION
    attention_gives: str = ATTENTION_GIVES_SCORE

    def macs(self, cost: ScoringCost) -> float:
        """On a fused attention kernel the hook recomputes the cls row beside it; without a cls
        token it computes the attention once, output and probabilities alike
        (``attention_with_probs``), and a softmax in the graph gives the rows for free. Keys
        pooled by a window wider than its stride (CvT's 3 x 3 at stride 2) spread their scores
        to the tokens they read (:func:`key_spread_macs`)."""
        return self._row_macs(cost) + key_spread_macs(cost)

    @staticmethod
    def _row_macs(cost: ScoringCost) -> float:
        if not cost.fused_attention or not (cost.cls_token and cost.prefix_tokens > 0):
            return 0.0
        tokens = cost.prefix_tokens + cost.patch_tokens
        keys = tokens if cost.key_tokens is None else cost.key_tokens
        return keys * cost.attention_width

    def refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        """A block whose attention cores do not make one map (``Block.score_blocker``, see
        ``parallel.py``) cannot score."""
        for loc in plan.locations:
            block = model_map.blocks[loc.block]
            blocker = block.score_blocker
            if blocker is not None:
                return (
                    f"block {loc.block}: {blocker}; {plan.variant} scores tokens with that "
                    "attention, so it is refused there (a learned predictor scores without it)"
                )
            keys = block.attention.key_tokens
            # A factorised attention's (``score_slots``) keys are a frame's, not pooled ones.
            factorised = block.windows is not None and block.windows.score_slots is not None
            if keys is not None and keys < block.tokens and len(block.grid) != 2 and not factorised:
                return (
                    f"block {loc.block} ({block.path}) attends over {keys} pooled keys on a "
                    f"{len(block.grid)}-D token grid {tuple(block.grid)}: {plan.variant}'s scores "
                    "of pooled keys are spread to the tokens only on a 2-D grid, so it is "
                    "refused there (a learned predictor scores without them)"
                )
        return None


def key_spread_macs(cost: ScoringCost) -> float:
    """The MACs of spreading the scores of pooled keys to the tokens their windows read
    (``method/score.py``'s ``key_scores_to_tokens``, where the hook's ``_per_token`` calls it):
    two transposed convolutions of a ones kernel over the keys' grid, one of the scores and one
    of ones that counts the windows reading each token, each ``keys x kernel area`` at batch 1.
    0 where the keys are the block's own, where each key stands for its cell (PVT's kernel equal
    to its stride: a nearest upsampling, not counted) and where the windows do not map the keys'
    grid onto the tokens' (a nearest upsampling too). The conditions are the spread's own
    (``pools_own_cell``, ``pooled_key_grid``, ``window_spread_padding``)."""
    if cost.key_tokens is None or cost.key_pool is None or len(cost.grid) != 2:
        return 0.0
    cells = cost.key_tokens - cost.prefix_tokens  # the keys scored: the prefix tokens' are not
    if cells < 1 or cells == cost.patch_tokens:  # one key per token: the scores as they are
        return 0.0
    if pools_own_cell(cost.key_pool):
        return 0.0
    key_grid = pooled_key_grid(cells, (cost.grid[0], cost.grid[1]))
    if key_grid is None:  # not a grid like the tokens': the spread raises, no count
        return 0.0
    if window_spread_padding(cost.grid, key_grid, cost.key_pool) is None:
        return 0.0
    kernel = tuple(cost.key_pool[0])
    return 2.0 * cells * math.prod(kernel)


def keys_from_an_earlier_stage(model_map: ModelMap, plan: Plan) -> tuple[str, int] | None:
    """The first block from the plan's first location on that attends over more keys than it has
    tokens, taken from an earlier stage (CaiT's class attention over the patch tokens), said as
    the start of a refusal, with that first location's block; ``None`` where there is none. Such
    a block lies outside what a reduction keeps track of (its training mask, ToMe's sizes). A
    windowed block's keys are its window's (a padded window may hold more slots than its grid has
    tokens), and it gives every token back itself: never one."""
    if not plan.locations:
        return None
    first = plan.locations[0]
    for block in model_map.blocks[first.block :]:
        keys = block.attention.key_tokens
        if block.windows is not None:
            continue
        if block.stage != first.stage and keys is not None and keys > block.tokens:
            where = f"block {block.index} ({block.path}) attends over {keys} keys"
            return f"{where} from an earlier stage", first.block
    return None


# Attention cores whose keys the rewrite can hand a reducer.
KEYED_ATTENTION = ("sdpa", "matmul_softmax", "multihead_attention")


@dataclass(frozen=True)
class MatchingScorer(Scorer):
    """ToMe's bipartite matching on the block's head-mean keys, after the attention residual."""

    label: str = "key similarity (bipartite matching)"
    placement: str = AFTER_ATTENTION
    attention_gives: str = ATTENTION_GIVES_KEYS
    keep_count: str = COUNT_MERGED

    def macs(self, cost: ScoringCost) -> float:
        """The cosine similarity of the ``ceil(t/2)`` even tokens to the ``floor(t/2)`` odd ones,
        on the head-mean keys (one head's width)."""
        tokens = cost.prefix_tokens + cost.patch_tokens
        head_dim = cost.attention_width / cost.heads if cost.heads else cost.dim
        return ((tokens + 1) // 2) * (tokens // 2) * head_dim

    def refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        for loc in plan.locations:
            block = model_map.blocks[loc.block]
            core: Any = block.attention
            cores = 1 + len(block.parallel_cores)
            if cores > 1:
                return (
                    f"block {loc.block} ({block.path}) has {cores} attention cores; "
                    f"{plan.variant} matches tokens by one attention's keys, so it is refused there"
                )
            if core.kind not in KEYED_ATTENTION or (
                core.kind == "matmul_softmax" and not core.logits_node
            ):
                return (
                    f"block {loc.block} ({core.path}) computes attention as {core.kind}, whose "
                    f"keys {plan.variant} cannot read for its matching; {plan.variant} is "
                    "refused there"
                )
        return None
