"""The candidates of a search over a model with windowed attention (Swin, SAM, Hiera, ...).

The analytic cost model counts a block's tokens, not a window's, so it does not cost these
models. Their candidates are instead one per method: its default locations (every windowed
block, each restoring its own tokens) at the largest keep whose compressed model, counted, fits
the budget: in steps of 0.01 (:func:`vitcompress.measure.keep_fit.fit_keep`), or the largest of
a keep grid the user gave. Once ``max_candidates`` methods have found a candidate, in the
order given, the rest are left out and said so. The scoring, the cache and the
outputs are the search's own (``search/driver.py``), the learned variants' predictors warmed
on each window's tokens (``search/warmup.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vitcompress.compilation.placement import default_locs
from vitcompress.compilation.plan import PlanError
from vitcompress.measure import count_macs
from vitcompress.measure.keep_fit import GmacsRatio, fit_keep
from vitcompress.search.score import CandidateBuilder
from vitcompress.search.space import Candidate
from vitcompress.status import step
from vitcompress.variants import get_variant

# The warm-up reads each location's predictor input and attention scores as one batch of
# windows, the predictor choosing before the attention; neither holds where padded windows are
# reduced group by group, or where a predictor chooses on the MLP's input instead.
LEARNED_LEFT_OUT_WHY = (
    "its predictor warm-up reads a location's windows as one batch before the attention; here "
    "windows are padded (reduced group by group) or the attention runs on every token"
)
STRATEGY = "keep fitted to the budget per method"


@dataclass
class WindowedCandidates:
    """One budget-matched candidate per method, the MACs counted for each, and why a method has
    none (left out, or the budget out of its reach)."""

    candidates: list[Candidate] = field(default_factory=list)
    macs: dict[Candidate, int] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    out_of_reach: dict[str, str] = field(default_factory=dict)
    locs: tuple[int, ...] = ()


def windowed_candidates(
    builder: CandidateBuilder,
    variants: Sequence[str],
    budget: float,
    base_macs: int,
    keep_grid: Sequence[float] | None = None,
    max_candidates: int | None = None,
) -> WindowedCandidates:
    """For each of ``variants``: the largest keep (the same at every default location) whose
    compressed model costs at most ``budget`` MACs, counted: in steps of 0.01, or the largest of
    ``keep_grid`` where one is given. A learned one is left out where its warm-up does not apply
    (:data:`LEARNED_LEFT_OUT_WHY`); once ``max_candidates`` are found (a method out of reach
    finds none), the rest are left out."""
    found = WindowedCandidates(locs=tuple(default_locs(builder.model_map)))
    locs = list(found.locs)
    target = GmacsRatio(budget / base_macs)
    windows = [builder.model_map.blocks[i].windows for i in locs]
    warmable = all(w is None or (not w.padded and w.attention_reducible) for w in windows)
    for variant in variants:
        if get_variant(variant).learned and not warmable:
            found.left_out[variant] = LEARNED_LEFT_OUT_WHY
            continue
        if max_candidates is not None and len(found.candidates) >= max_candidates:
            found.left_out[variant] = (
                f"--max-candidates {max_candidates} reached (a windowed model's search has one "
                "candidate per method, in --variants' order)"
            )
            continue
        counted: dict[float, int] = {}

        def cost(keep: float, variant: str = variant, counted: dict = counted) -> float:
            model = builder.build(variant, [keep], locs)  # a PlanError: the keep is refused
            counted[keep] = count_macs(model, builder.input_size)
            return counted[keep] / base_macs

        with step(f"fitting {variant}'s keep to the budget"):
            try:
                if keep_grid is None:
                    keep = fit_keep(cost, target).keep
                else:
                    keep = fit_on_grid(cost, keep_grid, target.ratio)
            except PlanError as e:
                found.out_of_reach[variant] = e.detail
                continue
        candidate = Candidate(variant, found.locs, (keep,) * len(locs))
        found.candidates.append(candidate)
        found.macs[candidate] = counted[keep]
    return found


def fit_on_grid(cost: Callable[[float], float], keep_grid: Sequence[float], ratio: float) -> float:
    """The largest keep of ``keep_grid`` whose ``cost`` (its MACs over the base's; a
    :class:`PlanError` where the method refuses it) is at most ``ratio``, tried from the largest
    down: the cost grows with the keep, so the first within is the largest."""
    refusals: list[str] = []
    smallest: tuple[float, float] | None = None  # the smallest keep taken, and its cost
    for keep in sorted(set(keep_grid), reverse=True):
        try:
            share = cost(keep)
        except PlanError as refused:
            refusals.append(str(refused))
            continue
        if share <= ratio:
            return keep
        smallest = (keep, share)
    if smallest is not None:
        detail = (
            f"{ratio:g} is out of reach on --keep-grid: its smallest keep the method takes "
            f"here, {smallest[0]:g}, costs {smallest[1]:.3f} of the base's GMACs"
        )
    elif refusals:
        reason = Counter(refusals).most_common(1)[0][0]
        detail = f"no keep of --keep-grid is taken by this method here: {reason}"
    else:
        detail = "is empty"
    raise PlanError(detail, "keep_grid")
