"""``apply``: compress a loaded model, measure base and compressed side by side, save; and
:func:`apply_model`, the whole ``vitcompress apply`` command as one typed report."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from vitcompress.analysis.window_map import WholeAttention
from vitcompress.artifacts.artifact import (
    ArtifactError,
    check_replaceable,
    describe_source,
    save_artifact,
)
from vitcompress.artifacts.base import load_artifact_base
from vitcompress.compilation.metadata import CompressionInfo, compression_info
from vitcompress.loading import LoadedModel, ModelLoadError
from vitcompress.measure import PairedRatio
from vitcompress.measure.keep_fit import compress_planned
from vitcompress.measure.models import (
    Measurement,
    TimingOptions,
    block_tokens,
    measure_models,
    speedup,
)
from vitcompress.measure.residual_scale import near_zero_residuals
from vitcompress.modules.restore import TokenRestore
from vitcompress.status import step, warn
from vitcompress.variants import BEFORE_BLOCK
from vitcompress.workflows.batch_sweep import slower_than_base
from vitcompress.workflows.gates import NO_THROUGHPUT, Bounds, GateResult, check_gates, require
from vitcompress.workflows.identity import artifact_identity, model_identity, unsaved_identity
from vitcompress.workflows.inputs import ModelRequest, PlanRequest
from vitcompress.workflows.serving import cuda_graphs_counted

log = logging.getLogger(__name__)


@dataclass
class ApplyResult:
    base: Measurement
    compressed: Measurement
    tokens_per_block: list[int]
    base_tokens_per_block: list[int]
    # What each block hands on (None where the graph no longer names its output).
    tokens_leaving_block: list[int | None]
    # Each block's stage: tokens are restored between stages (a pyramid's, or blocks that read
    # positions anew).
    stage_per_block: list[int]
    plan: dict[str, Any]
    environment: dict[str, Any]
    out: Path | None
    # Where the compressed model brings the full token set back, and by which rule.
    restored: list[dict[str, str]] = field(default_factory=list)
    # Windowed blocks: the windows per image and the tokens kept of each window's.
    window_tokens: list[dict[str, int]] = field(default_factory=list)
    # How --keep-for-gmacs-ratio found the keep (KeepFit.to_json), when it was given.
    keep_fit: dict[str, Any] | None = None

    @property
    def speedup(self) -> float | None:
        if self.base.throughput and self.compressed.throughput:
            return self.compressed.throughput / self.base.throughput
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base.to_json(),
            "compressed": self.compressed.to_json(),
            "speedup": self.speedup,
            "macs_ratio": self.compressed.macs / self.base.macs,
            "tokens_per_block": self.tokens_per_block,
            "base_tokens_per_block": self.base_tokens_per_block,
            "tokens_leaving_block": self.tokens_leaving_block,
            "stage_per_block": self.stage_per_block,
            "plan": self.plan,
            "environment": self.environment,
            "out": str(self.out) if self.out is not None else None,
            "restored": self.restored,
            "window_tokens": self.window_tokens,
            "keep_fit": self.keep_fit,
        }


def apply(
    loaded: LoadedModel,
    variant: str,
    keep: float | list[float] | None,
    locs: list[int] | None = None,
    policy: str = "score",
    out: str | Path | None = None,
    timing: TimingOptions | None = None,
) -> ApplyResult:
    loaded = base_to_compress(loaded)
    result, model = _compress_and_measure(loaded, variant, keep, locs, policy, timing)
    if out is not None:
        result.out = save_artifact(model, out, source=loaded.source, input_size=loaded.input_size)
    return result


def _compress_and_measure(
    loaded: LoadedModel,
    variant: str,
    keep: Any,
    locs: list[int] | None,
    policy: str,
    timing: TimingOptions | None,
) -> tuple[ApplyResult, nn.Module]:
    compressed = compress_planned(loaded, variant, keep, locs, policy)
    model = compressed.model.eval()
    with cuda_graphs_counted(timing) as cuda_graphs:
        measured, environment = measure_models(
            {"base": loaded.model.eval(), "compressed": model}, loaded.input_size, timing
        )
    environment.update(cuda_graphs)
    info = compression_info(model)
    assert info is not None  # the compression attached it
    _warn_if_no_cheaper(measured["base"].macs, measured["compressed"].macs)
    # A base whose residual branches are scaled near zero (LayerScale at its init) gives the same
    # outputs as any compressed model of it: said, so a cosine of 1 is not read as a result.
    if (near_zero := near_zero_residuals(loaded.model)) is not None:
        warn(near_zero.text())
    entering, leaving = block_tokens(model, loaded.input_size)
    result = ApplyResult(
        base=measured["base"],
        compressed=measured["compressed"],
        tokens_per_block=entering,
        tokens_leaving_block=leaving,
        stage_per_block=[b.stage for b in info.model_map.blocks],
        base_tokens_per_block=[b.tokens for b in info.model_map.blocks],
        plan=info.plan.to_json(),
        environment=environment,
        out=None,
        restored=restore_points(model),
        keep_fit=getattr(model, "vitcompress_keep_fit", None),
        window_tokens=[
            {
                "block": loc.block,
                "windows": loc.windows,
                "tokens": loc.patch_tokens,
                "kept": info.plan.method.tokens_after(loc.patch_tokens, loc),
                # the blocks after it that reduce by its choice (carry_windows)
                **({"carried": list(loc.carried)} if loc.carried else {}),
                # why a predictor runs this block's attention whole (it chooses on the MLP's
                # input there instead): padded windows, a table that cannot follow the tokens
                **(
                    {"attention_whole": blocker}
                    if (blocker := _attention_whole(info, loc.block)) is not None
                    else {}
                ),
                # the per-token branches after them that do too (DaViT's channel MLPs)
                **(
                    {"carried_branches": list(loc.carried_branches)} if loc.carried_branches else {}
                ),
            }
            for loc in info.plan.locations
            if loc.windows
        ],
    )
    return result, model


def _warn_if_no_cheaper(base_macs: float, compressed_macs: float) -> None:
    """A plan can cost more than it saves: where only part of a block is reduced (a window's
    MLP) and the reducer's own work (a predictor, matching pruned tokens to hosts over a large
    window) outweighs it. The report shows the ratio; this says what it means."""
    if compressed_macs < base_macs:
        return
    log.warning(
        "the compressed model needs %.3f of the base's GMACs: what its reducers cost (a "
        "predictor, matching pruned tokens to their hosts) is more than the tokens they remove "
        "save; try fewer locations (--locs), a lower keep or --keep-for-gmacs-ratio",
        compressed_macs / base_macs,
    )


def _attention_whole(info: CompressionInfo, block: int) -> str | None:
    """Why a method that reduces a window's tokens before its attention (a predictor) runs
    block ``block``'s attention on every token, or ``None``."""
    windows = info.model_map.blocks[block].windows
    if info.plan.method.placement != BEFORE_BLOCK or windows is None:
        return None
    attention = windows.attention
    return attention.reason if isinstance(attention, WholeAttention) else None


def restore_points(model: nn.Module) -> list[dict[str, str]]:
    """Where a compressed model restores the full token set (its restore modules), in graph
    order: what reads the tokens there, and the rule."""
    return [
        {"for": module.where, "rule": module.rule}
        for module in model.modules()
        if isinstance(module, TokenRestore)
    ]


@dataclass
class ApplyReport:
    """What ``vitcompress apply`` reports: the measurements, the paired speed-up, which models
    they describe, the gates, and why saving failed if it did (the report is shown anyway)."""

    spec: str
    input_size: tuple[int, ...]
    result: ApplyResult
    paired: PairedRatio | None
    base_identity: dict[str, Any]
    compressed_identity: dict[str, Any] | None
    gates: list[GateResult]
    save_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = self.result.to_json()
        data["input_size"] = list(self.input_size)
        # The speed-up is the median of the round-by-round ratios (both models timed
        # interleaved), with its 95% interval; the ratio of the two medians is kept for reference.
        paired = self.paired
        data["speedup_ratio_of_medians"] = data["speedup"]
        data["speedup"] = None if paired is None else paired.median
        data["speedup_ci95"] = (
            None if paired is None or paired.interval is None else list(paired.interval)
        )
        data["speedup_pairs"] = 0 if paired is None else paired.pairs
        data["base"]["identity"] = self.base_identity
        data["compressed"]["identity"] = self.compressed_identity
        data["gates"] = [g.to_json() for g in self.gates]
        return data


def apply_model(
    request: ModelRequest,
    plan: PlanRequest,
    out: str | None,
    timing: TimingOptions | None,
    bounds: Bounds,
) -> ApplyReport:
    """``vitcompress apply``: load, compress (an artifact's recorded base, again), measure both,
    save, and check the gates. A failed save is reported in ``save_error``, not raised, so that
    the measurements are not lost with it."""
    unavailable = {
        "max_acc_drop": "apply measures no accuracy; gate the saved model with eval --base"
    }
    if timing is None:
        unavailable["min_speedup"] = NO_THROUGHPUT
    require(bounds, unavailable)
    if out is not None:  # before any work: a folder it would lose files of is refused
        check_replaceable(out)
    with step(f"loading {request.spec}"):
        loaded = request.load()
        # An artifact's recorded base is what gets compressed and measured as the base.
        base = base_to_compress(loaded)
    with step(f"compressing {request.spec} with {plan.variant_name}"):
        result, model = _compress_and_measure(
            base, plan.variant, plan.keep, plan.locs, plan.policy, timing
        )
    save_error = None
    if out is not None:
        try:
            result.out = save_artifact(model, out, source=base.source, input_size=base.input_size)
        except (ArtifactError, OSError) as e:
            save_error = str(e) if isinstance(e, ArtifactError) else f"{out}: {e.strerror or e}"
    paired = speedup(result.compressed, result.base)
    slower = slower_than_base(timing.device, timing.batch_size, paired) if timing else None
    if slower is not None:
        warn(slower)
        result.environment.setdefault("warnings", []).append(slower)
    base_identity = model_identity(base, request.spec if base is loaded else base.source.spec)
    report = ApplyReport(
        spec=request.spec,
        input_size=base.input_size,
        result=result,
        paired=paired,
        base_identity=base_identity,
        compressed_identity=(
            artifact_identity(result.out, base.input_size)
            if result.out is not None
            else unsaved_identity(base_identity, result.plan)
        ),
        gates=[],
        save_error=save_error,
    )
    report.gates = check_gates(
        bounds,
        {"speedup": report.to_json()["speedup"], "gmacs": result.compressed.macs / 1e9},
        intervals={"speedup": paired.interval if paired else None},
    )
    return report


def base_to_compress(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` itself, or for a compressed artifact the base it records, rebuilt with its base
    weights: a plan applies to an uncompressed model, and compressing the artifact's base again
    is what asking to compress the artifact with a new plan means. Said on stderr."""
    info = compression_info(loaded.model)
    if info is None:
        return loaded
    artifact = info.artifact
    if artifact is None:
        raise ModelLoadError("the model is already compressed; pass its base model instead")
    try:
        base = load_artifact_base(artifact, loaded.input_size)
    except ArtifactError as e:
        raise ArtifactError(
            f"{e}; to compress it with a new plan, pass its base model instead "
            "(--model SPEC with --checkpoint FILE or --pretrained)"
        ) from e
    weights = base.source.checkpoint or (
        "timm pretrained weights" if base.source.pretrained else "no weights"
    )
    log.warning(
        "%s is a compressed model: compressing its base %s (%s) again with the new plan",
        artifact,
        describe_source(base.source),
        weights,
    )
    return base
