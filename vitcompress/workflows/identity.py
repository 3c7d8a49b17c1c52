"""Which model a JSON result describes.

``apply``, ``bench`` and ``eval`` name the model behind every number they print, so that
``report`` can join results on the model itself rather than on its cost (two models can share
params and MACs) or on how its path was written (``runs/a`` and ``/home/me/runs/a`` are one
model):

* an artifact: its absolute directory, the sha256 of ``model.safetensors`` and the sha256 of the
  configuration that rebuilds it (base source, input size and plan from ``vitcompress.json``);
  eTPS/EViT add no parameters, so two plans on one base share their weights file;
* any other model: its kind (timm, file, module), the spec as recorded by the loader (files
  absolute), the model arguments, the method run as its forward (``entry``, where not
  ``forward``), and its weights (a checkpoint's absolute path and sha256, timm's
  pretrained tag, or ``random`` for freshly initialised weights).

Both carry the input size the result was measured at. :func:`identity_key` turns an identity into
the string ``report`` joins on: everything but the spec as typed and the paths, so the same
content under two paths is one model and different content under one path (an artifact written
again) is two.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from vitcompress.artifacts.artifact import WEIGHTS_FILE, file_sha256
from vitcompress.compilation.entries import FORWARD, entry_of
from vitcompress.loading import ARTIFACT_MARKER, LoadedModel

__all__ = [
    "WEIGHTS_FILE",
    "artifact_identity",
    "file_sha256",
    "identity_key",
    "model_identity",
    "unsaved_identity",
]

# The parts of vitcompress.json that decide which model an artifact rebuilds.
_ARTIFACT_CONFIG_KEYS = ("source", "input_size", "plan")
# Fields that say where a model is, not what it is: left out of the join key.
_LOCATION_FIELDS = ("spec", "path", "checkpoint")


def _canonical_sha256(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def artifact_identity(
    directory: str | Path, input_size: Sequence[int] | None = None
) -> dict[str, Any] | None:
    """The identity of the artifact in ``directory``, or None if it is not a readable artifact.

    ``input_size`` is the size a result was measured at (default: the artifact's own).
    """
    directory = Path(directory).expanduser()
    try:
        meta = json.loads((directory / ARTIFACT_MARKER).read_text())
        weights = file_sha256(directory / WEIGHTS_FILE)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    size = list(input_size) if input_size is not None else meta.get("input_size")
    return {
        "kind": "artifact",
        "spec": str(directory),
        "path": str(directory.resolve()),
        "weights_sha256": weights,
        "config_sha256": _canonical_sha256(_artifact_config(meta)),
        "input_size": None if size is None else [int(v) for v in size],
    }


def _artifact_config(meta: dict[str, Any]) -> dict[str, Any]:
    config = {k: meta.get(k) for k in _ARTIFACT_CONFIG_KEYS}
    # Another method of the base than its forward is another model (its features, say); the
    # forward's artifacts keep the key they had before entries were recorded.
    if meta.get("entry", FORWARD) != FORWARD:
        config["entry"] = meta["entry"]
    return config


def model_identity(loaded: LoadedModel, spec: str) -> dict[str, Any]:
    """The identity of a model loaded from ``spec`` (as the user typed it)."""
    if os.path.isfile(os.path.join(spec, ARTIFACT_MARKER)):
        found = artifact_identity(spec, loaded.input_size)
        if found is not None:
            return found | {"spec": spec}
    source = loaded.source.to_json()
    recorded = str(source["spec"])
    kind = _source_kind(recorded)
    checkpoint = source.get("checkpoint")
    if checkpoint:
        weights = {"checkpoint": checkpoint, "checkpoint_sha256": file_sha256(checkpoint)}
    elif source.get("pretrained"):
        weights = {"pretrained": _pretrained_tag(loaded.model)}
    else:  # freshly initialised: cost and speed are the architecture's, accuracy is noise
        weights = {"weights": "random"}
    return {
        "kind": kind,
        "spec": spec,
        "path": recorded.rpartition(":")[0] if kind == "file" else None,
        "source": recorded,
        "model_args": source.get("model_args") or {},
        **({"entry": entry} if (entry := entry_of(loaded.model)) != FORWARD else {}),
        **weights,
        "input_size": [int(v) for v in loaded.input_size],
    }


def untrained(identity: dict[str, Any]) -> bool:
    """Whether a timm model of this identity runs on freshly initialised weights: loaded without
    --pretrained or --checkpoint, or an artifact compressed from such a base and never
    fine-tuned. Its accuracy is that of no training. (A user's factory or module may load its
    own weights, so only timm's are judged.)"""
    if identity.get("kind") != "artifact":
        return identity.get("kind") == "timm" and identity.get("weights") == "random"
    try:
        meta = json.loads((Path(identity["path"]) / ARTIFACT_MARKER).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return False
    source = meta.get("source") if isinstance(meta, dict) else None
    return (
        isinstance(source, dict)
        and _source_kind(str(source.get("spec", ""))) == "timm"
        and meta.get("base_weights") is None
        and "finetune" not in meta
    )


def _source_kind(recorded: str) -> str:
    """timm, file or module, for a spec as the loader records it (files absolute)."""
    target, sep, _ = recorded.rpartition(":")
    if not sep or target.lower() in ("hf-hub", "local-dir", "timm", "hf_hub"):
        return "timm"
    return "file" if target.endswith(".py") or "/" in target or os.sep in target else "module"


def unsaved_identity(base: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """A compressed model that was not written to disk: its base and plan. Its learned parts
    (dTPS/DynamicViT predictors) are freshly initialised, so it is never joined with another."""
    return {
        "kind": "unsaved",
        "base": base,
        "plan_sha256": _canonical_sha256(plan),
        "input_size": base.get("input_size"),
    }


def _pretrained_tag(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    for key in ("hf_hub_id", "tag", "url", "file"):
        if cfg.get(key):
            return str(cfg[key])
    return "timm pretrained"


def identity_key(identity: Any) -> str | None:
    """The string ``report`` joins on, or None for an identity that joins with nothing (missing,
    malformed, or an unsaved compressed model)."""
    if not isinstance(identity, dict) or not identity.get("kind"):
        return None
    if identity["kind"] == "unsaved":
        return None
    # "source" stays: for a file it is the file's absolute path, which says which code it is.
    return _canonical_sha256({k: v for k, v in identity.items() if k not in _LOCATION_FIELDS})
