"""Keep chosen for a GMACs budget: the largest keep ratio, the same at every location, whose
compressed model costs at most a given share of the base's MACs, found by counting.

A keep ratio says how many tokens a location keeps, not what the model then costs: that depends
on where the locations are, what runs outside them (a windowed block's attention, a conv stage)
and on the method's own work. Asked for a budget instead, the keep is found by bisection on a
grid of ``step``; every keep tried is compressed and its MACs counted, so the answer is measured,
not modelled: its own cost within the budget, the next keep on the grid over it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from vitcompress.compilation.plan import PlanError

PARAMETER = "keep_for_gmacs_ratio"


@dataclass(frozen=True)
class GmacsRatio:
    """Keep given as a budget: ``ratio`` of the base's GMACs. Passed where a keep ratio is
    taken; the compression resolves it with :func:`fit_keep` once the model is captured."""

    ratio: float
    step: float = 0.01

    def __post_init__(self) -> None:
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
            raise PlanError(f"must be a number, got {ratio!r}", PARAMETER)
        if not (math.isfinite(ratio) and ratio > 0):
            raise PlanError(f"must be above 0, got {ratio:g}", PARAMETER)
        steps = 1 / self.step
        if not (0 < self.step <= 0.5 and abs(steps - round(steps)) < 1e-9):
            raise PlanError(f"its step must divide 1, got {self.step:g}", PARAMETER)
        object.__setattr__(self, "ratio", float(ratio))


@dataclass(frozen=True)
class KeepFit:
    """What :func:`fit_keep` found: ``keep`` costs ``cost`` of the base's MACs; ``next_cost`` is
    the cost of the next keep on the grid, ``step`` above (``None`` when ``keep`` is 1);
    ``tries``: the keeps compressed and counted."""

    gmacs_ratio: float
    step: float
    keep: float
    cost: float
    next_cost: float | None
    tries: int

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "gmacs_ratio": self.gmacs_ratio,
            "step": self.step,
            "keep": self.keep,
            "cost": self.cost,
            "next_cost": self.next_cost,
            "tries": self.tries,
        }

    def text(self) -> str:
        """``keep 0.63: the largest (in steps of 0.01) within 0.85 of the base's GMACs (0.847;
        0.64 costs 0.853)``."""
        after = (
            f"; {self.keep + self.step:g} costs {self.next_cost:.3f}"
            if self.next_cost is not None
            else ""
        )
        return (
            f"keep {self.keep:g}: the largest (in steps of {self.step:g}) within {self.gmacs_ratio:g} of "
            f"the base's GMACs ({self.cost:.3f}{after})"
        )


def fit_keep(cost: Callable[[float], float], target: GmacsRatio) -> KeepFit:
    """The largest keep on ``target``'s grid whose ``cost`` (its MACs over the base's, counted on
    the compressed model) is at most ``target.ratio``.

    ``cost`` grows with the keep (more tokens, more work), so bisection finds it: the keep it
    returns is within the budget and the next keep on the grid is not, both counted. A budget
    that even the smallest keep exceeds (what runs outside the locations costs more) is one line.
    """
    steps = round(1 / target.step)
    counted: dict[int, float] = {}

    def at(index: int) -> float:
        if index not in counted:
            counted[index] = cost(index / steps)
        return counted[index]

    if at(steps) <= target.ratio:
        return KeepFit(target.ratio, target.step, 1.0, at(steps), None, len(counted))
    if at(1) > target.ratio:
        raise PlanError(
            f"{target.ratio:g} is out of reach: the smallest keep, {1 / steps:g}, costs "
            f"{at(1):.3f} of the base's GMACs (what runs outside the locations, and the "
            "method's own work, cost more than that)",
            PARAMETER,
        )
    within, over = 1, steps  # at(within) <= ratio < at(over)
    while over - within > 1:
        middle = (within + over) // 2
        if at(middle) <= target.ratio:
            within = middle
        else:
            over = middle
    return KeepFit(target.ratio, target.step, within / steps, at(within), at(over), len(counted))
