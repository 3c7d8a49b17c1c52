"""The Python API: ``compress``, ``save``, ``load``, and ``load_model`` for any ``--model`` spec.

This module sits above ``vitcompress.loading`` (base models), ``vitcompress.compilation.compression`` and
``vitcompress.artifacts.artifact`` (compressed models on disk), and is the one place that decides which of
them a spec needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from vitcompress import loading
from vitcompress.artifacts.artifact import load_artifact, save_artifact
from vitcompress.artifacts.base import state_trained_config
from vitcompress.compilation.compression import (
    EXAMPLE_BATCH,
    capture_and_map,
    compress,
    compress_loaded,
    compress_mapped,
    example_input,
    map_model,
    resolve_input_size,
)
from vitcompress.compilation.entries import FORWARD, EntryError, entry_of, entry_view
from vitcompress.errors import given_options
from vitcompress.loading import LoadedModel, ModelLoadError, ModelSource, is_artifact_directory
from vitcompress.loading.input_size import check_runs, checked_input_size

__all__ = [
    "EXAMPLE_BATCH",
    "capture_and_map",
    "compress",
    "compress_loaded",
    "compress_mapped",
    "example_input",
    "load",
    "load_model",
    "map_model",
    "resolve_input_size",
    "save",
]


def load_model(
    spec: str,
    model_args: Mapping[str, Any] | None = None,
    checkpoint: str | Path | None = None,
    pretrained: bool = False,
    input_size: Sequence[int] | None = None,
    entry: str = FORWARD,
) -> LoadedModel:
    """The model ``spec`` names, in eval mode: a compressed model directory (an artifact) is
    rebuilt by :func:`vitcompress.artifacts.artifact.load_artifact`, anything else is built by
    :func:`vitcompress.loading.load_base_model`. ``entry`` names a method of a base model to run
    as its forward (``forward_features``): compressing the result compresses that method."""
    if not spec or not is_artifact_directory(spec):
        loaded = loading.load_base_model(spec, model_args, checkpoint, pretrained, input_size)
        # Weights from an artifact expect the preprocessing they were trained with.
        state_trained_config(loaded.model, loaded.source.checkpoint)
        if entry == FORWARD:
            return loaded
        return replace(loaded, model=entry_view(loaded.model, entry))
    size = checked_input_size(input_size)
    # An artifact fixes architecture and weights; silently ignoring these would mislead the user.
    given = given_options(
        (
            ("model arguments", model_args),
            ("--checkpoint", checkpoint),
            ("--pretrained", pretrained),
        )
    )
    if given:
        raise ModelLoadError(
            f"'{spec}' is a compressed model that already fixes its architecture and weights; "
            f"drop {', '.join(given)}"
        )
    loaded = load_artifact(spec)
    if entry not in (FORWARD, entry_of(loaded.model)):
        raise EntryError(
            f"'{spec}' is a compressed model of its base's {entry_of(loaded.model)}; drop "
            f"--entry {entry}, or compress its base with --entry {entry}"
        )
    loaded.model.eval()
    if size is None or size == loaded.input_size:
        return loaded
    # A plan's token counts were made for the artifact's own input size.
    check_runs(loaded.model, size, spec, given=True)
    return replace(loaded, input_size=size)


def save(
    model: nn.Module,
    directory: str | Path,
    source: str | ModelSource | None = None,
    input_size: tuple[int, ...] | None = None,
) -> Path:
    """Write a compressed model as an artifact directory (safetensors weights + JSON plan)."""
    return save_artifact(model, directory, source=source, input_size=input_size)


def load(directory: str | Path) -> nn.Module:
    """Rebuild a compressed model saved with :func:`save` (in eval mode)."""
    return load_artifact(directory).model
