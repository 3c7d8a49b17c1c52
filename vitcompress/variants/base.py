"""What a token-reduction method is, as one object: :class:`Variant`.

A variant says where it acts in a block, how it scores tokens, how it fuses the ones it reduces,
whether it trains a predictor (and so which losses apply), how it counts the tokens it keeps, and
it builds the reducer module the graph rewrite puts on the residual stream at each location.
Everything else (the plan, the rewrite, the losses, the visualisation, the report, the command
line) asks the variant object instead of comparing names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from vitcompress.method import SELECTION_POLICIES

# Where a variant's reducer sits in a block.
BEFORE_BLOCK = "before_block"  # on the stream entering the block: the whole block sees fewer tokens
AFTER_ATTENTION = "after_attention"  # after the attention residual add: only the MLP sees fewer
PLACEMENTS = (BEFORE_BLOCK, AFTER_ATTENTION)

# How a variant counts the tokens it keeps at a location.
COUNT_OF_INITIAL = "initial"  # int(N0 * cumulative keep), fixed in the plan (DynamicViT, dTPS)
COUNT_OF_PRESENT = "present"  # ceil(rho * n) of the n tokens present, at run time (EViT, eTPS)
COUNT_MERGED = "merged"  # a fixed number r merged per block, counts fixed in the plan (ToMe)
KEEP_COUNTS = (COUNT_OF_INITIAL, COUNT_OF_PRESENT, COUNT_MERGED)

# What the hooked attention of a located block hands the reducer ("score" slot).
ATTENTION_GIVES_NOTHING = "nothing"
ATTENTION_GIVES_SCORE = "score"  # a per-token score (cls row, or attention received)
ATTENTION_GIVES_KEYS = "keys"  # the keys averaged over heads, (B, N, D) (ToMe's metric)


# What a variant reads of the graph layer's objects (``vitcompress.graph``, which imports this
# package: the variants stay below it and name the fields they use, not the classes).
class Block(Protocol):
    index: int
    path: str
    dim: int
    tokens: int  # prefix included
    prefix_tokens: int
    stage: int
    attention: Any  # AttentionCore: kind, key_tokens, path
    parallel_cores: Sequence[Any]  # further attention cores of a parallel block (AttentionCore)


class Location(Protocol):
    block: int
    stage: int
    keep: float
    cumulative_keep: float
    patch_tokens: int
    keep_tokens: int | None
    merge_tokens: int | None


class Plan(Protocol):
    variant: str
    policy: str
    locations: Sequence[Location]


class ModelMap(Protocol):
    blocks: Sequence[Block]
    stages: Sequence[Any]  # Stage: index, blocks, grid


class VariantRefusal(ValueError):
    """A plan a variant cannot take, one line; the plan raises it as its ``PlanError`` with the
    same ``parameter`` (``"keep"``, ``"locs"``, ``"tome_r"``, or ``None``: the plan as a whole)."""

    def __init__(self, detail: str, parameter: str | None = None) -> None:
        self.detail = detail
        self.parameter = parameter
        super().__init__(f"{parameter} {detail}" if parameter else detail)


# The fine-tuning loss terms (training/losses.py).
BASE_LOSSES = ("ce", "distill", "token_distill")
RATIO_LOSS = "ratio"


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One token-reduction method. Subclasses build its reducer (:meth:`build_reducer`) and may
    adjust the plan's locations (:meth:`plan_locations`) or refuse a model (:meth:`refusal`).

    ``name`` is what users type (``--variant``) and what saved artifacts record.
    """

    name: str
    summary: str  # one line for help texts and docs
    placement: str  # BEFORE_BLOCK or AFTER_ATTENTION
    scorer: str  # "predictor" (learned), "attention" (cls row / received), "matching" (similarity)
    fuse: str  # what becomes of reduced tokens: "squeeze", "drop", "evit" (one token), "merge"
    learned: bool  # trains a score predictor: training keeps every token under a keep mask
    keep_count: str  # one of KEEP_COUNTS
    resorts_tokens: bool  # reorders the tokens it keeps even when it keeps all of them
    attention_gives: str = ATTENTION_GIVES_NOTHING  # what the located block's attention returns
    policies: tuple[str, ...] = SELECTION_POLICIES
    report_order: int = 100  # colour/order slot in reports; lower comes first
    # The plan is set by its first location and one cumulative ratio (ToMe merges in every later
    # block): a search gives it one location, where more would only repeat the same plan.
    single_location: bool = False

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.keep_count not in KEEP_COUNTS:
            raise ValueError(f"keep_count must be one of {KEEP_COUNTS}, got {self.keep_count!r}")
        if self.placement == AFTER_ATTENTION and self.attention_gives == ATTENTION_GIVES_NOTHING:
            raise ValueError("a reducer after the attention must take something from it")

    @property
    def losses(self) -> tuple[str, ...]:
        """The fine-tuning loss terms that apply: the ratio loss only for a learned predictor."""
        return (*BASE_LOSSES, RATIO_LOSS) if self.learned else BASE_LOSSES

    def keep_tokens(self, patch_tokens: int, cumulative_keep: float) -> int | None:
        """The static patch-token count kept after a location, where the variant fixes it in the
        plan; ``None`` where it is counted at run time."""
        from vitcompress.method import keep_count

        if self.keep_count == COUNT_OF_INITIAL:
            return keep_count(patch_tokens, cumulative_keep, "floor")
        return None

    def tokens_after(self, present: int, location: Location) -> int:
        """The patch tokens present after ``location`` at inference, from the ``present`` ones
        before it: the static count the plan fixed (no more than were present), a fixed number
        merged, or ``ceil(rho * n)`` of those present, plus EViT's one fused token when any was
        pruned. The plan's checks, the search's cost model and its token counts all read this."""
        from vitcompress.method import keep_count

        if self.keep_count == COUNT_MERGED:
            return present - (location.merge_tokens or 0)
        if self.keep_count == COUNT_OF_INITIAL and location.keep_tokens is not None:
            return min(location.keep_tokens, present)
        kept = keep_count(present, location.keep, "ceil")
        if kept >= present:
            return present
        return kept + (1 if self.fuse == "evit" else 0)

    def plan_locations(
        self, model_map: ModelMap, locations: list[Location], merge_r: int | None
    ) -> list[Location]:
        """The plan's locations from the ones the keep ratios and block indices gave (raises
        :class:`VariantRefusal`). Most variants act exactly there; a variant that acts in every block (ToMe) expands them.
        ``merge_r`` is ToMe's native setting (tokens merged per block); others refuse it.
        """
        if merge_r is not None:
            raise VariantRefusal(f"is ToMe's setting; {self.name} takes keep ratios", "tome_r")
        return locations

    def refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        """One line when this variant cannot carry out ``plan`` exactly on the model, else None."""
        return None

    def build_reducer(self, block: Block, location: Location, plan: Plan) -> nn.Module:
        """The module the rewrite puts on the residual stream at ``location`` (in ``block``).

        Its forward takes the stream, then (after the attention) what the attention gives, then
        ``keep_mask`` and ``positions`` (and ``sizes`` when :attr:`tracks_sizes`), and returns
        ``(tokens, keep_mask, positions)`` (plus ``sizes`` when :attr:`tracks_sizes`).
        """
        raise NotImplementedError(f"variant {self.name!r} builds no reducer")

    @property
    def tracks_sizes(self) -> bool:
        """Whether its tokens carry sizes (how many patches each stands for) to later blocks,
        whose attention then adds ``log(size)`` to the key logits (proportional attention)."""
        return False
