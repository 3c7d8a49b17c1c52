"""A plan from cumulative keep fractions (the official configs' form, ``--keep-cumulative``).

The fractions become per-location ratios BEFORE the plan is made (``method.keep``), and the plan
made from them is checked to keep ``int(N0 * fraction)`` tokens at every location, the count of
the official code, so a drift between the two is refused rather than trained on.
"""

from __future__ import annotations

import math

from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.placement import default_locs
from vitcompress.compilation.plan import Plan, PlanError, make_plan
from vitcompress.method import CumulativeKeep, KeepListError, keep_count, per_location_keep
from vitcompress.variants import VARIANTS, Variant

PARAMETER = "keep_cumulative"  # how PlanError names it (the CLI says --keep-cumulative)


def plan_from_cumulative(
    model_map: ModelMap, method: Variant, keep: CumulativeKeep, locs: list[int] | None, policy: str
) -> Plan:
    """``make_plan`` with keep given as cumulative fractions of each stage's initial patch count.

    Only the predictor variants (dtps, dynamicvit) count kept tokens as a fraction of N0; the
    attention variants keep ``ceil(rho * n)`` of the tokens present, so the official counts of a
    cumulative list cannot be promised for them and it is refused.
    """
    if locs is not None and not isinstance(locs, list):
        raise PlanError(f"must be a list of block indices or None, got {locs!r}", "locs")
    locations = default_locs(model_map, method.carry_windows) if locs is None else locs
    # Indices out of range are make_plan's to refuse; only the ones in range are looked up here.
    depth = len(model_map.blocks)
    stages = [
        model_map.blocks[b].stage if isinstance(b, int) and 0 <= b < depth else -1
        for b in locations
    ]
    patch_tokens = [math.prod(model_map.stages[s].grid) if s >= 0 else 1 for s in stages]
    try:
        ratios = per_location_keep(list(keep.fractions), stages, patch_tokens)
    except KeepListError as e:
        raise PlanError(str(e), PARAMETER) from None
    plan = make_plan(model_map, method, ratios, locs, policy)
    if not method.keeps_fraction_of_initial:
        takers = [name for name, v in VARIANTS.items() if v.keeps_fraction_of_initial]
        raise PlanError(
            f"is for {' and '.join(takers)}, which keep a fraction of the initial "
            f"count; {method.name} {method.keep_counting()}: give per-location ratios",
            PARAMETER,
        )
    for loc, fraction in zip(plan.locations, keep.fractions, strict=True):
        official = keep_count(loc.patch_tokens, fraction, "floor")
        if loc.keep_tokens != official:
            raise PlanError(
                f"{fraction} at block {loc.block} plans {loc.keep_tokens} tokens, not "
                f"int({loc.patch_tokens} * {fraction}) = {official}",
                PARAMETER,
            )
    return plan
