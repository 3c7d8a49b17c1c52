"""What a search scores from: the variants it can cost, the budget-matched candidates of the
analytic space (or, on a windowed model, one counted candidate per method) and the paper's default
placement matched to the budget."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vitcompress.compilation.placement import default_keep, default_locs
from vitcompress.search.config import SearchConfig, SearchError, budget_text
from vitcompress.search.cost import CostModel
from vitcompress.search.score import (
    CandidateBuilder,
)
from vitcompress.search.space import DEFAULT_KEEP_GRID, Candidate, Space, build_space, valid
from vitcompress.search.strategy import match_budget
from vitcompress.search.windowed import STRATEGY, windowed_candidates
from vitcompress.status import step, warn
from vitcompress.variants import get_variant, variant_names

# A variant whose MACs have no analytic count (``Variant.searchable``) is left out with a warning.
LEFT_OUT_WHY = "its MACs have no analytic count here"


@dataclass
class Candidates:
    """What a search scores from: its variants (and those left out, with why), the
    budget-matched candidates, how their MACs are had, the blocks a warm-up reads, and for the
    JSON the space described. ``space``: the analytic space; ``None`` for a windowed model."""

    variants: list[str]
    left_out: dict[str, str]
    matched: list[Candidate]
    cost: Callable[[Candidate], float | None]
    warm_blocks: list[int]
    info: dict[str, Any]
    size: int
    space: Space | None = None


def analytic_space(
    model_map, cost_model: CostModel, config: SearchConfig, budget: float, base_macs: int
) -> Candidates:
    """The space of placements and keep ratios, costed by the analytic model."""
    variants, left_out = _searchable(config.variants, config.variants_named)
    space = build_space(
        model_map,
        variants,
        DEFAULT_KEEP_GRID if config.keep_grid is None else config.keep_grid,
        single_location=[v for v in variants if get_variant(v).single_location],
    )
    cost = _cost_function(cost_model, model_map, config.method_settings)
    with step("enumerating the candidate space"):
        matched, smallest, size = _enumerate(space, variants, cost, budget)
    if not matched:
        if smallest is None:
            raise SearchError("no candidate of the space can be applied to this model")
        raise SearchError(
            f"no candidate reaches {budget_text(config.budget, budget, base_macs)}; the "
            f"smallest is {smallest / 1e9:.3g} GMACs ({smallest / base_macs:.2f} of the base)"
        )
    return Candidates(
        variants=variants,
        left_out={name: LEFT_OUT_WHY for name in left_out},
        matched=matched,
        cost=cost,
        warm_blocks=sorted({b for g in space.groups for b in g}),
        info={
            "locations": space.describe(),
            "keep_grid": list(space.keep_grid),
            **_kept_multiple_info(config),
        },
        size=size,
        space=space,
    )


def windowed_space(
    builder: CandidateBuilder, config: SearchConfig, budget: float, base_macs: int
) -> Candidates:
    """One candidate per method, its keep fitted to the budget with the MACs counted
    (``search/windowed.py``)."""
    with step("fitting each method's keep to the budget, counted"):
        fitted = windowed_candidates(
            builder,
            known_variants(config.variants),
            budget,
            base_macs,
            keep_grid=config.keep_grid,
            max_candidates=config.max_candidates,
        )
    if config.variants_named:
        for name, why in fitted.left_out.items():
            warn(f"{name}: {why}; left out of the search")
    if not fitted.candidates:
        reasons = {**fitted.left_out, **fitted.out_of_reach}
        raise SearchError(
            "no method fits the budget on this windowed model: "
            + "; ".join(f"{name}: {why}" for name, why in reasons.items())
        )
    return Candidates(
        variants=[c.variant for c in fitted.candidates],
        left_out=fitted.left_out,
        matched=fitted.candidates,
        cost=lambda candidate: fitted.macs.get(candidate),
        warm_blocks=list(fitted.locs),
        info={
            "locations": f"every windowed block (the default): {list(fitted.locs)}",
            "keep_grid": "steps of 0.01, fitted to the budget"
            if config.keep_grid is None
            else f"the largest of {sorted(set(config.keep_grid))} within the budget",
            "out_of_reach": fitted.out_of_reach,
            **_kept_multiple_info(config),
        },
        size=len(fitted.candidates),
    )


class FixedProposals:
    """The candidates of a windowed model's search, each scored once, in order (the interface
    of :class:`vitcompress.search.strategy.Proposals` that the scoring loop reads)."""

    name = STRATEGY
    exhaustive = True

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = list(candidates)
        self.scores: dict[Candidate, float | None] = {}

    def scored(self, candidate: Candidate, score: float | None) -> None:
        self.scores[candidate] = score

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self.candidates)


def known_variants(variants: Sequence[str]) -> list[str]:
    """``variants``, each a registered one; an unknown name is one line."""
    for name in variants:
        if name not in variant_names():
            raise SearchError(
                f"--variants: {name!r} is unknown; choose from {', '.join(variant_names())}"
            )
    return list(variants)


def _searchable(variants: Sequence[str], named: bool) -> tuple[list[str], list[str]]:
    """The variants the search can cost, and those it leaves out (said in the results; a
    warning too where the user named them)."""
    out, left_out = [], []
    for name in known_variants(variants):
        if get_variant(name).searchable:
            out.append(name)
        else:
            left_out.append(name)
            if named:
                warn(f"{name}: {LEFT_OUT_WHY}; left out of the search")
    if not out:
        raise SearchError(
            f"none of --variants {','.join(variants)} can be searched: {LEFT_OUT_WHY}"
        )
    return out, left_out


def _kept_multiple_info(config: SearchConfig) -> dict[str, Any]:
    """The space's JSON says the rounding where one was asked."""
    return {} if config.kept_multiple is None else {"kept_multiple": config.kept_multiple}


def _cost_function(
    cost_model: CostModel, model_map, settings: dict[str, Any] | None
) -> Callable[[Candidate], float | None]:
    """Analytic MACs of a candidate's plan (its counts rounded where ``settings`` say so)."""
    memo: dict[Candidate, float | None] = {}

    def cost(candidate: Candidate) -> float | None:
        if candidate not in memo:
            plan = valid(candidate, model_map, settings)
            memo[candidate] = None if plan is None else cost_model.macs(plan)
        return memo[candidate]

    return cost


def _enumerate(
    space: Space, variants: Sequence[str], cost, budget: float
) -> tuple[list[Candidate], float | None, int]:
    """Budget-matched candidates, the smallest MACs anywhere in the space, the space's size."""
    matched: list[Candidate] = []
    smallest: float | None = None
    size = 0
    for variant in variants:
        for locs in space.location_sets(variant):
            size += len(space.keep_grid)
            low = cost(Candidate(variant, locs, (min(space.keep_grid),) * len(locs)))
            if low is None:
                continue
            smallest = low if smallest is None else min(smallest, low)
            if low <= budget:
                candidate = match_budget(variant, locs, space, cost, budget)
                if candidate is not None:
                    matched.append(candidate)
    return matched, smallest, size


def paper_default(
    model_map, space: Space, variants: Sequence[str], cost, budget: float
) -> dict[str, Candidate | None]:
    """Per variant: the paper's placement at its keep ratio where that fits the budget, else
    the same placement matched to the budget (the default at matched MACs)."""
    paper_locs = tuple(default_locs(model_map))
    paper_keep = default_keep(model_map)
    out: dict[str, Candidate | None] = {}
    for variant in variants:
        locs, keep = paper_locs, paper_keep
        if len(locs) > space.most_locations(variant):
            # The same plan from its first location at the cumulative keep (ToMe fits its r to
            # the cumulative keep of the last location; the locations between change nothing).
            locs, keep = locs[:1], round(keep ** len(locs), 4)
        candidate = Candidate(variant, locs, (keep,) * len(locs))
        macs = cost(candidate)
        if macs is None:
            out[variant] = None
        elif macs <= budget:
            out[variant] = match_budget(variant, locs, space, cost, budget) or candidate
        else:
            out[variant] = match_budget(variant, locs, space, cost, budget)
    return out
