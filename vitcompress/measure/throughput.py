"""Inference throughput (images/s), measured so that models can be compared fairly.

Speed-ups of a pruned model over its base are only meaningful when both were timed under the same
conditions. So all models of one call are timed in one process on one fixed input batch, and the
timed runs are interleaved round-robin (one batch of each model per round): a burst of machine
noise (thermal throttling, a background job) then hits every model alike instead of whichever
happened to be timed at that moment. Each model reports the median of its runs, which ignores the
odd outlier, plus all samples so the spread can be judged; :meth:`ThroughputReport.paired` turns
two models' samples into a speed-up with a 95% interval (:mod:`.paired`).

Two things make a number untrustworthy, and both are reported in ``ThroughputReport.warnings``
rather than hidden: other work on the machine (the 1-minute load average above the threads torch
uses, read before and after timing), and a time budget that ended the timing before all runs.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .macs import _same_device
from .paired import PairedRatio, paired_ratio

__all__ = [
    "ModelThroughput",
    "RoundProgress",
    "ThroughputReport",
    "environment",
    "load_average",
    "load_warning",
    "measure_throughput",
]


@dataclass
class ModelThroughput:
    """Timing of one model: images/s per timed batch, in the order they were taken."""

    samples: list[float]
    median: float = field(init=False)
    min: float = field(init=False)
    max: float = field(init=False)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a throughput result needs at least one sample")
        self.median = statistics.median(self.samples)
        self.min = min(self.samples)
        self.max = max(self.samples)


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


def load_average() -> float | None:
    """The 1-minute load average, or None where the system has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


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


def _synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously; without a sync the clock would measure only the launches.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model on ``device``/``dtype``, copying it only when a conversion is needed.

    ``Module.to`` works in place, and a measurement should not move or cast the caller's model.
    """
    tensors = [*model.parameters(), *model.buffers()]
    needs_move = any(not _same_device(t.device, device) for t in tensors)
    needs_cast = any(t.is_floating_point() and t.dtype != dtype for t in tensors)
    if needs_move or needs_cast:
        model = copy.deepcopy(model).to(device=device, dtype=dtype)
    return model


def measure_throughput(
    models: Mapping[str, nn.Module],
    input_size: tuple[int, int, int],
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    warmup: int = 3,
    runs: int = 10,
    compile: bool = False,
    amp: bool = False,
    time_budget: float | None = None,
    on_round: Callable[[RoundProgress], None] | None = None,
) -> ThroughputReport:
    """Images/s of each model in inference mode, timed interleaved in this process.

    ``input_size`` is ``(channels, height, width)``. Without ``amp`` the models run in ``dtype``
    (a copy is made if a model is not already on ``device`` in ``dtype``); with ``amp`` they stay
    in float32 under ``torch.autocast(dtype=dtype)``, which is only offered on CUDA. ``compile``
    wraps each model with ``torch.compile``; compilation happens during warm-up, so at least one
    warm-up batch is required then. Training flags are restored afterwards.

    ``time_budget`` (seconds) bounds warm-up and timing together: no round starts once it is
    spent, but one warm-up round (when ``warmup`` > 0) and one timed round always run, so a round
    may overshoot it. ``on_round`` is called after every round, for progress displays.
    """
    if not models:
        raise ValueError("no models to time")
    if len(input_size) != 3:
        raise ValueError(f"input_size must be (channels, height, width), got {tuple(input_size)}")
    if batch_size < 1 or runs < 1 or warmup < 0:
        raise ValueError("batch_size and runs must be >= 1 and warmup >= 0")
    if compile and warmup < 1:
        raise ValueError("compile=True needs warmup >= 1, or compilation time would be timed")
    if time_budget is not None and time_budget <= 0:
        raise ValueError(f"time_budget must be > 0 seconds, got {time_budget}")
    device = torch.device(device)
    if amp:
        if device.type != "cuda":
            raise ValueError(f"amp=True is only supported on CUDA, not on {device.type}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"amp=True needs dtype float16 or bfloat16, got {dtype}")

    # Under autocast weights and input stay float32 and the autocast casts per op.
    run_dtype = torch.float32 if amp else dtype
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((batch_size, *input_size), generator=generator).to(device, run_dtype)

    flags = {name: [(m, m.training) for m in model.modules()] for name, model in models.items()}
    runnable: dict[str, nn.Module] = {}
    for name, model in models.items():
        prepared = _prepare(model, device, run_dtype).eval()
        runnable[name] = torch.compile(prepared) if compile else prepared  # type: ignore[assignment]

    def forward(model: nn.Module) -> None:
        if amp:
            with torch.autocast(device_type=device.type, dtype=dtype):
                model(x)
        else:
            model(x)

    samples: dict[str, list[float]] = {name: [] for name in runnable}
    loads = [load_average()]
    began = time.perf_counter()

    def spent() -> bool:
        return time_budget is not None and time.perf_counter() - began >= time_budget

    def report_round(warm: bool, done: int, total: int) -> None:
        if on_round is not None:
            on_round(
                RoundProgress(
                    warmup=warm,
                    done=done,
                    total=total,
                    elapsed=time.perf_counter() - began,
                    budget=time_budget,
                )
            )

    warmed = timed = 0
    try:
        with torch.inference_mode():
            # Warm-up round-robin as well, so every model leaves warm-up with the same caches and
            # allocator state, and one-off costs (compilation, cuDNN autotuning) stay out.
            while warmed < warmup and not (warmed and spent()):
                for model in runnable.values():
                    forward(model)
                warmed += 1
                report_round(True, warmed, warmup)
            _synchronize(device)
            while timed < runs and not (timed and spent()):
                for name, model in runnable.items():
                    _synchronize(device)
                    start = time.perf_counter()
                    forward(model)
                    _synchronize(device)
                    samples[name].append(batch_size / (time.perf_counter() - start))
                timed += 1
                report_round(False, timed, runs)
    finally:
        # eval() above changed the caller's models whenever no copy was needed.
        for name, model in models.items():
            model.train(flags[name][0][1])
            for module, training in flags[name]:
                module.training = training

    loads.append(load_average())
    threads = torch.get_num_threads()
    warnings = [w for w in (load_warning(loads, threads),) if w]
    if timed < runs or warmed < warmup:
        warnings.append(
            f"timing stopped at the {time_budget:g} s budget after {warmed} of "
            f"{warmup} warm-up and {timed} of {runs} timed rounds; raise the budget "
            "(--bench-seconds) for a tighter interval"
        )
    return ThroughputReport(
        results={name: ModelThroughput(samples=values) for name, values in samples.items()},
        environment=environment(device, dtype, batch_size)
        | {
            "input_size": list(input_size),
            "warmup": warmed,
            "runs": timed,
            "warmup_requested": warmup,
            "runs_requested": runs,
            "time_budget_s": time_budget,
            "seconds": time.perf_counter() - began,
            "loadavg_1min": loads,
            "compile": compile,
            "amp": amp,
        },
        warnings=warnings,
    )
