"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint is one ``torch.save`` file holding only tensors and plain Python values, so it loads
with ``weights_only=True`` (no code is unpickled). It is written to a temporary file in the same
folder, fsynced and renamed into place, so a crash never leaves a half-written checkpoint under
the final name.
"""

from __future__ import annotations

import os
import random
import re
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitcompress.errors import UserError, one_line

PATTERN = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_name(global_step: int) -> str:
    return f"step-{global_step:08d}.pt"


def rng_state() -> dict[str, Any]:
    """RNG states of python, numpy and torch as tensors and plain lists (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": _to_plain(random.getstate()),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_to_tuple(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_plain(value: Any) -> Any:
    # random.getstate() is nested tuples; weights_only loads tuples too, but lists are safest.
    if isinstance(value, tuple | list):
        return [_to_plain(v) for v in value]
    return value


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value


def save_checkpoint(
    state: dict[str, Any], directory: str | Path, global_step: int, keep_last: int = 2
) -> Path:
    """Write ``state`` as ``directory/step-<global_step>.pt`` atomically, then prune old ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(global_step)
    # Not mkstemp: it creates files with mode 0600; a checkpoint follows the umask like the
    # other files a run writes. O_EXCL and a random name keep the temporary file private.
    tmp = directory / f".tmp-{secrets.token_hex(8)}.pt"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    if keep_last > 0:
        for old in list_checkpoints(directory)[:-keep_last]:
            old.unlink(missing_ok=True)
    return final


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not possible on every platform; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first (by global step)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def find_latest(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed: unreadable, or another model's (one line)."""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path``; one that cannot be read (truncated, not a checkpoint) is
    refused in one line that names the older checkpoint a run could resume from instead."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises OSError, RuntimeError, UnpicklingError...
        raise CheckpointError(
            f"{path} cannot be read ({one_line(error)}){_instead(path)}"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path} is not a training checkpoint{_instead(path)}")
    return state


def check_weights(path: Path, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse, in one line, a checkpoint whose weights are not those of the model being
    resumed (another model's, another plan's), before any is loaded."""
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    reshaped = [
        name
        for name in expected
        if name in saved and tuple(saved[name].shape) != tuple(expected[name].shape)
    ]
    if missing or unexpected or reshaped:
        counts = ", ".join(
            f"{len(names)} {what} (e.g. {names[0]})"
            for names, what in (
                (missing, "missing"),
                (unexpected, "unexpected"),
                (reshaped, "of another shape"),
            )
            if names
        )
        raise CheckpointError(
            f"{path} holds another model's weights ({counts}): resume with the model and plan "
            "it was written for, or fine-tune into a new --out"
        )


def _instead(path: Path) -> str:
    older = [p for p in list_checkpoints(path.parent) if p != path]
    if not older:
        return ": nothing to resume from; fine-tune into a new --out"
    return f": move it away to resume from {older[-1].name}"
