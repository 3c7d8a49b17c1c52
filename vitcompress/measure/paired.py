"""Speed ratios from paired timings, with an interval that says how sure they are.

``measure_throughput`` times one batch of every model per round, so batch *i* of model A and
batch *i* of model B ran seconds apart and saw the same state of the machine. Their ratio cancels
a slow spell that hits both, which a ratio of medians pooled over minutes cannot. The median of
the per-round ratios is the estimate; a percentile bootstrap of that median gives its 95%
interval. Under load the interval widens instead of the number silently drifting.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MIN_PAIRS_FOR_INTERVAL",
    "PairedRatio",
    "bootstrap_median_ci",
    "paired_ratio",
    "paired_ratios",
    "rounds_text",
    "verdict",
]

# Below this many pairs a bootstrap interval of the median is little more than the sample range.
MIN_PAIRS_FOR_INTERVAL = 5


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` for each timed round (images/s of A over B: A's speed-up when > 1)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    return [x / y for x, y in zip(a, b, strict=True)]


def bootstrap_median_ci(
    values: Sequence[float], level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the median (fixed seed: the same data, the same
    interval)."""
    if not values:
        raise ValueError("no values to bootstrap")
    data = torch.tensor(list(values), dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(data), (resamples, len(data)), generator=generator)
    medians = data[draws].median(dim=1).values
    tail = (1 - level) / 2
    return (float(torch.quantile(medians, tail)), float(torch.quantile(medians, 1 - tail)))


def verdict(interval: tuple[float, float], target: float) -> str:
    """ "yes" when the whole interval is at or above the target, "no" when it is all below, else
    "undecided": more batches are needed to tell."""
    low, high = interval
    return "yes" if low >= target else "no" if high < target else "undecided"


@dataclass(frozen=True)
class PairedRatio:
    """Median of the paired ratios and its bootstrap 95% interval (None below
    :data:`MIN_PAIRS_FOR_INTERVAL` pairs)."""

    median: float
    low: float | None
    high: float | None
    pairs: int

    @property
    def interval(self) -> tuple[float, float] | None:
        return None if self.low is None or self.high is None else (self.low, self.high)

    def to_json(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "ci95": None if self.interval is None else list(self.interval),
            "pairs": self.pairs,
        }

    def text(self) -> str:
        """``1.31x [1.25, 1.38]``; without an interval the rounds say why: ``1.11x (3 rounds, no
        interval)``, never a bare number that reads as a measured difference."""
        if self.interval is None:
            return f"{self.median:.2f}x ({rounds_text(self.pairs)}, no interval)"
        return f"{self.median:.2f}x [{self.low:.2f}, {self.high:.2f}]"

    def summary(self, ratio_of_medians: float | None = None) -> str:
        """One line naming the statistic, for under a table whose rates are each model's median:
        ``speed-up 1.04x [0.99, 1.09]: the median of 10 per-round ratios ... with its 95%
        interval``, or, from fewer rounds than an interval needs, that it is no measured
        difference. ``ratio_of_medians`` (the rates' own ratio) is named too when it lies on the
        other side of 1: the machine's speed changed while timing, which the pairs cancel and the
        medians do not."""
        rounds = rounds_text(self.pairs)
        line = (
            f"speed-up {self.median:.2f}x: the median of {self.pairs} per-round ratios "
            "(compressed over base, timed in the same round; what --min-speedup compares)"
        )
        if self.interval is None:
            line = (
                f"speed-up {self.median:.2f}x from {rounds}: too few for a 95% interval (it needs "
                f"{MIN_PAIRS_FOR_INTERVAL}; raise --bench-seconds or --runs), so neither it nor "
                "the ratio of the medians is a measured difference"
            )
        else:
            line += f", 95% interval [{self.low:.2f}, {self.high:.2f}]"
        if ratio_of_medians is not None and (ratio_of_medians - 1) * (self.median - 1) < 0:
            line += (
                f"; the ratio of the medians ({ratio_of_medians:.2f}x) lies on the other side of "
                "1: the machine's speed changed while timing, which the per-round ratios cancel"
            )
        return line


def rounds_text(pairs: int) -> str:
    """``1 round``, ``3 rounds``."""
    return f"{pairs} round{'s' if pairs != 1 else ''}"


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> PairedRatio:
    """A's throughput over B's from samples timed round by round (``ModelThroughput.samples``)."""
    ratios = paired_ratios(a, b)
    if not ratios:
        raise ValueError("no paired samples")
    median = statistics.median(ratios)
    if len(ratios) < MIN_PAIRS_FOR_INTERVAL:
        return PairedRatio(median=median, low=None, high=None, pairs=len(ratios))
    low, high = bootstrap_median_ci(ratios)
    return PairedRatio(median=median, low=low, high=high, pairs=len(ratios))
