"""``bench --batch-sizes``: base and compressed throughput at several batch sizes, and the batch
from which compression pays.

Removing tokens saves work in proportion to the batch, while what the reducers add (scoring,
sorting, gathering, and the many small kernels they launch) is partly a fixed cost per batch. So a
compressed model can be slower than its base at small batches and faster at large ones; where the
line is crossed depends on the model, the runtime and the machine. At each batch size both models
are timed interleaved in one :func:`~vitcompress.measure.measure_throughput` call, and the
speed-up is the median of the paired per-round ratios with its 95% interval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import nn

from vitcompress.errors import UserError
from vitcompress.measure import PairedRatio, paired_ratio, verdict
from vitcompress.measure.models import TimingOptions, use_fused_kernels
from vitcompress.status import step, warn

__all__ = [
    "BatchSweep",
    "SweepPoint",
    "parse_batch_sizes",
    "plot_sweep",
    "slower_than_base",
    "sweep_slower_than_base",
    "sweep_batch_sizes",
]

# On a GPU a compressed model can lose to its base outright: at small batches the device is not
# busy with the tokens, and the reducers' scoring, sorting and gathering add kernel launches and
# synchronisation-free but serial steps. The commands say so where it happens.
SLOWER_ADVICE = (
    "the reducers' own kernels cost more than the tokens they remove save there; try larger "
    "batches, or --cuda-graphs (each batch one launch)"
)


def _on_cuda(device: str) -> bool:
    return str(device).split(":", 1)[0] == "cuda"


def slower_than_base(device: str, batch_size: int, speedup: PairedRatio | None) -> str | None:
    """On CUDA, where the compressed model is slower than its base at the batch timed (the
    paired median below 1): one line saying so, with what to try; else None."""
    if not _on_cuda(device) or speedup is None or speedup.median >= 1.0:
        return None
    return (
        f"the compressed model is slower than its base on {device} at batch {batch_size} "
        f"({speedup.median:.2f}x): {SLOWER_ADVICE}; bench DIR --batch-sizes finds the batch "
        "from which it pays"
    )


class BatchSizesError(ValueError, UserError):
    """``--batch-sizes`` that is not a list of positive integers (a user error)."""


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,32,128"`` -> ``[1, 8, 32, 128]``: positive, distinct, sorted ascending."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise BatchSizesError(
            f"--batch-sizes '{text}' is not a comma list of positive integers (e.g. 1,8,32,128)"
        )
    if len(set(sizes)) != len(sizes):
        raise BatchSizesError(f"--batch-sizes '{text}' names a batch size twice")
    return sorted(sizes)


@dataclass
class SweepPoint:
    """One batch size: each model's median images/s, its samples, and the paired speed-up of
    every model over the reference."""

    batch_size: int
    throughput: dict[str, float]
    samples: dict[str, list[float]]
    speedup: dict[str, PairedRatio] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    loadavg_1min: list[float | None] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "throughput": dict(self.throughput),
            "speedup": {name: ratio.to_json() for name, ratio in self.speedup.items()},
            "verdict": {  # as the table says it: too few pairs for an interval decide nothing
                name: "undecided" if ratio.interval is None else verdict(ratio.interval, 1.0)
                for name, ratio in self.speedup.items()
            },
            "samples": {name: list(values) for name, values in self.samples.items()},
            "loadavg_1min": list(self.loadavg_1min),
            "warnings": list(self.warnings),
        }


@dataclass
class BatchSweep:
    """Throughput of every model at each batch size, the reference being the uncompressed base
    (``None`` when a single model was swept)."""

    points: list[SweepPoint]
    reference: str | None
    environment: dict[str, Any]

    def crossover(self, name: str) -> int | None:
        """The smallest swept batch size from which ``name`` is faster than the reference at that
        size and every larger one swept (paired median above 1), or None if it is not faster at
        the largest. A size where it is faster but a larger one slower is no crossover: the
        advantage has not settled there."""
        if self.reference is None:
            return None
        found = None
        for point in reversed(self.points):
            if point.speedup[name].median <= 1.0:
                break
            found = point.batch_size
        return found

    def unconfirmed(self, name: str) -> list[int]:
        """The batch sizes from the crossover on where ``name``'s 95% interval does not lie
        wholly above 1 (or too few pairs gave none): the crossover is read off the medians,
        and there it is not yet shown."""
        crossing = self.crossover(name)
        if crossing is None:
            return []
        return [
            point.batch_size
            for point in self.points
            if point.batch_size >= crossing
            and (
                point.speedup[name].interval is None
                or verdict(point.speedup[name].interval, 1.0) != "yes"
            )
        ]

    def to_json(self) -> dict[str, Any]:
        names = [] if not self.points else list(self.points[0].throughput)
        return {
            "batch_sizes": [point.batch_size for point in self.points],
            "reference": self.reference,
            "points": [point.to_json() for point in self.points],
            "crossover_batch": {
                name: self.crossover(name) for name in names if name != self.reference
            }
            if self.reference is not None
            else None,
            "environment": dict(self.environment),
        }


def sweep_slower_than_base(sweep: BatchSweep, name: str, device: str) -> str | None:
    """On CUDA, where ``name`` is slower than the reference at some batch swept: one line naming
    those batches and the crossover batch (from which it is faster at every larger one swept),
    or that there is none; else None."""
    if not _on_cuda(device) or sweep.reference is None:
        return None
    slower = [point for point in sweep.points if point.speedup[name].median < 1.0]
    if not slower:
        return None
    at = ", ".join(f"{p.batch_size} ({p.speedup[name].median:.2f}x)" for p in slower)
    crossing = sweep.crossover(name)
    pays = (
        f"it is faster from batch {crossing} on (the crossover of those swept)"
        if crossing is not None
        else "it is not faster at the largest batch swept (no crossover)"
    )
    return (
        f"the compressed model is slower than its base on {device} at "
        f"batch{'es' if len(slower) > 1 else ''} {at}: {pays}; " + SLOWER_ADVICE
    )


def sweep_batch_sizes(
    models: dict[str, nn.Module],
    input_size: tuple[int, ...],
    batch_sizes: Sequence[int],
    timing: TimingOptions,
    reference: str | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> BatchSweep:
    """Time ``models`` interleaved at each of ``batch_sizes`` (``timing.seconds`` is the budget
    of each size). Compiled models are compiled with static shapes, once per batch size, so every
    size gets kernels specialised to it alike (dynamo would otherwise switch to a dynamic batch at
    the second size, and the first size would be the only static one)."""
    if reference is not None and reference not in models:
        raise ValueError(f"the reference {reference!r} is not among {sorted(models)}")
    points: list[SweepPoint] = []
    environment: dict[str, Any] = {}
    fused = use_fused_kernels(models, timing)
    for batch_size in batch_sizes:
        options = replace(timing, batch_size=batch_size)
        with step(
            f"timing {' and '.join(models)} at batch {batch_size}"
            + (f" (at most {options.seconds:g} s)" if options.seconds else "")
        ):
            report = options.measure(models, input_size, dynamic=False)
        point = SweepPoint(
            batch_size=batch_size,
            throughput={name: result.median for name, result in report.results.items()},
            samples={name: list(result.samples) for name, result in report.results.items()},
            warnings=list(report.warnings),
            loadavg_1min=list(report.environment["loadavg_1min"]),
        )
        if reference is not None:
            point.speedup = {
                name: paired_ratio(report.results[name].samples, report.results[reference].samples)
                for name in models
                if name != reference
            }
        for text in report.warnings:
            warn(f"batch {batch_size}: {text}")
        environment = {
            key: value
            for key, value in report.environment.items()
            if key not in ("batch_size", "loadavg_1min", "warmup", "runs", "seconds")
        }
        points.append(point)
        if on_point is not None:
            on_point(point)
    environment["batch_sizes"] = list(batch_sizes)
    if fused is not None:
        environment["fused_kernel_reducers"] = fused
    return BatchSweep(points=points, reference=reference, environment=environment)


def plot_sweep(sweep: BatchSweep, path: str | Path, title: str) -> Path:
    """A PNG: images/s of every model against the batch size (log scale), and below it each
    model's speed-up over the reference with its 95% interval, the break-even line and the
    crossover marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; only a file is written
    import matplotlib.pyplot as plt

    path = Path(path)
    sizes = [point.batch_size for point in sweep.points]
    names = list(sweep.points[0].throughput)
    rows = 2 if sweep.reference is not None else 1
    figure, axes = plt.subplots(
        rows, 1, figsize=(6.4, 3.2 * rows + 0.6), sharex=True, squeeze=False
    )
    top = axes[0][0]
    for name in names:
        top.plot(sizes, [point.throughput[name] for point in sweep.points], "o-", label=name)
    top.set_xscale("log", base=2)
    top.set_xticks(sizes, [str(size) for size in sizes])
    top.set_ylabel("images/s")
    top.set_title(title)
    top.grid(True, alpha=0.3)
    top.legend()
    if sweep.reference is not None:
        bottom = axes[1][0]
        for name in names:
            if name == sweep.reference:
                continue
            ratios = [point.speedup[name] for point in sweep.points]
            medians = [ratio.median for ratio in ratios]
            low = [r.median - (r.low if r.low is not None else r.median) for r in ratios]
            high = [(r.high if r.high is not None else r.median) - r.median for r in ratios]
            bottom.errorbar(sizes, medians, yerr=[low, high], fmt="o-", capsize=3, label=name)
            crossing = sweep.crossover(name)
            if crossing is not None:
                bottom.axvline(crossing, linestyle=":", color="gray")
                bottom.annotate(
                    f"pays from batch {crossing}",
                    (crossing, 1.0),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=8,
                )
        bottom.axhline(1.0, color="black", linewidth=0.8)
        bottom.set_ylabel(f"speed-up over {sweep.reference}")
        bottom.grid(True, alpha=0.3)
        bottom.legend()
    axes[-1][0].set_xlabel("batch size")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
