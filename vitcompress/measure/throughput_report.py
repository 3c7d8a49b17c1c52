"""What a throughput measurement returns: each model's samples, the report of one call and the
environment its numbers depend on.

A model's images/s is the **median** of its timed rounds (:class:`ModelThroughput`), and the ratio
of two models that is printed beside those rates is the ratio of the same medians
(:meth:`ThroughputReport.ratio`), so the rates and the ratio never contradict each other. The
paired per-round ratio (:meth:`ThroughputReport.paired`, :mod:`.paired`) is a second, separately
named statistic: it cancels a slow spell of the machine and carries the 95% interval.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .paired import PairedRatio, paired_ratio

__all__ = ["ModelThroughput", "RoundProgress", "ThroughputReport", "environment"]


@dataclass
class ModelThroughput:
    """Timing of one model: images/s per timed batch, in the order they were taken. On a GPU
    also ``host_shares``: for each batch, the share of its time the host took to return from the
    forward (to issue its kernels) before the closing synchronisation; ``host_share`` is their
    median (``None`` on the CPU, where the forward returns when the work is done)."""

    samples: list[float]
    host_shares: list[float] = field(default_factory=list)
    median: float = field(init=False)
    min: float = field(init=False)
    max: float = field(init=False)
    host_share: float | None = field(init=False)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a throughput result needs at least one sample")
        self.median = statistics.median(self.samples)
        self.min = min(self.samples)
        self.max = max(self.samples)
        self.host_share = statistics.median(self.host_shares) if self.host_shares else None


@dataclass
class ThroughputReport:
    """Per-model results of one ``measure_throughput`` call and the environment they came from."""

    results: dict[str, ModelThroughput]
    environment: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    def ratio(self, a: str, b: str) -> float:
        """Median throughput of ``a`` over that of ``b`` (the speed-up of ``a`` when > 1)."""
        return self.results[a].median / self.results[b].median

    def paired(self, a: str, b: str) -> PairedRatio:
        """``a``'s throughput over ``b``'s, round by round: median and 95% interval."""
        return paired_ratio(self.results[a].samples, self.results[b].samples)

    def to_json(self) -> dict[str, Any]:
        """Plain dicts, lists, numbers and strings, ready for ``json.dump``."""
        return {
            "results": {name: asdict(result) for name, result in self.results.items()},
            "environment": dict(self.environment),
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class RoundProgress:
    """Where timing stands after a round: for a progress display."""

    warmup: bool  # a warm-up round (not timed)
    done: int  # rounds of this kind done
    total: int  # rounds of this kind asked for
    elapsed: float  # seconds since timing began
    budget: float | None  # the time budget in seconds, if any


def _cpu_name() -> str:
    # platform.processor() is empty or just "x86_64" on most Linux systems; cpuinfo has the model.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return _cpu_name()
    return device.type


def environment(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """What a throughput number depends on, as plain data to store next to it."""
    device = torch.device(device)
    env: dict[str, Any] = {
        "device": str(device),
        "device_name": _device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,  # CUDA torch was built against, None for CPU builds
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if batch_size is not None:
        env["batch_size"] = batch_size
    return env
