"""Weights files: read safely, unwrap training checkpoints, and load strictly into a model."""

from __future__ import annotations

import argparse
import contextlib
import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitcompress.loading.errors import ANSI_ESCAPE, SHOW_KEYS, ModelLoadError, one_line

# Keys under which training scripts commonly nest the weights, in order of preference: the raw
# weights before their EMA copy, because that is what a plain ``state_dict()`` would have saved.
_WRAPPER_KEYS = ("model", "state_dict", "state_dict_ema", "model_ema")
# Prefixes added by DistributedDataParallel and torch.compile respectively.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def load_checkpoint(model: nn.Module, path: str | Path, *, model_name: str | None = None) -> None:
    """Load weights from ``path`` into ``model``, strictly; every key must match.

    ``.safetensors`` files are read with safetensors; anything else with ``torch.load`` in
    ``weights_only`` mode, so a checkpoint can never run code on this machine.
    """
    path = Path(path)
    name = model_name or type(model).__name__
    state = read_state_dict(path)
    expected = model.state_dict()
    state = _strip_wrapper_prefixes(state, expected)

    problems = _fit_problems(state, expected)
    if problems:
        raise ModelLoadError(f"checkpoint {path} does not fit model {name}: {'; '.join(problems)}")
    try:
        model.load_state_dict(state, strict=True)
    except Exception as exc:  # e.g. a module's own load hook objecting
        raise ModelLoadError(
            f"checkpoint {path} does not fit model {name}: {one_line(exc)}"
        ) from exc


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights in ``path``, unwrapped from a training checkpoint's nesting (``model``,
    ``state_dict``, ...); the keys as the file has them."""
    path = Path(path)
    return _unwrap_state_dict(_read_checkpoint(path), path)


def strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the ``module.`` / ``_orig_mod.`` prefix every key carries, for a model
    none of whose keys can start with one (a HuggingFace model's start with its base's name)."""
    return _strip_wrapper_prefixes(state, {})


def _read_checkpoint(path: Path) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"checkpoint {path} not found")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(
                f"checkpoint {path} is truncated or not a safetensors file: {one_line(exc)}"
            ) from exc

    if _is_torchscript(path):
        raise ModelLoadError(
            f"checkpoint {path} is a TorchScript program (as export --format torchscript writes), "
            "not weights: give its state dict, torch.save(model.state_dict(), FILE), or a "
            ".safetensors file"
        )
    # argparse.Namespace is allowed because timm's training script stores its arguments as one next
    # to the weights; it only holds attributes and runs no code when unpickled. (torch < 2.5 has no
    # safe_globals; such checkpoints are then refused like any other pickled object.)
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    allow = safe_globals([argparse.Namespace]) if safe_globals else contextlib.nullcontext()
    try:
        with allow:
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = ANSI_ESCAPE.sub("", str(exc))
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            raise ModelLoadError(
                f"checkpoint {path} contains pickled Python objects ({found.group(1)}), which are "
                "not loaded because unpickling can run arbitrary code; save plain weights instead: "
                "torch.save(model.state_dict(), FILE) or a .safetensors file"
            ) from exc
        # Otherwise the pickle stream itself is broken (e.g. "Unsupported operand").
        found = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        reason = " ".join(found.group(1).split()) if found else one_line(exc)
        raise ModelLoadError(
            f"checkpoint {path} is truncated or corrupt (not a PyTorch weights file): {reason}"
        ) from exc
    except Exception as exc:  # torch reports corruption as RuntimeError, EOFError, KeyError, ...
        raise ModelLoadError(f"checkpoint {path} is truncated or corrupt: {one_line(exc)}") from exc


def _is_torchscript(path: Path) -> bool:
    """A zip archive holding ``constants.pkl``: how torch itself tells a TorchScript file from a
    saved state dict (both are zips since torch 1.6)."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.split("/")[-1] == "constants.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _unwrap_state_dict(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    # Training checkpoints nest the weights next to optimizer state, epoch counters and the like,
    # sometimes twice over (e.g. {"model": {"state_dict": ...}}).
    for _ in range(3):
        if _is_state_dict(obj):
            return dict(obj)
        if not isinstance(obj, Mapping):
            break
        key = next((k for k in _WRAPPER_KEYS if k in obj), None)
        if key is None:
            keys = ", ".join(_first(list(map(str, obj))))
            raise ModelLoadError(
                f"checkpoint {path} holds no weights: a dict with keys {keys or '(none)'} "
                f"and none of {', '.join(_WRAPPER_KEYS)}"
            )
        obj = obj[key]
    raise ModelLoadError(
        f"checkpoint {path} holds a {type(obj).__name__}, not a dict of tensors (a state dict)"
    )


def _strip_wrapper_prefixes(
    state: dict[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    # Wrappers nest in either order (DDP around a compiled model, or the reverse): peel a
    # prefix while one is left, whichever comes first.
    stripped = True
    while stripped and state:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            # Only when every key carries it and the model's keys do not: a model may genuinely
            # have a submodule called "module".
            if all(k.startswith(prefix) for k in state) and not (
                expected and all(k.startswith(prefix) for k in expected)
            ):
                state = {k[len(prefix) :]: v for k, v in state.items()}
                stripped = True
    return state


def _fit_problems(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> list[str]:
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k} (checkpoint {list(state[k].shape)} vs model {list(v.shape)})"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(_first(missing))}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(_first(unexpected))}")
    if mismatched:
        problems.append(f"shape mismatch ({len(mismatched)}): {', '.join(_first(mismatched))}")
    return problems


def _first(items: list[str]) -> list[str]:
    return items[:SHOW_KEYS] + (["..."] if len(items) > SHOW_KEYS else [])
