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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import PlanError
from vitcompress.loading import LoadedModel
from vitcompress.measure import count_macs
from vitcompress.measure.models import TimingOptions, measure_models, speedup
from vitcompress.search.cache import CacheMismatch, ScoreCache
from vitcompress.search.candidates import (
    Candidates,
    FixedProposals,
    analytic_space,
    paper_default,
    windowed_space,
)
from vitcompress.search.config import Budget, SearchConfig, SearchError, SearchResult
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
from vitcompress.search.space import Candidate
from vitcompress.search.strategy import Proposals, evenly_spaced, match_budget
from vitcompress.search.warmup import (
    WARMUP_BATCH,
    BlockSignals,
    block_signals,
    load_predictor_state,
    predictor_state,
    warm_predictors,
)
from vitcompress.status import detail, step, warn
from vitcompress.variants import get_variant

CROSS_CHECK_SAMPLE = 4  # candidates whose analytic MACs are compared with counted MACs
MAX_SPEEDUP_TIMINGS = 5  # candidates timed, best first, for --min-speedup

__all__ = ["Budget", "SearchConfig", "SearchError", "SearchResult", "search"]


def search(loaded: LoadedModel, calibration_set: Dataset, config: SearchConfig) -> SearchResult:
    """The search, phase by phase: check the settings, profile the base and find the
    budget-matched candidates, read the calibration images, propose, score, pick the best (and
    time it for a speed-up), then write the results."""
    _check_settings(config)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    run = _prepare(loaded, config)
    _calibrate(run, calibration_set)
    _propose(run)
    _score_proposals(run)
    _pick_best(run)
    data = _results(run)
    _write_outputs(run, data)
    return SearchResult(data=data, out=Path(config.out))


@dataclass
class _Search:
    """What the search's phases have found so far."""

    loaded: LoadedModel
    config: SearchConfig
    model: nn.Module
    builder: CandidateBuilder
    cost_model: CostModel | None  # None on a windowed model: every candidate's MACs counted
    base_macs: int
    budget: float
    found: Candidates
    timings: dict[str, float] = field(default_factory=dict)
    clock: float = field(default_factory=time.perf_counter)
    labels: Any = None
    images: Any = None
    cache: ScoreCache | None = None
    calibration: Calibration | None = None
    default: dict[str, Candidate | None] = field(default_factory=dict)
    proposals: Proposals | FixedProposals | None = None
    scored_now: int = 0
    seconds: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    front: list[dict[str, Any]] = field(default_factory=list)
    best_row: dict[str, Any] | None = None
    speed: dict[str, Any] | None = None
    check: dict[str, Any] = field(default_factory=dict)
    default_rows: list[dict[str, Any]] = field(default_factory=list)

    def lap(self, name: str) -> None:
        """Record the time since the last lap under ``name``."""
        now = time.perf_counter()
        self.timings[name] = now - self.clock
        self.clock = now


def _check_settings(config: SearchConfig) -> None:
    config.budget.check()
    if config.max_candidates < 1:
        raise SearchError(f"--max-candidates must be at least 1, got {config.max_candidates}")
    grid = config.keep_grid
    if grid is not None and (not grid or not all(0 < keep <= 1 for keep in grid)):
        raise SearchError(f"--keep-grid must be keep ratios in (0, 1], got {list(grid)}")


def _prepare(loaded: LoadedModel, config: SearchConfig) -> _Search:
    """Capture and profile the base; the budget in MACs; the budget-matched candidates."""
    clock = time.perf_counter()
    model = loaded.model.eval()
    size = loaded.input_size
    with step("capturing and profiling the base"):
        builder = CandidateBuilder(model, size, config.method_settings)
        model_map = builder.model_map
        # The analytic cost model counts a block's tokens, not a window's: windowed models'
        # candidates are counted instead (search/windowed.py).
        windowed = any(b.windows is not None for b in model_map.blocks)
        cost_model = None if windowed else profile(model, model_map)
    base_macs = count_macs(model, size) if cost_model is None else cost_model.base_macs
    budget = config.budget.macs(base_macs)
    if cost_model is None:
        found = windowed_space(builder, config, budget, base_macs)
    else:
        found = analytic_space(model_map, cost_model, config, budget, base_macs)
    return _Search(
        loaded, config, model, builder, cost_model, base_macs, budget, found, clock=clock
    )


def _calibrate(run: _Search, calibration_set: Dataset) -> None:
    """The calibration images, the score cache (refused where its settings differ) and the
    base's logits on the images."""
    config = run.config
    with step(f"reading {config.calib_images} calibration images"):
        run.images, run.labels = calibration_images(
            calibration_set, config.calib_images, config.seed
        )
    settings = {
        **config.identity,
        "input_size": list(run.loaded.input_size),
        "calib_images": config.calib_images,
        "seed": config.seed,
        "warmup_steps": config.warmup_steps,
        "warmup_batch": WARMUP_BATCH,
        "base_macs": run.base_macs,
        # Only where given, so that a cache from before the setting existed still matches.
        **({"kept_multiple": config.kept_multiple} if config.kept_multiple is not None else {}),
    }
    try:
        run.cache = ScoreCache(Path(config.out), settings)
    except CacheMismatch as e:
        raise SearchError(str(e)) from None
    run.lap("prepare")
    with step("base logits on the calibration images"):
        logits = logits_of(run.model, run.images, config.batch_size)
        run.calibration = Calibration(run.images, run.labels, logits)
    run.lap("base_pass")


def _propose(run: _Search) -> None:
    """What to score: on a windowed model every candidate, once; else the strategy's proposals
    seeded with the paper's default placements and evenly spaced ones, and fed the scores an
    earlier (or killed) search left in the cache."""
    space, found, budget = run.found.space, run.found, run.budget
    if space is None:
        run.proposals = FixedProposals(found.matched)
        return
    run.default = paper_default(run.builder.model_map, space, found.variants, found.cost, budget)
    seeds = [c for c in run.default.values() if c is not None]
    for variant in found.variants:
        for locs in evenly_spaced(space, variant):
            candidate = match_budget(variant, locs, space, found.cost, budget)
            if candidate is not None:
                seeds.append(candidate)
    run.proposals = Proposals(
        found.matched, seeds, space, found.variants, found.cost, budget, run.config.max_candidates
    )
    for row in run.cache.entries.values():
        candidate = Candidate.from_json(row)
        macs = found.cost(candidate)
        # Rows of an earlier search over another grid or of other methods (--variants) are not
        # this search's candidates.
        on_grid = all(
            any(abs(keep - tried) < 1e-9 for tried in space.keep_grid) for keep in candidate.keep
        )
        allowed = candidate.variant in found.variants and (
            (on_grid and space.allows(candidate.locs, candidate.variant)) or candidate in seeds
        )
        if macs is not None and macs <= budget and allowed:
            run.proposals.scored(candidate, row["score"])


def _score_proposals(run: _Search) -> None:
    """Score each proposal not in the cache yet (reading the predictor warm-up's signals before
    the first learned one), with a progress line after each."""
    config, cache, proposals = run.config, run.cache, run.proposals
    signals: dict[int, BlockSignals] | None = None
    started = time.perf_counter()
    planned = len(run.found.matched) if proposals.exhaustive else config.max_candidates
    with step(f"scoring candidates ({proposals.name}, at most {planned})"):
        for candidate in proposals:
            if cache.get(candidate.key) is None:
                if get_variant(candidate.variant).learned and signals is None:
                    with step("reading block inputs and attention for the predictor warm-up"):
                        clock = time.perf_counter()
                        signals = block_signals(
                            run.builder, run.images, run.found.warm_blocks, config.batch_size
                        )
                        run.timings["warmup_inputs"] = time.perf_counter() - clock
                result = _score(
                    candidate, run.builder, run.calibration, signals, config, run.found.cost
                )
                cache.put(candidate.key, result)
                run.scored_now += 1
            proposals.scored(candidate, cache.get(candidate.key)["score"])
            best = _best_so_far(cache, proposals.scores, run.budget)
            detail(_progress_line(len(proposals.scores), planned, best))
            if config.on_scored is not None and cache.get(candidate.key) is not None:
                config.on_scored(run.scored_now)
    run.seconds = time.perf_counter() - started


def _pick_best(run: _Search) -> None:
    """The best-scored candidate within the budget (timed for --min-speedup), the Pareto front,
    the analytic MACs cross-checked, and the paper's defaults for comparison."""
    cache, config, base_macs = run.cache, run.config, run.base_macs
    run.rows = [
        _row(c, cache.get(c.key), base_macs) for c in run.proposals.scores if cache.get(c.key)
    ]
    within = [r for r in run.rows if r["macs"] <= run.budget and r["score"] is not None]
    if run.cost_model is not None:  # analytic MACs: the ones chosen from are counted too
        within = _counted_within(run, within)
    run.front = pareto_front(within, cost=lambda r: r["macs"], score=lambda r: r["score"])
    run.best_row = max(within, key=lambda r: r["score"], default=None)
    if config.budget.min_speedup is not None and run.best_row is not None:
        run.best_row, run.speed = _meet_speedup(run.builder, within, config, run.loaded)
    if run.best_row is None:
        raise SearchError("no scored candidate fits the budget")
    clock = time.perf_counter()
    if run.cost_model is None:  # every candidate's MACs were counted
        run.check = {"counted": True, "sample": [], "max_relative_error": 0.0}
        run.best_row["counted_macs"] = run.best_row["macs"]
    else:
        with step("cross-checking analytic MACs against counted MACs"):
            run.check = _cross_check(run.builder, run.rows, run.best_row, base_macs)
    run.timings["cross_check"] = time.perf_counter() - clock
    run.timings["scoring"] = run.seconds - run.timings.get("warmup_inputs", 0.0)
    # The paper's placement, matched to the budget, for each variant; the chosen variant's first.
    chosen = run.best_row["variant"]
    run.default_rows = [
        _row(c, cache.get(c.key), base_macs)
        for v, c in sorted(run.default.items(), key=lambda item: item[0] != chosen)
        if c is not None and cache.get(c.key)
    ]


def _results(run: _Search) -> dict[str, Any]:
    """The search's JSON."""
    config, found, budget, base_macs = run.config, run.found, run.budget, run.base_macs
    scoring = run.timings["scoring"]
    return {
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
            "variants": list(found.variants),
            "left_out": found.left_out,
            "size": found.size,
            "budget_matched": len(found.matched),
        },
        "strategy": run.proposals.name,
        "scored": len(run.rows),
        "scored_now": run.scored_now,
        "from_cache": len(run.rows) - run.scored_now,
        "seconds": run.seconds,
        "seconds_per_candidate": (scoring / run.scored_now if run.scored_now else None),
        "timings": run.timings,
        "calib_images": config.calib_images,
        "labels": run.labels is not None,
        "macs_check": run.check,
        "candidates": sorted(
            run.rows, key=lambda r: -(r["score"] if r["score"] is not None else -1e30)
        ),
        "pareto": run.front,
        "best": run.best_row,
        "paper_default": run.default_rows[0] if run.default_rows else None,
        "paper_defaults": run.default_rows,
        "speedup": run.speed,
    }


def _write_outputs(run: _Search, data: dict[str, Any]) -> None:
    """The recipe, the Pareto plot and the JSON, named in the JSON's ``files``."""
    config, best_row, budget, base_macs = run.config, run.best_row, run.budget, run.base_macs
    out = Path(config.out)
    header = [
        f"vitcompress search: {config.identity.get('model')} under "
        f"{config.budget.describe(base_macs)} ({budget / 1e9:.4g} GMACs)",
        f"{'counted' if run.cost_model is None else 'analytic'} {best_row['gmacs']:.4g} GMACs "
        f"({best_row['macs_ratio']:.3f} of the base), "
        f"KL {best_row['kl']:.4g}, top-1 agreement {best_row['agreement']:.4f}",
        "use: vitcompress apply --plan plan.yaml ... / vitcompress finetune --plan plan.yaml ...",
    ]
    plot = write_plot(
        out / PLOT_NAME,
        run.rows,
        run.front,
        best_row,
        data["paper_default"],
        budget / 1e9,
        base_macs / 1e9,
    )
    data["files"] = {
        "recipe": str(write_recipe(out / RECIPE_NAME, best_row, header)),
        "plot": str(plot),
        "json": str(out / JSON_NAME),
        "cache": str(run.cache.path),
    }
    (out / JSON_NAME).write_text(json.dumps(data, indent=2, default=str))


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
        **_rounding(model, config),
        "macs": cost(candidate),
        **metrics,
        "warmup_loss": warm_loss,
        "seconds": time.perf_counter() - started,
    }


def _rounding(model: nn.Module, config: SearchConfig) -> dict[str, Any]:
    """With --kept-multiple: the multiple, and each location whose count it changed, block ->
    [patch tokens after it as the keep gave them, as rounded] (the plan's ``rounded_from``)."""
    if config.kept_multiple is None:
        return {}
    plan = compression_info(model).plan
    rounded = {str(block): list(counts) for block, counts in plan.rounded_from.items()}
    return {"kept_multiple": config.kept_multiple, "rounded_from": rounded}


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
        **{key: result[key] for key in ("kept_multiple", "rounded_from") if key in result},
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


def _counted_within(run: _Search, within: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``within`` less the candidates whose counted MACs exceed the budget, checked best-scored
    first until as many fit as the choice may need (one, or every candidate --min-speedup may
    time): the analytic count, within 2% of the counted one, may put a candidate at the
    budget's edge on the wrong side of it."""
    needed = MAX_SPEEDUP_TIMINGS if run.config.budget.min_speedup is not None else 1
    over, fitting = [], 0
    for row in sorted(within, key=lambda r: -r["score"]):
        if fitting == needed:
            break
        model = run.builder.build(row["variant"], row["keep"], row["locs"])
        row["counted_macs"] = count_macs(model, run.builder.input_size)
        if row["counted_macs"] > run.budget:
            over.append(row)
        else:
            fitting += 1
    if over:
        warn(
            f"{len(over)} candidate(s) within the budget by analytic MACs are over it counted "
            f"(e.g. {over[0]['variant']} at {over[0]['locs']}: {over[0]['counted_macs']:,} "
            f"counted > {run.budget:,.0f}); they are not chosen"
        )
    return [r for r in within if not any(r is o for o in over)]


def _cross_check(
    builder: CandidateBuilder, rows: list[dict[str, Any]], best: dict[str, Any], base_macs: int
) -> dict[str, Any]:
    """Counted MACs of a sample of the scored candidates (the chosen one first) against their
    analytic MACs; the largest relative error is reported."""
    sample = [best] + [r for r in rows if r is not best][: CROSS_CHECK_SAMPLE - 1]
    checked = []
    for row in sample:
        measured = row.get("counted_macs")  # counted already where the choice needed it
        if measured is None:
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
