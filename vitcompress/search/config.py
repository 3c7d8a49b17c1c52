"""What a search is asked: its budget, its settings and its result; a search that cannot run as
asked is a :class:`SearchError` in one line."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitcompress.errors import UserError
from vitcompress.measure.models import TimingOptions
from vitcompress.search.warmup import (
    WARMUP_STEPS,
)


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
    # Every candidate's tokens after each location rounded to a multiple of this, as apply's
    # --kept-multiple rounds them (the ``kept_multiple`` setting every method takes).
    kept_multiple: int | None = None

    @property
    def method_settings(self) -> dict[str, Any] | None:
        """The settings every candidate's method is made with (``None``: the defaults)."""
        return None if self.kept_multiple is None else {"kept_multiple": self.kept_multiple}


@dataclass
class SearchResult:
    data: dict[str, Any]
    out: Path

    def to_json(self) -> dict[str, Any]:
        return self.data


def budget_text(budget: Budget, macs: float, base_macs: int) -> str:
    if budget.max_gmacs_ratio is not None and macs == budget.max_gmacs_ratio * base_macs:
        return f"{budget.max_gmacs_ratio:g} of the GMACs"
    if budget.max_gmacs is not None and macs == budget.max_gmacs * 1e9:
        return f"{budget.max_gmacs:g} GMACs"
    return f"1/{budget.min_speedup:g} of the GMACs (--min-speedup {budget.min_speedup:g})"
