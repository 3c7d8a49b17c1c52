"""Exported speed: ONNX files timed in onnxruntime against the same models in eager PyTorch.

Deployers run the exported file, not PyTorch. Whether a compressed model keeps its speed-up there
is a question about the gather/scatter graph in another runtime, so every model is timed in both
runtimes, and all runners are interleaved round-robin in one process (one batch of each per
round), as :func:`vitcompress.measure.measure_throughput` does: the speed-ups are medians of
paired per-round ratios with their 95% intervals, for each runtime, side by side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitcompress.artifacts.fingerprint import eval_mode
from vitcompress.measure import RoundProgress, ThroughputReport, measure_callables, paired_ratio
from vitcompress.measure.models import show_round
from vitcompress.measure.onnx_runtime import onnx_runner, onnxruntime_version
from vitcompress.measure.throughput import thread_choice
from vitcompress.status import warn

RUNTIMES = ("pytorch", "onnxruntime")

__all__ = ["RUNTIMES", "bench_exported", "runner_name"]


def runner_name(runtime: str, model: str) -> str:
    return f"{runtime}:{model}"


def _check_names(
    models: Mapping[str, nn.Module],
    onnx_files: Mapping[str, str | Path],
    reference: str,
    also_paired: Sequence[tuple[str, str]],
) -> None:
    if not set(models) <= set(onnx_files):
        raise ValueError(f"models {sorted(models)} and ONNX files {sorted(onnx_files)} differ")
    if reference not in onnx_files or (models and reference not in models):
        raise ValueError(f"the reference {reference!r} is not among the models {sorted(models)}")
    for pair in also_paired:
        if not set(pair) <= set(onnx_files):
            raise ValueError(f"the pair {pair} names a file not among {sorted(onnx_files)}")


def _runners(
    models: Mapping[str, nn.Module],
    onnx_files: Mapping[str, str | Path],
    batch: torch.Tensor,
    threads: int,
) -> dict[str, Callable[[], Any]]:
    """One runner per file in onnxruntime and per model in PyTorch, by :func:`runner_name`."""
    runners: dict[str, Callable[[], Any]] = {}
    for name, path in onnx_files.items():
        if name in models:

            def eager(model: nn.Module = models[name]) -> None:
                with torch.inference_mode():
                    model(batch)

            runners[runner_name("pytorch", name)] = eager
        runners[runner_name("onnxruntime", name)] = onnx_runner(path, batch, threads)
    return runners


@dataclass(frozen=True)
class ExportTiming:
    """``export --bench``: warm-up rounds, timed rounds at most, and the time budget."""

    warmup: int = 3
    runs: int = 10
    seconds: float = 60.0


def bench_timed(
    models: Mapping[str, nn.Module],
    onnx_files: Mapping[str, str | Path],
    input_size: tuple[int, ...],
    reference: str,
    batch_size: int,
    timing: ExportTiming,
    also_paired: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """:func:`bench_exported` as ``export --bench`` runs it: ``timing``'s rounds, each round
    shown as it ends, each warning of the measurement said."""
    timed = bench_exported(
        models,
        onnx_files,
        input_size,
        reference,
        batch_size,
        timing.warmup,
        timing.runs,
        timing.seconds,
        on_round=show_round,
        also_paired=also_paired,
    )
    for text in timed["warnings"]:
        warn(text)
    return timed


def bench_exported(
    models: Mapping[str, nn.Module],
    onnx_files: Mapping[str, str | Path],
    input_size: tuple[int, ...],
    reference: str,
    batch_size: int = 32,
    warmup: int = 3,
    runs: int = 10,
    seconds: float | None = None,
    on_round: Callable[[RoundProgress], None] | None = None,
    also_paired: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Images/s of each model eager (``torch.inference_mode``, float32, CPU) and of each ONNX
    file in onnxruntime (CPU), all interleaved, and every model's speed-up over ``reference`` in
    each runtime; plus each model's onnxruntime/PyTorch ratio. Plain data, ready for
    ``json.dump``.

    ``onnx_files`` names every file; ``models`` the PyTorch models timed alongside, each under
    its file's name (none: onnxruntime alone, e.g. int8 files, which have no PyTorch twin). Each
    file must take a batch of ``batch_size`` (exported at that batch, or with a dynamic batch).
    ``also_paired``: further ``(a, b)`` pairs of files whose onnxruntime ratio a/b is reported
    in ``paired`` under ``"a/b"`` (the int8 compressed model over the int8 base).
    """
    _check_names(models, onnx_files, reference, also_paired)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn((batch_size, *input_size), generator=generator)
    # Chosen before the sessions are made, which fixes their threads: both runtimes get the same
    # count, no more than the free cores.
    threads = thread_choice()
    runners = _runners(models, onnx_files, batch, threads.threads)
    with contextlib.ExitStack() as modes:
        for model in models.values():
            modes.enter_context(eval_mode(model))  # each submodule's own mode back afterwards
        report = measure_callables(
            runners,
            batch_size,
            warmup=warmup,
            runs=runs,
            time_budget=seconds,
            on_round=on_round,
            extra_environment={
                "input_size": list(input_size),
                "onnxruntime": onnxruntime_version(),
                "onnx_files": {name: str(path) for name, path in onnx_files.items()},
            },
            threads=threads,
        )

    return _summary(report, models, onnx_files, reference, batch_size, also_paired)


def _summary(
    report: ThroughputReport,
    models: Mapping[str, nn.Module],
    onnx_files: Mapping[str, str | Path],
    reference: str,
    batch_size: int,
    also_paired: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """``bench_exported``'s result from the timing report."""
    runtimes = RUNTIMES if models else ("onnxruntime",)

    def paired(a: str, b: str) -> dict[str, Any]:
        return paired_ratio(report.results[a].samples, report.results[b].samples).to_json()

    def timed(runtime: str) -> list[str]:
        return list(onnx_files if runtime == "onnxruntime" else models)

    return {
        "reference": reference,
        "batch_size": batch_size,
        "throughput": {
            runtime: {
                name: report.results[runner_name(runtime, name)].median for name in timed(runtime)
            }
            for runtime in runtimes
        },
        "speedup": {
            runtime: {
                name: paired(runner_name(runtime, name), runner_name(runtime, reference))
                for name in timed(runtime)
                if name != reference
            }
            for runtime in runtimes
        },
        "paired": {
            f"{a}/{b}": paired(runner_name("onnxruntime", a), runner_name("onnxruntime", b))
            for a, b in also_paired
        },
        "onnxruntime_vs_pytorch": {
            name: paired(runner_name("onnxruntime", name), runner_name("pytorch", name))
            for name in models
        },
        "samples": {name: result.samples for name, result in report.results.items()},
        "environment": report.environment,
        "warnings": report.warnings,
    }
