"""CI gates: bounds on what a command measured, checked without side effects.

A gate is one bound given on the command line (``--max-acc-drop``, ``--min-speedup``,
``--max-gmacs``) compared with one measured value. ``check_gates`` turns the bounds and a dict of
measured values into results; commands print them and exit 3 when one failed (docs/ci.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vitcompress.errors import UserError

NO_THROUGHPUT = "needs throughput, which --no-throughput skips"


class GateError(ValueError, UserError):
    """A bound that the command cannot check (e.g. ``--min-speedup`` on one model); exit 2."""


@dataclass(frozen=True)
class Gate:
    name: str  # field of Bounds
    flag: str
    quantity: str  # key in the measured dict
    upper: bool  # True: the value must be <= the bound; False: >= the bound
    unit: str
    decimals: int


GATES: dict[str, Gate] = {
    gate.name: gate
    for gate in (
        Gate("max_acc_drop", "--max-acc-drop", "acc_drop", upper=True, unit=" points", decimals=2),
        Gate("min_speedup", "--min-speedup", "speedup", upper=False, unit="x", decimals=2),
        Gate("max_gmacs", "--max-gmacs", "gmacs", upper=True, unit=" GMACs", decimals=3),
    )
}


@dataclass(frozen=True)
class Bounds:
    """The bounds given on the command line; ``None`` means not gated."""

    max_acc_drop: float | None = None
    min_speedup: float | None = None
    max_gmacs: float | None = None

    def given(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in GATES if getattr(self, name) is not None}

    def __bool__(self) -> bool:
        return bool(self.given())


@dataclass(frozen=True)
class GateResult:
    name: str
    bound: float
    value: float | None
    passed: bool
    # 95% interval of a measured value that has one (the speed-up); the gate compares ``value``
    interval: tuple[float, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bound": self.bound,
            "value": self.value,
            "interval": None if self.interval is None else list(self.interval),
            "passed": self.passed,
        }

    @property
    def undecided(self) -> bool:
        """The bound lies inside the value's 95% interval: this machine could not tell."""
        return self.interval is not None and self.interval[0] <= self.bound <= self.interval[1]

    def message(self) -> str:
        """``--min-speedup 1.20 but measured 1.07x`` (failed) or ``... measured 1.31x`` (passed),
        with the 95% interval where the value has one."""
        gate = GATES[self.name]
        if self.value is None:
            return f"{gate.flag} {self.bound:.{gate.decimals}f} but it was not measured"
        bound, value = _format_pair(self.bound, self.value, gate.decimals)
        joint = "and" if self.passed else "but"
        text = f"{gate.flag} {bound} {joint} measured {value}{gate.unit}"
        if self.interval is not None:
            low, high = (f"{v:.{gate.decimals}f}" for v in self.interval)
            text += f" (95% interval {low}-{high}"
            text += (
                ": the bound lies inside it, so more --runs or a quieter machine would decide)"
                if self.undecided
                else ")"
            )
        return text


def _format_pair(bound: float, value: float, decimals: int) -> tuple[str, str]:
    """Both numbers with enough decimals that the bound prints as typed (up to 6) and different
    numbers never print the same."""
    typed = repr(float(bound))
    typed_places = len(typed.split(".")[1]) if "." in typed and "e" not in typed else 0
    for places in range(max(decimals, min(typed_places, 6)), 7):
        b, v = f"{bound:.{places}f}", f"{value:.{places}f}"
        if b != v or bound == value:
            return b, v
    return f"{bound:g}", f"{value:g}"


def require(bounds: Bounds, unavailable: Mapping[str, str]) -> None:
    """Raise ``GateError`` if a given bound is one the command cannot measure.

    ``unavailable`` maps a gate name to the reason it cannot be checked in this invocation.
    """
    for name in bounds.given():
        if name in unavailable:
            raise GateError(f"{GATES[name].flag}: {unavailable[name]}")


def check_gates(
    bounds: Bounds,
    measured: Mapping[str, float | None],
    intervals: Mapping[str, tuple[float, float] | None] | None = None,
) -> list[GateResult]:
    """One result per given bound, in the order of ``GATES``; a value missing fails its gate.

    ``measured`` holds ``acc_drop`` (points of top-1 lost), ``speedup`` (the median of the
    paired per-round throughput ratios, :func:`vitcompress.measure.paired_ratio`) and ``gmacs``,
    as far as the command measured them. The gate compares that value; ``intervals`` (95%, by
    quantity) are reported with it, so a result the machine could not decide says so.
    """
    intervals = intervals or {}
    results = []
    for name, bound in bounds.given().items():
        value = measured.get(GATES[name].quantity)
        if value is None:
            passed = False
        elif GATES[name].upper:
            passed = value <= bound
        else:
            passed = value >= bound
        interval = intervals.get(GATES[name].quantity)
        results.append(
            GateResult(
                name=name,
                bound=float(bound),
                value=None if value is None else float(value),
                passed=passed,
                interval=None if interval is None else (float(interval[0]), float(interval[1])),
            )
        )
    return results


def failed(results: list[GateResult]) -> list[GateResult]:
    return [r for r in results if not r.passed]
