"""How many threads a CPU timing uses, and why (:class:`ThreadChoice`): as many as torch would use,
but no more than the cores the load average leaves free (:func:`choose_threads`), with the
starvation check's result when the machine filled up while timing (:class:`StarvationCheck`).

The functions that read the machine (the load average, the CPUs, this process's own load) live in
:mod:`.throughput`, next to the timing that calls them; this module holds the pure decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["STARVATION_FACTOR", "StarvationCheck", "ThreadChoice", "choose_threads", "load_warning"]

# The same model timed at 1 thread more than this many times faster than at the chosen count: the
# chosen threads were starved by other work, and their numbers are not a speed of the model. A
# quiet machine cannot make 1 thread faster at all, so 2 leaves a wide margin for noise.
STARVATION_FACTOR = 2.0


def load_warning(loads: list[float | None], threads: int) -> str | None:
    """A warning when the machine was busier than the threads timing used, else None."""
    seen = [load for load in loads if load is not None]
    if not seen or max(seen) <= threads:
        return None
    return (
        f"the 1-minute load average was {max(seen):.1f} with {threads} torch threads "
        "timing: other work shared the CPU, so throughput is low and its ratios noisy; "
        "time on a quiet machine, or check the 95% interval"
    )


@dataclass(frozen=True)
class StarvationCheck:
    """The first model timed again at 1 thread after timing at ``threads`` on a full machine."""

    model: str
    threads: int
    rate: float  # images/s at ``threads`` (the median of the timed rounds)
    one_thread_rate: float  # images/s at 1 thread (the median of the check's batches)
    starved: bool  # one_thread_rate > STARVATION_FACTOR * rate


@dataclass(frozen=True)
class ThreadChoice:
    """How many threads timing used, and why.

    ``reason``: ``fits`` (the threads torch uses fit the free cores), ``load`` (fewer, so as not to
    oversubscribe the cores the load average leaves free), ``no-load`` (no load average on this
    system: torch's count), ``fixed`` (the caller set the count), ``starved`` (the starvation
    check failed, and everything was timed again at 1 thread).
    """

    asked: int  # the threads torch would use (torch.get_num_threads() when timing began)
    cpus: int  # the CPUs this process may run on
    load: float | None  # the 1-minute load average before timing
    own: float  # this process's estimated share of it (:func:`own_load`)
    threads: int  # the threads the reported numbers were timed with
    reason: str
    starvation: StarvationCheck | None = None

    @property
    def free(self) -> float | None:
        """Cores not taken by other work, by the load average; None without one."""
        if self.load is None:
            return None
        return self.cpus - max(0.0, self.load - self.own)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["free_cpus"] = self.free
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ThreadChoice:
        """The choice back from :meth:`to_json` (a report's ``environment["thread_choice"]``)."""
        fields = {k: v for k, v in data.items() if k not in ("free_cpus", "starvation")}
        check = data.get("starvation")
        return cls(**fields, starvation=None if check is None else StarvationCheck(**check))

    def text(self) -> str:
        """One line for a report: ``1 thread of 2 (load 3.4 on 2 CPUs)``."""
        plural = "s" if self.threads != 1 else ""
        if self.reason == "starved" and self.starvation is not None:
            check = self.starvation
            return (
                f"{self.threads} thread{plural}: {check.model} ran "
                f"{check.one_thread_rate / check.rate:.1f}x faster at 1 thread than at "
                f"{check.threads} (starved by other work), so everything was timed again at 1"
            )
        if self.reason == "load":
            return (
                f"{self.threads} thread{plural} of {self.asked} (load {self.load:.1f} on "
                f"{self.cpus} CPUs: more would oversubscribe the free cores)"
            )
        text = f"{self.threads} thread{plural}"
        if self.reason == "fixed":
            return text + " (set by the caller)"
        if self.starvation is not None:
            return text + " (the starvation check passed)"
        return text


def choose_threads(asked: int, cpus: int, load: float | None, own: float = 0.0) -> ThreadChoice:
    """At most ``asked`` threads, and no more than the cores other work leaves free.

    Other work is the load average less this process's own share (``own``); the free cores are
    ``cpus`` less that, rounded to the nearest whole core (a core half used by others is not worth
    a thread that would stall the rest at every barrier; more than half free is), and at least 1.
    """
    asked = max(1, asked)
    if load is None:
        return ThreadChoice(asked, cpus, None, own, asked, "no-load")
    others = max(0.0, load - own)
    free = max(1, math.floor(cpus - others + 0.5))
    threads = min(asked, free)
    return ThreadChoice(asked, cpus, load, own, threads, "fits" if threads == asked else "load")
