"""The base model an artifact was made from, and what weights taken from an artifact were
trained on.

A fine-tuned artifact's ``model.safetensors`` is a base's weights too (at keep 1 with eTPS, which
has no parameters of its own, it holds them under the base's names: docs/finetune.md trains a
base that way). Loaded as ``--checkpoint``, those weights expect the preprocessing they were
trained with, which the artifact records; the base's own config (timm's ``pretrained_cfg``)
describes other weights. So a base loaded from them states the artifact's config, and scoring,
compressing and saving it use that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from torch import nn

from vitcompress.artifacts.artifact import (
    WEIGHTS_FILE,
    ArtifactError,
    base_source,
    base_weights_problem,
    read_meta,
    recorded_entry,
)
from vitcompress.compilation.entries import entry_view
from vitcompress.compilation.metadata import attach
from vitcompress.data.config import artifact_data_config
from vitcompress.loading import LoadedModel, is_artifact_directory, load_base_model


def load_artifact_base(
    directory: str | Path, input_size: tuple[int, ...] | None = None
) -> LoadedModel:
    """The uncompressed model the artifact in ``directory`` was made from, with its weights,
    running the method the artifact compressed (its ``entry``: a base compressed with
    ``--entry forward_features`` is compared as its ``forward_features``).

    Raises ``ArtifactError`` when those weights cannot be had: a base with other weights would
    make any comparison with the artifact meaningless.
    """
    meta = read_meta(directory)
    source = base_source(meta)
    problem = base_weights_problem(source, meta)
    if problem is not None:
        raise ArtifactError(f"cannot rebuild the base of {directory}: {problem}")
    size = input_size or tuple(meta["input_size"])
    base = load_base_model(
        source.spec,
        source.model_args,
        checkpoint=source.checkpoint,
        pretrained=source.pretrained,
        input_size=size,
    )
    model = entry_view(base.model, recorded_entry(meta, directory))
    state_trained_config(model, source.checkpoint)
    return replace(base, model=model)


def state_trained_config(model: nn.Module, checkpoint: str | Path | None) -> bool:
    """Where ``checkpoint`` is an artifact's weights file and the artifact records the data
    config they were trained with (a fine-tune's, or what ``apply`` recorded), ``model`` states
    that config from now on (the attributes a compressed model carries, above what the model
    itself states). Returns whether it did."""
    if checkpoint is None:
        return False
    path = Path(checkpoint).expanduser()
    if path.name != WEIGHTS_FILE or not is_artifact_directory(str(path.parent)):
        return False
    try:
        meta = read_meta(path.parent)
    except ArtifactError:
        return False  # not a readable artifact: the weights are loaded, nothing is stated
    if not isinstance(meta.get("finetune"), Mapping) and meta.get("data_config") is None:
        return False  # the artifact states only what its base did
    fields, where = artifact_data_config(meta, model, str(path.parent))
    if not fields:
        return False
    attach(
        model,
        vitcompress_data_config=fields,
        vitcompress_data_config_from=f"{where}, the artifact whose weights were loaded",
    )
    return True
