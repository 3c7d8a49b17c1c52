"""``apply``: compress a loaded model, measure base and compressed side by side, save."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitcompress.api import compress_loaded
from vitcompress.artifact import ArtifactError, describe_source, load_artifact_base, save_artifact
from vitcompress.loading import LoadedModel, ModelLoadError
from vitcompress.metadata import compression_info
from vitcompress.workflows.measure_models import (
    Measurement,
    TimingOptions,
    measure_models,
    tokens_per_block,
)

log = logging.getLogger(__name__)


@dataclass
class ApplyResult:
    base: Measurement
    compressed: Measurement
    tokens_per_block: list[int]
    base_tokens_per_block: list[int]
    plan: dict[str, Any]
    environment: dict[str, Any]
    out: Path | None

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
            "plan": self.plan,
            "environment": self.environment,
            "out": str(self.out) if self.out is not None else None,
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
    compressed = compress_loaded(loaded, variant=variant, keep=keep, locs=locs, policy=policy)
    model = compressed.model.eval()
    measured, environment = measure_models(
        {"base": loaded.model.eval(), "compressed": model}, loaded.input_size, timing
    )
    info = compression_info(model)
    assert info is not None  # compress_loaded attached it
    saved = (
        save_artifact(model, out, source=loaded.source, input_size=loaded.input_size)
        if out is not None
        else None
    )
    return ApplyResult(
        base=measured["base"],
        compressed=measured["compressed"],
        tokens_per_block=tokens_per_block(model, loaded.input_size),
        base_tokens_per_block=[b.tokens for b in info.model_map.blocks],
        plan=info.plan.to_json(),
        environment=environment,
        out=saved,
    )


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
