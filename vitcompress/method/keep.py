"""Keep lists in the official configs' form: cumulative fractions of the initial token count.

The official dTPS/DynamicViT configs give, per location, the fraction of the stage's ORIGINAL
patch count still kept after it (``[0.7, 0.49, 0.343]``: ``int(N0 * c_s)`` tokens); ``--keep``
here gives per-location ratios (``0.7,0.7,0.7``), whose running product is that fraction.
:func:`per_location_keep` turns the first form into the second, so that the plan built from the
ratios keeps exactly the official counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vitcompress.method.select import keep_count

# A fraction that the ratios' product misses by more than this (relative) is not "the same": the
# ratio loss's target is the product, and the official target is the fraction itself.
_TARGET_TOLERANCE = 1e-9
_MAX_NUDGES = 64  # ulps a ratio is moved at most to make its product land on the fraction


class KeepListError(ValueError):
    """A cumulative keep list that cannot be used; the message is one line, without the option
    name (the caller says which option or argument it came from)."""


@dataclass(frozen=True)
class CumulativeKeep:
    """Keep given as cumulative fractions of each stage's initial patch count, one per location
    (the official configs' ``keep_ratio`` list). Passed where a keep ratio or list is taken, it is
    converted by :func:`per_location_keep` once the locations and their stages are known."""

    fractions: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "fractions", tuple(self.fractions))


def planned_cumulative(ratios: Sequence[float]) -> float:
    """The cumulative keep the plan derives from a stage's ratios so far: ``rho ** s`` when they
    are all equal, else their product left to right (as ``graph.plan.make_plan`` computes it;
    the caller checks the plan's counts afterwards, so a drift there is caught, not trusted)."""
    if all(r == ratios[-1] for r in ratios):
        return ratios[-1] ** len(ratios)
    return math.prod(ratios)


def _candidates(fraction: float, previous_fraction: float, previous_product: float):
    """Ratios to try, best first: the plain quotient rounded to 12 digits (what a person would
    write, e.g. 0.7 for 0.49 / 0.7), the exact quotients, then those moved up and down by ulps."""
    plain = fraction / previous_fraction
    yield float(f"{plain:.12g}")
    raw = fraction / previous_product
    yield raw
    yield plain
    up = down = raw
    for _ in range(_MAX_NUDGES):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, 0.0)
        yield up
        yield down


def per_location_keep(
    fractions: Sequence[float], stages: Sequence[int], patch_tokens: Sequence[int]
) -> list[float]:
    """Per-location keep ratios from cumulative fractions, one of each per location.

    ``stages[i]`` is the stage of location ``i`` and ``patch_tokens[i]`` that stage's initial patch
    count N0: fractions are of the stage's own N0 and restart at each stage (a pyramid's next stage
    starts from its full grid). Within a stage the fractions must not increase. The ratios are
    chosen so that the plan's cumulative keep gives ``int(N0 * fraction)`` tokens at every location
    (the official count) and equals the fraction to 1e-9; raises :class:`KeepListError` otherwise.
    """
    if not (len(fractions) == len(stages) == len(patch_tokens)):
        raise KeepListError(f"has {len(fractions)} values for {len(stages)} locations")
    for value in fractions:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KeepListError(f"must be numbers, got {value!r}")
        if not 0.0 < value <= 1.0:  # NaN fails this too
            raise KeepListError(f"must be in (0, 1], got {value}")
    ratios: list[float] = []
    by_stage: dict[int, list[tuple[float, float]]] = {}  # stage -> [(fraction, ratio)]
    for fraction, stage, n0 in zip(map(float, fractions), stages, patch_tokens, strict=True):
        earlier = by_stage.setdefault(stage, [])
        previous = earlier[-1][0] if earlier else 1.0
        if fraction > previous:
            raise KeepListError(
                f"must not increase within a stage (fractions of the stage's "
                f"initial count), got {previous} then {fraction}"
            )
        earlier_ratios = [r for _, r in earlier]
        previous_product = planned_cumulative(earlier_ratios) if earlier_ratios else 1.0
        official = keep_count(n0, fraction, "floor")
        for ratio in _candidates(fraction, previous, previous_product):
            if not 0.0 < ratio <= 1.0:
                continue
            product = planned_cumulative(earlier_ratios + [ratio])
            if (
                keep_count(n0, product, "floor") == official
                and abs(product - fraction) <= _TARGET_TOLERANCE * fraction
            ):
                break
        else:
            raise KeepListError(
                f"cannot be made exact as per-location ratios at {fraction} "
                f"(N0 {n0}); give per-location ratios instead"
            )
        earlier.append((fraction, ratio))
        ratios.append(ratio)
    return ratios
