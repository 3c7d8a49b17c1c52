"""The candidates of a search over a model with windowed attention (Swin, SAM, Hiera, ...).

The analytic cost model counts a block's tokens, not a window's, so it does not cost these
models. Their candidates are instead one per method: its default locations (every windowed
block, each restoring its own tokens) at the largest keep whose compressed model, counted, fits
the budget (:func:`vitcompress.measure.keep_fit.fit_keep`). The scoring, the cache and the
outputs are the search's own (``search/driver.py``), the learned variants' predictors warmed
on each window's tokens (``search/warmup.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vitcompress.compilation.plan import PlanError, default_locs
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
    builder: CandidateBuilder, variants: Sequence[str], budget: float, base_macs: int
) -> WindowedCandidates:
    """For each of ``variants``: the largest keep (in steps of 0.01, the same at every default
    location) whose compressed model costs at most ``budget`` MACs, counted. A learned one is
    left out where its warm-up does not apply (:data:`LEARNED_LEFT_OUT_WHY`)."""
    found = WindowedCandidates(locs=tuple(default_locs(builder.model_map)))
    locs = list(found.locs)
    target = GmacsRatio(budget / base_macs)
    windows = [builder.model_map.blocks[i].windows for i in locs]
    warmable = all(w is None or (not w.padded and w.attention_blocker is None) for w in windows)
    for variant in variants:
        if get_variant(variant).learned and not warmable:
            found.left_out[variant] = LEARNED_LEFT_OUT_WHY
            continue
        counted: dict[float, int] = {}

        def cost(keep: float, variant: str = variant, counted: dict = counted) -> float:
            model = builder.build(variant, [keep], locs)  # a PlanError: the keep is refused
            counted[keep] = count_macs(model, builder.input_size)
            return counted[keep] / base_macs

        with step(f"fitting {variant}'s keep to the budget"):
            try:
                fit = fit_keep(cost, target)
            except PlanError as e:
                found.out_of_reach[variant] = e.detail
                continue
        candidate = Candidate(variant, found.locs, (fit.keep,) * len(locs))
        found.candidates.append(candidate)
        found.macs[candidate] = counted[fit.keep]
    return found
