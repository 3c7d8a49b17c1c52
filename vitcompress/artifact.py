"""Compressed artifacts on disk: ``vitcompress.json`` (base model source + plan) and
``model.safetensors`` (the compressed model's weights).

Loading rebuilds the base model from its source, applies the plan to a fresh capture and loads
the weights, so no code or pickle is ever read from the artifact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import safetensors.torch
from torch import nn

from vitcompress import __version__
from vitcompress.loading import ARTIFACT_MARKER, LoadedModel, ModelLoadError, ModelSource
from vitcompress.metadata import attach
from vitcompress.plan import plan_from_json

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"


class ArtifactError(ModelLoadError):
    """An artifact that cannot be written or read; one line for the user."""


def _infer_source(model: nn.Module) -> ModelSource | None:
    """A timm model records its architecture; enough to rebuild it with the same head size."""
    cfg = getattr(model, "vitcompress_base_cfg", None)
    if cfg and cfg.get("architecture"):
        import timm

        if timm.is_model(cfg["architecture"]):
            args = {"num_classes": cfg["num_classes"]} if cfg.get("num_classes") else {}
            return ModelSource(spec=cfg["architecture"], model_args=args)
    return None


def save_artifact(model: nn.Module, directory: str | Path, source: ModelSource | str | None = None,
                  input_size: tuple[int, int, int] | None = None,
                  extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (a result of ``compress``) to ``directory``, replacing it atomically: the
    new artifact is written beside it and renamed into place, so a failure leaves the old one."""
    plan = getattr(model, "vitcompress_plan", None)
    if plan is None:
        raise ArtifactError("only a model returned by vitcompress.compress can be saved")
    if isinstance(source, str):
        source = ModelSource(spec=source)
    source = source or getattr(model, "vitcompress_source", None) or _infer_source(model)
    if source is None:
        raise ArtifactError(
            "cannot tell how to rebuild the base model; pass source='timm_name' or "
            "'path/to/file.py:factory' to save()"
        )
    size = input_size or getattr(model, "vitcompress_input_size", None)
    if size is None:
        raise ArtifactError("cannot tell the model's input size; pass input_size=(C, H, W)")
    directory = Path(directory)
    meta = {
        "format": FORMAT_VERSION,
        "vitcompress_version": __version__,
        "source": {**source.to_json(), "checkpoint": None, "pretrained": False},
        # Absolute: the artifact is read from other working directories (eval, finetune).
        "base_weights": (str(Path(source.checkpoint).expanduser().resolve()) if source.checkpoint
                         else "timm pretrained" if source.pretrained else None),
        "input_size": list(size),
        "plan": plan,
        # The preprocessing the model expects (docs/data.md); extra may name another.
        "data_config": getattr(model, "vitcompress_data_config", None),
        **(extra or {}),
    }
    staging: Path | None = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        safetensors.torch.save_model(model, str(staging / WEIGHTS_FILE))
        with open(staging / ARTIFACT_MARKER, "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _swap_into_place(staging, directory)
    except OSError as e:
        raise ArtifactError(f"could not write {directory}: {e.strerror or e}") from e
    finally:  # after a failure or Ctrl-C, nothing half-written is left beside the artifact
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def _swap_into_place(staging: Path, directory: Path) -> None:
    """Rename ``staging`` to ``directory``; an artifact already there is moved aside first and
    moved back if the second rename fails, so ``directory`` always holds a complete artifact."""
    if not directory.exists():
        os.replace(staging, directory)
        return
    if not (directory / ARTIFACT_MARKER).is_file() and any(directory.iterdir()):
        raise ArtifactError(f"{directory} exists and is not a compressed model; not overwriting it")
    old = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(directory, old)
    try:
        os.replace(staging, directory)
    except BaseException:
        try:
            os.rename(old, directory)
        except OSError as e:
            raise ArtifactError(f"could not write {directory}; the previous artifact is kept "
                                f"in {old}: {e.strerror or e}") from e
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / ARTIFACT_MARKER
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"cannot read {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "plan" not in meta:
        raise ArtifactError(f"{path} is not a vitcompress artifact of format {FORMAT_VERSION}")
    return meta


def base_source(meta: dict[str, Any]) -> ModelSource:
    """The artifact's base model as it was given: spec and model arguments from ``source``,
    weights from ``base_weights`` (a checkpoint path, "timm pretrained", or None)."""
    source = ModelSource.from_json(meta["source"])
    weights = meta.get("base_weights")
    if weights is not None and not isinstance(weights, str):
        raise ArtifactError(f"malformed base_weights in {ARTIFACT_MARKER}: {weights!r}")
    pretrained = weights == "timm pretrained"
    return replace(source, checkpoint=None if pretrained else weights, pretrained=pretrained)


def base_weights_problem(source: ModelSource) -> str | None:
    """Why rebuilding ``source`` (from ``base_source``) cannot give the trained base, or None."""
    if source.pretrained:
        return None
    if source.checkpoint is None:
        return ("the artifact records no base weights (it was saved without --checkpoint or "
                "--pretrained)")
    if not Path(source.checkpoint).is_file():
        return f"the base weights {source.checkpoint} named by the artifact are not there"
    return None


def load_artifact_base(directory: str | Path,
                       input_size: tuple[int, int, int] | None = None) -> LoadedModel:
    """The uncompressed model the artifact in ``directory`` was made from, with its weights.

    Raises ``ArtifactError`` when those weights cannot be had: a base with other weights would
    make any comparison with the artifact meaningless.
    """
    from vitcompress.loading import load_model

    meta = read_meta(directory)
    source = base_source(meta)
    problem = base_weights_problem(source)
    if problem is not None:
        raise ArtifactError(f"cannot rebuild the base of {directory}: {problem}")
    size = input_size or tuple(meta["input_size"])
    return load_model(source.spec, source.model_args, checkpoint=source.checkpoint,
                      pretrained=source.pretrained, input_size=size)


def load_artifact(directory: str | Path) -> LoadedModel:
    """Rebuild the compressed model saved in ``directory``."""
    from vitcompress.api import compress_loaded
    from vitcompress.loading import load_model

    meta = read_meta(directory)
    # The returned source names the base weights, so an artifact saved again from this model
    # (finetune --model DIR) still records them. The compressed model does not need them to
    # load, so a malformed record only loses that.
    try:
        source = base_source(meta)
    except ArtifactError:
        source = ModelSource.from_json(meta["source"])
    size = tuple(meta["input_size"])
    base = load_model(source.spec, source.model_args, input_size=size)
    plan = plan_from_json(meta["plan"])
    model = compress_loaded(base, variant=plan.variant, keep=plan.keep, locs=plan.locs,
                            policy=plan.policy).model
    weights = Path(directory) / WEIGHTS_FILE
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(weights), strict=False)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for bad files
        raise ArtifactError(f"cannot read weights {weights}: {str(e).splitlines()[0]}") from e
    if missing or unexpected:
        raise ArtifactError(
            f"weights in {weights} do not fit the rebuilt model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    model.eval()
    from vitcompress.data.config import artifact_data_config

    data_config, data_config_from = artifact_data_config(meta, model, str(directory))
    attach(model, vitcompress_artifact=str(Path(directory).resolve()), vitcompress_source=source,
           vitcompress_data_config=data_config or None,
           vitcompress_data_config_from=data_config_from or None)
    return LoadedModel(model=model, source=source, input_size=size)
