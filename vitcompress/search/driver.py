"""``search``: the best placement and keep ratios under a MAC or speed budget, before fine-tuning.

Built from ``vitcompress.search``: the candidate space, the analytic cost, the budget-matched
strategy, scoring on calibration images (with the predictor warm-up for learned variants), the
cache that makes a killed search resume, and the outputs (JSON, the Pareto plot, the recipe).
See docs/search.md.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import PlanError, default_keep, default_locs
from vitcompress.errors import UserError
from vitcompress.loading import LoadedModel
from vitcompress.measure import count_macs
from vitcompress.measure.models import TimingOptions, measure_models, speedup
from vitcompress.search.cache import CacheMismatch, ScoreCache
from vitcompress.search.cost import CostModel, profile, relative_error
from vitcompress.search.outputs import (
    JSON_NAME,
    PLOT_NAME,
    RECIPE_NAME,
    write_plot,
    write_recipe,
)
from vitcompress.search.pareto import pareto_front
from vitcompress.search.score import (
    Calibration,
    CandidateBuilder,
    calibration_images,
    logits_of,
    score_model,
)
from vitcompress.search.space import DEFAULT_KEEP_GRID, Candidate, Space, build_space, valid
from vitcompress.search.strategy import Proposals, evenly_spaced, match_budget
from vitcompress.search.warmup import (
    WARMUP_BATCH,
    WARMUP_STEPS,
    BlockSignals,
    block_signals,
    load_predictor_state,
    predictor_state,
    warm_predictors,
)
from vitcompress.search.windowed import STRATEGY, windowed_candidates
from vitcompress.status import detail, step, warn
from vitcompress.variants import get_variant, variant_names

# A variant whose MACs have no analytic count (``Variant.searchable``) is left out with a warning.
LEFT_OUT_WHY = "its MACs have no analytic count here"
CROSS_CHECK_SAMPLE = 4  # candidates whose analytic MACs are compared with counted MACs
MAX_SPEEDUP_TIMINGS = 5  # candidates timed, best first, for --min-speedup


class SearchError(ValueError, UserError):
    """A search that cannot run as asked; the message is one line for the user."""


@dataclass
class Budget:
    max_gmacs: float | None = None
    max_gmacs_ratio: float | None = None
    min_speedup: float | None = None

    def check(self) -> None:
        if self.max_gmacs is None and self.max_gmacs_ratio is None and self.min_speedup is None:
            raise SearchError(
                "a budget is required: give --max-gmacs G, --max-gmacs-ratio R or --min-speedup S"
            )
        for name, value in (
            ("--max-gmacs", self.max_gmacs),
            ("--max-gmacs-ratio", self.max_gmacs_ratio),
        ):
            if value is not None and not value > 0:
                raise SearchError(f"{name} must be positive, got {value}")
        if self.min_speedup is not None and not self.min_speedup > 1:
            raise SearchError(f"--min-speedup must be above 1, got {self.min_speedup}")

    def macs(self, base_macs: int) -> float:
        """The MAC bound the candidates must meet: the tightest of those given. A speed-up of S
        needs at most 1/S of the MACs (token reduction speeds a model up by less than it cuts
        its MACs); the speed-up itself is then measured on the best candidates."""
        bounds = []
        if self.max_gmacs is not None:
            bounds.append(self.max_gmacs * 1e9)
        if self.max_gmacs_ratio is not None:
            bounds.append(self.max_gmacs_ratio * base_macs)
        if self.min_speedup is not None:
            bounds.append(base_macs / self.min_speedup)
        return min(bounds)

    def describe(self, base_macs: int) -> str:
        parts = []
        if self.max_gmacs is not None:
            parts.append(f"{self.max_gmacs:g} GMACs")
        if self.max_gmacs_ratio is not None:
            parts.append(f"{self.max_gmacs_ratio:g} of the GMACs")
        if self.min_speedup is not None:
            parts.append(f"a {self.min_speedup:g}x speed-up")
        return " and ".join(parts)


@dataclass
class SearchConfig:
    budget: Budget
    variants: Sequence[str]
    out: Path
    calib_images: int = 512
    batch_size: int = 32
    # None: the default grid, or on a windowed model each method's keep fitted in steps of 0.01.
    keep_grid: Sequence[float] | None = None
    max_candidates: int = 24
    warmup_steps: int = WARMUP_STEPS
    seed: int = 0
    timing: TimingOptions | None = None  # for --min-speedup
    variants_named: bool = True  # False: the default (every registered), left-outs not warned
    # Settings the scores depend on besides the above (model spec, data), for the cache.
    identity: dict[str, Any] = field(default_factory=dict)
    # Called after each newly scored candidate (tests stop a search here to resume it).
    on_scored: Callable[[int], None] | None = None


@dataclass
class SearchResult:
    data: dict[str, Any]
    out: Path

    def to_json(self) -> dict[str, Any]:
        return self.data


def search(loaded: LoadedModel, calibration_set: Dataset, config: SearchConfig) -> SearchResult:
    config.budget.check()
    if config.max_candidates < 1:
        raise SearchError(f"--max-candidates must be at least 1, got {config.max_candidates}")
    grid = config.keep_grid
    if grid is not None and (not grid or not all(0 < keep <= 1 for keep in grid)):
        raise SearchError(f"--keep-grid must be keep ratios in (0, 1], got {list(grid)}")
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    model = loaded.model.eval()
    size = loaded.input_size
    with step("capturing and profiling the base"):
        builder = CandidateBuilder(model, size)
        model_map = builder.model_map
        # The analytic cost model counts a block's tokens, not a window's: windowed models'
        # candidates are counted instead (search/windowed.py).
        windowed = any(b.windows is not None for b in model_map.blocks)
        cost_model = None if windowed else profile(model, model_map)
    base_macs = count_macs(model, size) if cost_model is None else cost_model.base_macs
    budget = config.budget.macs(base_macs)
    if cost_model is None:
        found = _windowed_space(builder, config, budget, base_macs)
    else:
        found = _analytic_space(model_map, cost_model, config, budget, base_macs)
    variants, matched, cost = found.variants, found.matched, found.cost

    with step(f"reading {config.calib_images} calibration images"):
        images, labels = calibration_images(calibration_set, config.calib_images, config.seed)
    settings = {
        **config.identity,
        "input_size": list(size),
        "calib_images": config.calib_images,
        "seed": config.seed,
        "warmup_steps": config.warmup_steps,
        "warmup_batch": WARMUP_BATCH,
        "base_macs": base_macs,
    }
    try:
        cache = ScoreCache(Path(config.out), settings)
    except CacheMismatch as e:
        raise SearchError(str(e)) from None
    timings["prepare"] = time.perf_counter() - clock
    clock = time.perf_counter()
    with step("base logits on the calibration images"):
        calibration = Calibration(images, labels, logits_of(model, images, config.batch_size))
    timings["base_pass"] = time.perf_counter() - clock

    space = found.space
    if space is None:  # a windowed model: one candidate per method, every one scored
        default: dict[str, Candidate | None] = {}
        proposals: Proposals | FixedProposals = FixedProposals(matched)
    else:
        default = _paper_default(model_map, space, variants, cost, budget)
        seeds = [c for c in default.values() if c is not None]
        for variant in variants:
            for locs in evenly_spaced(space, variant):
                candidate = match_budget(variant, locs, space, cost, budget)
                if candidate is not None:
                    seeds.append(candidate)
        proposals = Proposals(matched, seeds, space, variants, cost, budget, config.max_candidates)
        for row in cache.entries.values():  # a resumed (or earlier) search's scores count
            candidate = Candidate.from_json(row)
            macs = cost(candidate)
            # Rows of an earlier search over another grid are not this search's candidates.
            on_grid = all(
                any(abs(keep - tried) < 1e-9 for tried in space.keep_grid)
                for keep in candidate.keep
            )
            allowed = (on_grid and space.allows(candidate.locs, candidate.variant)) or (
                candidate in seeds
            )
            if macs is not None and macs <= budget and allowed:
                proposals.scored(candidate, row["score"])

    signals: dict[int, BlockSignals] | None = None
    scored_now = 0
    started = time.perf_counter()
    planned = len(matched) if proposals.exhaustive else config.max_candidates
    with step(f"scoring candidates ({proposals.name}, at most {planned})"):
        for candidate in proposals:
            if cache.get(candidate.key) is None:
                if get_variant(candidate.variant).learned and signals is None:
                    with step("reading block inputs and attention for the predictor warm-up"):
                        clock = time.perf_counter()
                        signals = block_signals(
                            builder, images, found.warm_blocks, config.batch_size
                        )
                        timings["warmup_inputs"] = time.perf_counter() - clock
                result = _score(candidate, builder, calibration, signals, config, cost)
                cache.put(candidate.key, result)
                scored_now += 1
            row = cache.get(candidate.key)
            proposals.scored(candidate, row["score"])
            best = _best_so_far(cache, proposals.scores, budget)
            detail(_progress_line(len(proposals.scores), planned, best))
            if config.on_scored is not None and cache.get(candidate.key) is not None:
                config.on_scored(scored_now)
    seconds = time.perf_counter() - started

    rows = [_row(c, cache.get(c.key), base_macs) for c in proposals.scores if cache.get(c.key)]
    within = [r for r in rows if r["macs"] <= budget and r["score"] is not None]
    front = pareto_front(within, cost=lambda r: r["macs"], score=lambda r: r["score"])
    best_row = max(within, key=lambda r: r["score"], default=None)
    speed: dict[str, Any] | None = None
    if config.budget.min_speedup is not None and best_row is not None:
        best_row, speed = _meet_speedup(builder, within, config, loaded)
    if best_row is None:
        raise SearchError("no scored candidate fits the budget")

    clock = time.perf_counter()
    if cost_model is None:  # every candidate's MACs were counted
        check = {"counted": True, "sample": [], "max_relative_error": 0.0}
        best_row["counted_macs"] = best_row["macs"]
    else:
        with step("cross-checking analytic MACs against counted MACs"):
            check = _cross_check(builder, rows, best_row, base_macs)
    timings["cross_check"] = time.perf_counter() - clock
    timings["scoring"] = seconds - timings.get("warmup_inputs", 0.0)
    # The paper's placement, matched to the budget, for each variant; the chosen variant's first.
    default_rows = [
        _row(c, cache.get(c.key), base_macs)
        for v, c in sorted(default.items(), key=lambda item: item[0] != best_row["variant"])
        if c is not None and cache.get(c.key)
    ]
    default_row = default_rows[0] if default_rows else None
    data = {
        "model": config.identity.get("model"),
        "base_macs": base_macs,
        "base_gmacs": base_macs / 1e9,
        "budget": {
            "macs": budget,
            "gmacs": budget / 1e9,
            "ratio": budget / base_macs,
            "asked": config.budget.describe(base_macs),
        },
        "space": {
            **found.info,
            "variants": list(variants),
            "left_out": found.left_out,
            "size": found.size,
            "budget_matched": len(matched),
        },
        "strategy": proposals.name,
        "scored": len(rows),
        "scored_now": scored_now,
        "from_cache": len(rows) - scored_now,
        "seconds": seconds,
        "seconds_per_candidate": (timings["scoring"] / scored_now if scored_now else None),
        "timings": timings,
        "calib_images": config.calib_images,
        "labels": labels is not None,
        "macs_check": check,
        "candidates": sorted(
            rows, key=lambda r: -(r["score"] if r["score"] is not None else -1e30)
        ),
        "pareto": front,
        "best": best_row,
        "paper_default": default_row,
        "paper_defaults": default_rows,
        "speedup": speed,
    }
    out = Path(config.out)
    header = [
        f"vitcompress search: {config.identity.get('model')} under "
        f"{config.budget.describe(base_macs)} ({budget / 1e9:.4g} GMACs)",
        f"{'counted' if cost_model is None else 'analytic'} {best_row['gmacs']:.4g} GMACs "
        f"({best_row['macs_ratio']:.3f} of the base), "
        f"KL {best_row['kl']:.4g}, top-1 agreement {best_row['agreement']:.4f}",
        "use: vitcompress apply --plan plan.yaml ... / vitcompress finetune --plan plan.yaml ...",
    ]
    data["files"] = {
        "recipe": str(write_recipe(out / RECIPE_NAME, best_row, header)),
        "plot": str(
            write_plot(
                out / PLOT_NAME, rows, front, best_row, default_row, budget / 1e9, base_macs / 1e9
            )
        ),
        "json": str(out / JSON_NAME),
        "cache": str(cache.path),
    }
    (out / JSON_NAME).write_text(json.dumps(data, indent=2, default=str))
    return SearchResult(data=data, out=out)


@dataclass
class _Candidates:
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


def _analytic_space(
    model_map, cost_model: CostModel, config: SearchConfig, budget: float, base_macs: int
) -> _Candidates:
    """The space of placements and keep ratios, costed by the analytic model."""
    variants, left_out = _searchable(config.variants, config.variants_named)
    space = build_space(
        model_map,
        variants,
        DEFAULT_KEEP_GRID if config.keep_grid is None else config.keep_grid,
        single_location=[v for v in variants if get_variant(v).single_location],
    )
    cost = _cost_function(cost_model, model_map)
    with step("enumerating the candidate space"):
        matched, smallest, size = _enumerate(space, variants, cost, budget)
    if not matched:
        if smallest is None:
            raise SearchError("no candidate of the space can be applied to this model")
        raise SearchError(
            f"no candidate reaches {_budget_text(config.budget, budget, base_macs)}; the "
            f"smallest is {smallest / 1e9:.3g} GMACs ({smallest / base_macs:.2f} of the base)"
        )
    return _Candidates(
        variants=variants,
        left_out={name: LEFT_OUT_WHY for name in left_out},
        matched=matched,
        cost=cost,
        warm_blocks=sorted({b for g in space.groups for b in g}),
        info={"locations": space.describe(), "keep_grid": list(space.keep_grid)},
        size=size,
        space=space,
    )


def _windowed_space(
    builder: CandidateBuilder, config: SearchConfig, budget: float, base_macs: int
) -> _Candidates:
    """One candidate per method, its keep fitted to the budget with the MACs counted
    (``search/windowed.py``)."""
    with step("fitting each method's keep to the budget, counted"):
        fitted = windowed_candidates(
            builder,
            _known(config.variants),
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
    return _Candidates(
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


def _known(variants: Sequence[str]) -> list[str]:
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
    for name in _known(variants):
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


def _cost_function(cost_model: CostModel, model_map) -> Callable[[Candidate], float | None]:
    memo: dict[Candidate, float | None] = {}

    def cost(candidate: Candidate) -> float | None:
        if candidate not in memo:
            plan = valid(candidate, model_map)
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


def _budget_text(budget: Budget, macs: float, base_macs: int) -> str:
    if budget.max_gmacs_ratio is not None and macs == budget.max_gmacs_ratio * base_macs:
        return f"{budget.max_gmacs_ratio:g} of the GMACs"
    if budget.max_gmacs is not None and macs == budget.max_gmacs * 1e9:
        return f"{budget.max_gmacs:g} GMACs"
    return f"1/{budget.min_speedup:g} of the GMACs (--min-speedup {budget.min_speedup:g})"


def _paper_default(
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


def _score(
    candidate: Candidate,
    builder: CandidateBuilder,
    calibration: Calibration,
    signals: dict[int, BlockSignals] | None,
    config: SearchConfig,
    cost,
) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        model = builder.build(candidate.variant, list(candidate.keep), list(candidate.locs))
    except PlanError as e:
        return {**candidate.to_json(), "macs": None, "score": None, "refused": str(e)}
    warm_loss = None
    if get_variant(candidate.variant).learned:
        warm_loss = _warm(model, candidate, signals, config)
    metrics = score_model(model, calibration, config.batch_size)
    return {
        **candidate.to_json(),
        "macs": cost(candidate),
        **metrics,
        "warmup_loss": warm_loss,
        "seconds": time.perf_counter() - started,
    }


def _warm(model: nn.Module, candidate: Candidate, signals, config: SearchConfig) -> list[float]:
    """Warm the predictors, or load them from the warm-up cache (per variant, locs, keep)."""
    folder = Path(config.out) / "warmup"
    folder.mkdir(parents=True, exist_ok=True)
    name = candidate.key.replace("|", "_").replace(",", "-") + ".pt"
    path = folder / name
    if path.exists():
        saved = torch.load(path, weights_only=True)
        load_predictor_state(model, saved["state"])
        return list(saved["losses"])
    assert signals is not None  # read before the first learned candidate
    windowed = {block.index for block in compression_info(model).model_map.blocks if block.windows}
    losses = warm_predictors(
        model, signals, list(candidate.locs), steps=config.warmup_steps, windowed=windowed
    )
    torch.save({"state": predictor_state(model), "losses": losses}, path)
    return losses


def _row(candidate: Candidate, result: dict[str, Any], base_macs: int) -> dict[str, Any]:
    macs = result.get("macs")
    return {
        **candidate.to_json(),
        "macs": macs,
        "gmacs": None if macs is None else macs / 1e9,
        "macs_ratio": None if macs is None else macs / base_macs,
        "score": result.get("score"),
        "kl": result.get("kl"),
        "agreement": result.get("agreement"),
        "accuracy": result.get("accuracy"),
        "warmup_loss": result.get("warmup_loss"),
        "seconds": result.get("seconds"),
    }


def _best_so_far(cache: ScoreCache, scores: dict[Candidate, float], budget: float):
    best = None
    for candidate, score in scores.items():
        row = cache.get(candidate.key)
        if score is None or row is None or row.get("macs") is None or row["macs"] > budget:
            continue
        if best is None or score > best[1]:
            best = (candidate, score)
    return best


def _progress_line(done: int, planned: int, best) -> str:
    width = 20
    filled = min(width, width * done // max(planned, 1))
    bar = "#" * filled + "." * (width - filled)
    text = f"[{bar}] {done}/{planned}"
    if best is not None:
        candidate, score = best
        text += (
            f"  best {candidate.variant} at {list(candidate.locs)} keep "
            f"{list(candidate.keep)}: KL {-score:.4g}"
        )
    return text


def _meet_speedup(
    builder: CandidateBuilder, within: list[dict[str, Any]], config: SearchConfig, loaded
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Time the best candidates against the base (paired rounds at --batch-size), best first;
    the first whose median speed-up reaches --min-speedup is chosen."""
    target = config.budget.min_speedup
    timing = config.timing or TimingOptions(batch_size=config.batch_size)
    tried = []
    for row in sorted(within, key=lambda r: -r["score"])[:MAX_SPEEDUP_TIMINGS]:
        with step(f"timing {row['variant']} at {row['locs']} against the base"):
            model = builder.build(row["variant"], row["keep"], row["locs"])
            measured, _ = measure_models(
                {"base": loaded.model.eval(), "compressed": model}, loaded.input_size, timing
            )
        paired = speedup(measured["compressed"], measured["base"])
        value = None if paired is None else paired.median
        tried.append({**row, "speedup": value, "speedup_ci95": paired and paired.interval})
        if value is not None and value >= target:
            return {**row, "speedup": value}, {"target": target, "tried": tried}
    best_seen = max((t["speedup"] or 0.0 for t in tried), default=0.0)
    raise SearchError(
        f"none of the {len(tried)} best candidates reached --min-speedup {target:g} on this "
        f"machine at batch {timing.batch_size} (best measured {best_seen:.2f}x)"
    )


def _cross_check(
    builder: CandidateBuilder, rows: list[dict[str, Any]], best: dict[str, Any], base_macs: int
) -> dict[str, Any]:
    """Counted MACs of a sample of the scored candidates (the chosen one first) against their
    analytic MACs; the largest relative error is reported."""
    sample = [best] + [r for r in rows if r is not best][: CROSS_CHECK_SAMPLE - 1]
    checked = []
    for row in sample:
        model = builder.build(row["variant"], row["keep"], row["locs"])
        measured = count_macs(model, builder.input_size)
        checked.append(
            {
                "variant": row["variant"],
                "locs": row["locs"],
                "keep": row["keep"],
                "analytic": row["macs"],
                "counted": measured,
                "relative_error": relative_error(row["macs"], measured),
            }
        )
    worst = max(c["relative_error"] for c in checked)
    if worst > 0.02:
        warn(f"analytic MACs differ from the counted MACs by up to {worst:.1%} on this model")
    best["counted_macs"] = checked[0]["counted"]
    return {"sample": checked, "max_relative_error": worst}
