"""Means over seeds with Student-t 95% intervals, and differences of means (Welch).

Pure Python (no scipy: it is not among the project's dependencies): the t quantile is found by
bisection on the t distribution's CDF, computed through the regularised incomplete beta function
(a continued fraction, as in Numerical Recipes' ``betacf``). Welch's degrees of freedom are not
whole numbers, so a table of integer quantiles would not do.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # The continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry
    # I_x(a, b) = 1 - I_{1-x}(b, a) on the other side.
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * fraction / a


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (any positive real)."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom, for 0.5 <= p < 1."""
    if not 0.5 <= p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0


@dataclass(frozen=True)
class Estimate:
    """A mean with its 95% interval; ``n`` values went into it."""

    mean: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> int:
        """+1 when the whole interval is above zero, -1 when below, 0 when it holds zero."""
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    def cell(self, digits: int = 2) -> str:
        """``mean [low, high]``, or the mean alone where the values did not vary."""
        if self.low == self.high:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"

    def signed_cell(self, digits: int = 2) -> str:
        if self.low == self.high:
            return f"{self.mean:+.{digits}f}"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def mean_interval(values: Sequence[float], level: float = 0.95) -> Estimate:
    """The mean of ``values`` with its Student-t interval (n - 1 degrees of freedom). One value,
    or values that do not vary, give an interval of width zero: nothing to say about noise."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = statistics.fmean(values)
    if n == 1:
        return Estimate(mean, mean, mean, 1)
    half = t_quantile(0.5 + level / 2.0, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n)


def combination_interval(
    groups: Sequence[tuple[float, Sequence[float]]], level: float = 0.95
) -> Estimate:
    """The interval of sum(weight * mean(group)) over independent groups: Welch's t with the
    Welch-Satterthwaite degrees of freedom. ``[(1, a), (-1, b)]`` is Welch's a - b;
    ``[(1, a), (-1, b), (-1, c), (1, d)]`` is a difference of two differences."""
    if any(len(values) < 1 for _, values in groups):
        raise ValueError("every group needs at least one value")
    mean = sum(weight * statistics.fmean(values) for weight, values in groups)
    # Each group's share of the variance of the combination.
    parts = [
        (weight**2 * statistics.variance(values) / len(values), len(values) - 1)
        for weight, values in groups
        if len(values) > 1
    ]
    variance = sum(v for v, _ in parts)
    n = min(len(values) for _, values in groups)
    if variance == 0.0 or n < 2:  # a group of one value has no spread to estimate
        return Estimate(mean, mean, mean, n)
    df = variance**2 / sum(v**2 / dof for v, dof in parts if v > 0)
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(variance)
    return Estimate(mean, mean - half, mean + half, n)
