"""What was asked for (:class:`ModelSource`) and what loading gives back (:class:`LoadedModel`)."""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from vitcompress.loading.errors import ModelLoadError


@dataclass
class ModelSource:
    """What was asked for; serialisable so that a compressed artifact can name its base model."""

    spec: str  # timm name, "path/to/file.py:factory", "package.module:factory", or an artifact dir
    model_args: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    pretrained: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "model_args": {key: _encode_arg(key, value) for key, value in self.model_args.items()},
            "checkpoint": self.checkpoint,
            "pretrained": self.pretrained,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelSource:
        if not isinstance(d, Mapping) or not isinstance(d.get("spec"), str):
            raise ModelLoadError(f"not a model source (expected an object with a 'spec'): {d!r}")
        args = d.get("model_args") or {}
        checkpoint = d.get("checkpoint")
        pretrained = d.get("pretrained", False)
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise ModelLoadError(f"model source has malformed model_args: {args!r}")
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise ModelLoadError(f"model source has a malformed checkpoint: {checkpoint!r}")
        if not isinstance(pretrained, bool):
            raise ModelLoadError(f"model source has a malformed pretrained flag: {pretrained!r}")
        return cls(
            spec=d["spec"],
            model_args={key: _decode_arg(key, value) for key, value in args.items()},
            checkpoint=checkpoint,
            pretrained=pretrained,
        )


def _is_plain_json(value: Any) -> bool:
    """True if ``json`` stores ``value`` and reads it back as an equal object of the same types."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_plain_json(v) for v in value)
    if isinstance(value, dict):
        if set(value) == {"__literal__"}:  # would be mistaken for our own encoding
            return False
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in value.items())
    return False


def _encode_arg(key: str, value: Any) -> Any:
    # JSON would turn tuples into lists (and cannot hold sets, bytes, ...), but a factory may care:
    # such values are stored as their Python literal, which is how the CLI parsed them anyway.
    if _is_plain_json(value):
        return value
    text = repr(value)
    try:
        faithful = ast.literal_eval(text) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        faithful = False
    if not faithful:
        raise ModelLoadError(
            f"model argument {key}={text} cannot be recorded; use numbers, strings, bools, None, "
            "tuples, lists or dicts"
        )
    return {"__literal__": text}


def _decode_arg(key: str, value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__literal__"}:
        try:
            return ast.literal_eval(value["__literal__"])
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
            raise ModelLoadError(
                f"model source has a malformed value for '{key}': {value!r}"
            ) from exc
    return value


@dataclass
class LoadedModel:
    model: nn.Module
    source: ModelSource
    input_size: tuple[int, ...]
