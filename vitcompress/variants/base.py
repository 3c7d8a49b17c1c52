"""What a token-reduction method is, as one object: :class:`Variant`.

A variant says where it acts in a block, how it scores tokens, how it fuses the ones it reduces,
whether it trains a predictor (and so which losses apply), how it counts the tokens it keeps, and
it builds the reducer module the graph rewrite puts on the residual stream at each location.
Everything else (the plan, the rewrite, the losses, the visualisation, the report, the command
line) asks the variant object instead of comparing names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from vitcompress.method import SELECTION_POLICIES, keep_count
from vitcompress.method.restore import HOST, RESTORES_ANYWHERE, ZERO
from vitcompress.variants.fuses import Fuse
from vitcompress.variants.placement import (
    AFTER_ATTENTION,
    ATTENTION_GIVES_NOTHING,
    COUNT_MERGED,
    COUNT_OF_INITIAL,
    COUNT_OF_PRESENT,
    KEEP_COUNTS,
    PLACEMENTS,
)
from vitcompress.variants.protocols import Block, Location, ModelMap, Plan  # noqa: F401
from vitcompress.variants.scorers import Scorer, ScoringCost


class VariantRefusal(ValueError):
    """A plan a variant cannot take, one line; the plan raises it as its ``PlanError`` with the
    same ``parameter`` (``"keep"``, ``"locs"``, ``"variant_args"``, or ``None``: the plan as a
    whole)."""

    def __init__(self, detail: str, parameter: str | None = None) -> None:
        self.detail = detail
        self.parameter = parameter
        super().__init__(f"{parameter} {detail}" if parameter else detail)


def check_switch(key: str, value: Any) -> None:
    """A setting that is on or off (``carry_windows``, dTPS's ``window_sizes``): anything but a
    bool is refused in one line. ``--variant-arg`` reads values as Python literals, so ``true``
    arrives as the word: the line then says how to write it."""
    if isinstance(value, bool):
        return
    hint = ""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        hint = f" (write {value.strip().capitalize()}: values are Python literals)"
    raise VariantRefusal(f"{key}: must be true or false, got {value!r}{hint}", "variant_args")


# The fine-tuning loss terms (training/losses.py).
BASE_LOSSES = ("ce", "distill", "token_distill")
RATIO_LOSS = "ratio"


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One token-reduction method: a :class:`~vitcompress.variants.scorers.Scorer` (how tokens
    are scored, where) and a :class:`~vitcompress.variants.fuses.Fuse` (what becomes of the
    reduced ones), with the answers every other layer asks of a method. Subclasses build its
    reducer (:meth:`build_reducer`) and may adjust the plan's locations (:meth:`plan_locations`)
    or refuse a model (:meth:`refusal`).

    ``name`` is what users type (``--variant``) and what saved artifacts record; ``args`` are the
    settings its registered factory was called with (``--variant-arg``, ``variant_args=``),
    recorded with the plan so that a saved model rebuilds the same method.
    """

    name: str
    summary: str  # one line for help texts and docs
    scorer: Scorer
    fuse: Fuse
    resorts_tokens: bool  # reorders the tokens it keeps even when it keeps all of them
    policies: tuple[str, ...] = SELECTION_POLICIES
    report_order: int = 100  # colour/order slot in reports; lower comes first
    # The plan is set by its first location and one cumulative ratio (ToMe merges in every later
    # block): a search gives it one location, where more would only repeat the same plan.
    single_location: bool = False
    args: tuple[tuple[str, Any], ...] = ()
    # How removed tokens come back where the model reads tokens by position (its ``restore``
    # setting); ``None``: the fuse's default. See :attr:`restore_rule`.
    restore: str | None = None
    # Within a windowed block's reduced attention, each kept key weighted by the tokens it
    # stands for (dTPS's ``window_sizes`` setting): ``log(size)`` added to its logits.
    window_sizes: bool = False
    # Windowed blocks after a location, within the same windows, take its choice of tokens
    # instead of restoring them all and reducing nothing (the ``carry_windows`` setting every
    # method takes: ``registry.COMMON_SETTINGS``; docs/windowed.md, "Restoring every block").
    carry_windows: bool = False
    # The per-token residual branches after a windowed location, or after a block carrying its
    # choice (``Block.per_token_after``: DaViT's channel blocks' MLPs), take that choice (the
    # ``carry_branches`` setting, on by default; off, they run on every token).
    carry_branches: bool = True
    # The tokens present after each location, prefix tokens included, rounded to a multiple of
    # this (the ``kept_multiple`` setting every method takes; 8 suits tensor-core tiles): the plan
    # asks :meth:`location_for_count` for the count. None: the counts the keep gives.
    kept_multiple: int | None = None

    def __post_init__(self) -> None:
        if self.restore is not None and self.restore not in self.fuse.restore_rules:
            raise VariantRefusal(
                f"restore: {self.name} restores by {', '.join(self.fuse.restore_rules)}, "
                f"got {self.restore!r}",
                "variant_args",
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.keep_count not in KEEP_COUNTS:
            raise ValueError(f"keep_count must be one of {KEEP_COUNTS}, got {self.keep_count!r}")
        if self.placement == AFTER_ATTENTION and self.attention_gives == ATTENTION_GIVES_NOTHING:
            raise ValueError("a reducer after the attention must take something from it")

    def __str__(self) -> str:
        return self.name  # how messages and tables name it

    # What the scorer settles -------------------------------------------------------------------

    # Where the reducer sits in its block (BEFORE_BLOCK or AFTER_ATTENTION), whether it trains a
    # score predictor (training keeps every token under a keep mask), how it counts the tokens it
    # keeps, what the located block's attention hands it: all the scorer's to say.
    placement = property(lambda self: self.scorer.placement)
    learned = property(lambda self: self.scorer.learned)
    keep_count = property(lambda self: self.scorer.keep_count)
    attention_gives = property(lambda self: self.scorer.attention_gives)

    @property
    def settings(self) -> dict[str, Any]:
        """The settings it was made with (empty: the method's defaults)."""
        return dict(self.args)

    @property
    def losses(self) -> tuple[str, ...]:
        """The fine-tuning loss terms that apply: the ratio loss only for a learned predictor."""
        return (*BASE_LOSSES, RATIO_LOSS) if self.learned else BASE_LOSSES

    # Token counts -----------------------------------------------------------------------------

    @property
    def keeps_fraction_of_initial(self) -> bool:
        """Whether it keeps ``int(N0 * c)`` of a stage's initial patch tokens after a location
        (so the official configs' cumulative keep lists promise their counts)."""
        return self.keep_count == COUNT_OF_INITIAL

    def keep_counting(self) -> str:
        """How it counts the tokens it keeps, in words (for refusals)."""
        return {
            COUNT_OF_INITIAL: "keeps int(N0 * c) of the stage's initial patch tokens",
            COUNT_OF_PRESENT: "keeps ceil(rho * n) of the tokens present",
            COUNT_MERGED: "merges a fixed number of tokens in every block",
        }[self.keep_count]

    def keep_tokens(self, patch_tokens: int, cumulative_keep: float) -> int | None:
        """The static patch-token count kept after a location, where the variant fixes it in the
        plan; ``None`` where it is counted at run time."""
        if self.keep_count == COUNT_OF_INITIAL:
            return keep_count(patch_tokens, cumulative_keep, "floor")
        return None

    def tokens_after(self, present: int, location: Location) -> int:
        """The patch tokens present after ``location`` at inference, from the ``present`` ones
        before it: the static count the plan fixed (no more than were present), a fixed number
        merged, or ``ceil(rho * n)`` of those present, plus a token the fuse adds when any was
        pruned. The plan's checks, the search's cost model and its token counts all read this."""
        if self.keep_count == COUNT_MERGED:
            return present - (location.merge_tokens or 0)
        if self.keep_count == COUNT_OF_INITIAL and location.keep_tokens is not None:
            return min(location.keep_tokens, present)
        kept = keep_count(present, location.keep, "ceil")
        if kept >= present:
            return present
        return kept + (1 if self.fuse.adds_token else 0)

    def location_for_count(self, present: int, location: Location, count: int) -> Location | None:
        """``location`` changed so that :meth:`tokens_after` of ``present`` patch tokens is
        ``count``, or ``None`` where the method cannot land on that count there. The plan's
        rounding of kept counts to a hardware-friendly multiple (``kept_multiple``) asks this,
        each count kind changing its own number: the static count kept, the tokens merged, or the
        keep ratio of the tokens present (the exact ratio whose ``ceil`` gives the count)."""
        if not 0 < count <= present:
            return None
        if self.keep_count == COUNT_MERGED:
            changed = dataclasses.replace(location, merge_tokens=present - count)
        elif self.keep_count == COUNT_OF_INITIAL:
            changed = dataclasses.replace(location, keep_tokens=count)
        else:
            kept = count - (1 if self.fuse.adds_token and count < present else 0)
            if kept < 1:
                return None
            rho = kept / present
            # kept / present in floating point may land a hair above the fraction, where ceil
            # would keep one more: step down until the count comes out.
            for _ in range(4):
                if keep_count(present, rho, "ceil") <= kept:
                    break
                rho = math.nextafter(rho, 0.0)
            changed = dataclasses.replace(location, keep=rho)
        return changed if self.tokens_after(present, changed) == count else None

    @property
    def keeps_grid_positions(self) -> bool:
        """Whether every token after a reduction stands on a grid position (a fused extra token
        does not: a position table needs a row that leaves it unchanged)."""
        return not self.fuse.adds_token

    @property
    def fused_kernel(self) -> bool:
        """Whether ``--fused-kernels`` has an op for its reduction."""
        return self.fuse.fused_kernel

    # Cost -------------------------------------------------------------------------------------

    def location_macs(self, cost: ScoringCost, kept: int) -> float | None:
        """The MACs a location adds to the blocks' own (scoring and fusing), ``kept`` of the
        ``cost.patch_tokens`` present staying; ``None`` when it has no analytic count."""
        scoring = self.scorer.macs(cost)
        if scoring is None:
            return None
        removed = max(cost.patch_tokens - kept, 0)
        return scoring + self.fuse.macs(removed, kept, cost.dim)

    @property
    def searchable(self) -> bool:
        """A method that can give its MACs can be searched."""
        probe = ScoringCost(
            prefix_tokens=1,
            patch_tokens=4,
            dim=8,
            heads=1,
            attention_width=8.0,
            key_tokens=None,
            cls_token=True,
            fused_attention=True,
        )
        return self.location_macs(probe, 2) is not None

    # Words ------------------------------------------------------------------------------------

    @property
    def keep_setting(self) -> str | None:
        """The setting given in place of keep ratios (ToMe's ``r``), when one was given."""
        return None

    def amount_text(self, locations: Sequence[Mapping[str, Any]], keep: Any) -> str | None:
        """How a report words the amount of a plan (its JSON locations and keep): the keep
        ratio, ``0.7`` or ``0.7,0.6``, unless the method counts otherwise."""
        if keep is None:
            return None
        values = keep if isinstance(keep, list | tuple) else [keep]
        texts = [f"{float(v):g}" for v in values]
        return texts[0] if len(set(texts)) == 1 else ",".join(texts)

    # Plans ------------------------------------------------------------------------------------

    def plan_locations(self, model_map: ModelMap, locations: list[Location]) -> list[Location]:
        """The plan's locations from the ones the keep ratios and block indices gave (raises
        :class:`VariantRefusal`). Most variants act exactly there; a variant that acts in every
        block (ToMe) expands them."""
        return locations

    def refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        """One line when this variant cannot carry out ``plan`` exactly on the model, else None:
        its scorer's refusal, then its own."""
        return (
            self.scorer.refusal(model_map, plan)
            or self._restore_refusal(plan)
            or self._window_sizes_refusal(model_map, plan)
        )

    def _window_sizes_refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        """``window_sizes`` weighs keys within windowed blocks' reduced attention only: a plan
        without one (no windowed location, or only ones whose attention runs whole, as padded
        windows' does, with no carried block after them that reduces its own) would record a
        setting that changes nothing."""
        if not self.window_sizes:
            return None
        blocks = model_map.blocks
        reduced = [
            index
            for loc in plan.locations
            if loc.windows
            for index in (loc.block, *loc.carried)
            if blocks[index].windows is not None and blocks[index].windows.attention_reducible
        ]
        if reduced:
            return None
        return (
            "window_sizes=True weighs the keys of windowed blocks' reduced attention; no block "
            "of this plan runs its window attention on fewer tokens"
        )

    def _restore_refusal(self, plan: Plan) -> str | None:
        """A windowed block gives its tokens back inside the network, onto the residual stream
        the next block reads: restored as zeros, every pruned token would lose all it carried,
        block after block (the zero rule is for a model's output tokens)."""
        windowed = [loc.block for loc in plan.locations if loc.windows]
        if not windowed or self.restore_rule != ZERO:
            return None
        return (
            f"restore={ZERO} would zero every pruned token of the residual stream inside the "
            f"model at windowed block {windowed[0]} (a windowed block restores its tokens before "
            "the next block reads them); choose "
            + ", ".join(r for r in self.fuse.restore_rules if r != ZERO)
        )

    def reduction_refusal(self, plan: Plan) -> str | None:
        """One line when a plan asks for a reduction (a keep below 1) that removes no token at any
        location, else ``None``. With few tokens, a fused extra token can make up for the one
        token pruned (4 tokens at keep 0.7: ceil(2.8) = 3 kept + 1 fused), and a count can round
        to all of them: the model would run with the reducers' cost and no saving."""
        if all(loc.keep >= 1.0 for loc in plan.locations):
            return None
        present: dict[int, int] = {}  # patch tokens present in each stage (a fused one counts)
        steps = []
        for loc in plan.locations:
            # A windowed location reduces its block's windows afresh: they were restored.
            before = loc.patch_tokens if loc.windows else present.get(loc.stage, loc.patch_tokens)
            after = self.tokens_after(before, loc)
            if after < before:
                return None
            if not loc.windows:
                present[loc.stage] = after
            steps.append(f"{before} -> {after} at block {loc.block}")
        return (
            f"keep {', '.join(f'{loc.keep:g}' for loc in plan.locations)} removes no token: "
            f"{self.name}'s patch tokens go {'; '.join(steps)}"
            + (" (its fused token replaces the pruned ones)" if self.fuse.adds_token else "")
            + "; choose a lower keep or blocks with more tokens"
        )

    def build_reducer(self, block: Block, location: Location, plan: Plan) -> nn.Module:
        """The module the rewrite puts on the residual stream at ``location`` (in ``block``).

        Its forward takes the stream, then (after the attention) what the attention gives, then
        ``keep_mask`` and ``positions`` (and ``sizes`` when :attr:`tracks_sizes`), and returns
        ``(tokens, keep_mask, positions)`` (plus ``sizes`` when :attr:`tracks_sizes`).
        """
        raise NotImplementedError(f"variant {self.name!r} builds no reducer")

    @property
    def restore_rule(self) -> str:
        """How a token it removed comes back where the model reads tokens by position:
        ``method/restore.py``'s rules (``host``, ``value``, ``delta``, ``zero``)."""
        return self.restore or self.fuse.restore_default

    @property
    def local_restore_rule(self) -> str:
        """The rule inside a block, where restoring on the residual stream would run a layer
        between it and a grid op again on every token (PVTv2's ``fc1`` before its depthwise
        conv): :attr:`restore_rule` where it reads only the tokens there, else ``host`` where the
        fuse gives tokens a host, else ``zero``."""
        rule = self.restore_rule
        if rule in RESTORES_ANYWHERE:
            return rule
        return HOST if HOST in self.fuse.restore_rules else ZERO

    @property
    def tracks_sizes(self) -> bool:
        """Whether its tokens carry sizes (how many patches each stands for) to later blocks,
        whose attention then adds ``log(size)`` to the key logits (proportional attention)."""
        return False
