"""Measure one model, or a base and a compressed model side by side in one process."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vitcompress.analysis.capture import annotate_shapes
from vitcompress.analysis.ops import nodes_by_name
from vitcompress.api import load_model
from vitcompress.artifacts.artifact import ArtifactError, base_source, read_meta
from vitcompress.artifacts.base import load_artifact_base
from vitcompress.compilation.entries import entry_of
from vitcompress.compilation.metadata import compression_info
from vitcompress.kernels import enable_fused_kernels
from vitcompress.loading import LoadedModel
from vitcompress.measure import (
    PairedRatio,
    RoundProgress,
    ThroughputReport,
    count_macs,
    count_params,
    measure_throughput,
    paired_ratio,
)
from vitcompress.status import detail, step, warn

# Default bound on the throughput step (warm-up and timed rounds together), in seconds.
DEFAULT_BENCH_SECONDS = 60.0


@dataclass
class TimingOptions:
    batch_size: int = 32
    device: str = "cpu"
    dtype: str = "float32"
    warmup: int = 3
    runs: int = 10
    compile: bool = False
    amp: bool = False
    seconds: float | None = DEFAULT_BENCH_SECONDS  # time budget of the throughput step
    compile_mode: str | None = None  # torch.compile's mode; None: torch's default
    fused_kernels: bool = False  # the reducers' select -> gather -> squeeze as one C++ op (CPU)
    cuda_graphs: bool = False  # every model replayed from CUDA graphs (CUDA; not with compile)
    # The timing-only options the user gave (flags), for a command that times only sometimes
    # (search, with --min-speedup) to refuse them where it times nothing.
    given: tuple[str, ...] = field(default=(), compare=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.dtype
        ]

    def compile_options(self) -> dict[str, Any]:
        """``torch.compile`` keyword arguments, the same for every model timed."""
        return {"mode": self.compile_mode} if self.compile_mode else {}

    def throughput_arguments(self, **compile_extra: Any) -> dict[str, Any]:
        """``measure_throughput``'s keyword arguments these options set (``compile_extra``: more
        ``torch.compile`` options, used only when compiling)."""
        return dict(
            batch_size=self.batch_size,
            device=self.device,
            dtype=self.torch_dtype,
            warmup=self.warmup,
            runs=self.runs,
            compile=self.compile,
            compile_options=self.compile_options() | compile_extra if self.compile else None,
            amp=self.amp,
            time_budget=self.seconds,
            cuda_graphs=self.cuda_graphs,
        )

    def measure(
        self, models: dict[str, nn.Module], input_size: tuple[int, ...], **compile_extra: Any
    ) -> ThroughputReport:
        """``models`` timed interleaved under these options, each round shown as progress."""
        return measure_throughput(
            models, input_size, **self.throughput_arguments(**compile_extra), on_round=show_round
        )


@dataclass
class Measurement:
    params: int
    macs: int
    throughput: float | None = None
    samples: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "macs": self.macs,
            "gmacs": self.macs / 1e9,
            "throughput": self.throughput,
        }


def measure_models(
    models: dict[str, nn.Module], input_size: tuple[int, ...], timing: TimingOptions | None
) -> tuple[dict[str, Measurement], dict[str, Any]]:
    """Params and MACs of each model; throughput of all of them interleaved in this process.

    The environment records what the timing depended on, and its ``warnings`` (a busy machine, a
    budget that cut the timing short), which are also passed to :func:`status.warn`.
    """
    results = {}
    for name, model in models.items():
        with step(f"counting MACs of {name}"):
            # Counted where each model is (evaluation may have moved it to the GPU already).
            results[name] = Measurement(
                count_params(model), count_macs(model, input_size, _device_of(model))
            )
    environment: dict[str, Any] = {}
    fused = use_fused_kernels(models, timing)
    if timing is not None:
        with step(
            f"timing {' and '.join(models)} (batch {timing.batch_size}, at most "
            + (f"{timing.seconds:g} s)" if timing.seconds else "no time limit)")
        ):
            report = timing.measure(models, input_size)
        for name in models:
            results[name].throughput = report.results[name].median
            results[name].samples = list(report.results[name].samples)
        environment = report.to_json()["environment"] | {"warnings": list(report.warnings)}
        if fused is not None:
            environment["fused_kernel_reducers"] = fused
        for text in report.warnings:
            warn(text)
    return results, environment


def use_fused_kernels(
    models: dict[str, nn.Module], timing: TimingOptions | None
) -> dict[str, int] | None:
    """With ``timing.fused_kernels``: switch every model's reducers to the fused kernel (built
    first) and return how many each has; otherwise None."""
    if timing is None or not timing.fused_kernels:
        return None
    with step("building the fused kernels"):
        fused = {name: enable_fused_kernels(model) for name, model in models.items()}
    if not any(fused.values()):
        warn("--fused-kernels: no model timed has a dtps, dynamicvit or etps reducer")
    return fused


def show_round(progress: RoundProgress) -> None:
    """A timing round as a progress detail (``warm-up round 2/3, 41 s of budget left``)."""
    kind = "warm-up" if progress.warmup else "timed"
    left = (
        ""
        if progress.budget is None
        else f", {max(0.0, progress.budget - progress.elapsed):.0f} s of budget left"
    )
    detail(f"{kind} round {progress.done}/{progress.total}{left}")


def speedup(model: Measurement, base: Measurement) -> PairedRatio | None:
    """``model``'s throughput over ``base``'s, paired round by round (both timed in one
    ``measure_models`` call), or None when they were not timed."""
    if not model.samples or not base.samples or len(model.samples) != len(base.samples):
        return None
    return paired_ratio(model.samples, base.samples)


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def tokens_per_block(model: nn.Module, input_size: tuple[int, ...]) -> list[int]:
    """Tokens entering each block of a compressed model, read off a run in eval mode."""
    entering, _ = block_tokens(model, input_size)
    return entering


def block_tokens(
    model: nn.Module, input_size: tuple[int, ...]
) -> tuple[list[int], list[int | None]]:
    """``(entering, leaving)``: the tokens each block of a compressed model takes in and hands
    on, read off one run in eval mode. ``leaving`` is None for a block whose output the graph
    no longer names (a windowed block's, rewritten) or a model compressed before it was
    recorded."""
    block_nodes = getattr(model, "vitcompress_block_nodes", None)
    if block_nodes is None:
        raise ValueError("not a compressed model")
    output_nodes = getattr(model, "vitcompress_block_output_nodes", None) or [None] * len(
        block_nodes
    )
    was_training = model.training
    model.eval()
    try:
        annotate_shapes(model, torch.zeros(1, *input_size))
    finally:
        model.train(was_training)
    nodes = nodes_by_name(model.graph)

    def tokens(name: str | None) -> int | None:
        node = nodes.get(name) if name is not None else None
        shape = node.meta.get("shape") if node is not None else None
        # Tokens of any layout, channels last: a windowed block takes the (B, H, W, C) grid.
        if not (
            isinstance(shape, tuple) and len(shape) >= 3 and all(isinstance(d, int) for d in shape)
        ):
            return None
        return math.prod(shape[1:-1])

    entering = [tokens(name) for name in block_nodes]
    if any(count is None for count in entering):
        raise ValueError("a block's attention is not in the compressed graph")
    return entering, [tokens(name) for name in output_nodes]  # type: ignore[return-value]


def base_for_timing(loaded: LoadedModel) -> LoadedModel | None:
    """For a compressed model directory, the base it records (with its base weights), else None.

    Throughput does not depend on the weights, so where the base's weights cannot be had (the
    artifact was made from random weights, or the checkpoint moved) its architecture is built
    with random ones, and a warning says so; accuracy comparisons must not use this.
    """
    info = compression_info(loaded.model)
    if info is None or info.artifact is None:
        return None
    try:
        return load_artifact_base(info.artifact, loaded.input_size)
    except ArtifactError as e:
        source = base_source(read_meta(info.artifact))
        warn(f"{e}; timing the base's architecture with random weights (speed is the same)")
        return load_model(
            source.spec,
            source.model_args,
            input_size=loaded.input_size,
            entry=entry_of(loaded.model),  # the method the artifact compressed
        )
