"""A fine-tuning run's output directory: checkpoints/, metrics.jsonl, the artifact, ema/.

The directory ends as a compressed artifact (``--model DIR`` loads it) that also holds the run's
checkpoints and metrics; this module decides what may be written there and writes the files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from vitcompress.errors import UserError
from vitcompress.training.checkpoint import find_latest

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
EMA_DIR = "ema"


class FinetuneError(UserError):
    """A run that cannot start or continue as asked (one line for the user)."""


def prepare_run_directory(out: Path, resume: bool) -> Path | None:
    """Check that a run may write into ``out``; return the checkpoint to resume from."""
    ckpt_dir = out / CHECKPOINTS
    latest = find_latest(ckpt_dir)
    if resume:
        if latest is None:
            raise FinetuneError(f"--resume: no checkpoint in {ckpt_dir}")
        return latest
    if latest is not None:
        raise FinetuneError(
            f"{out} already holds checkpoints; pass --resume to continue that run "
            "or choose another --out"
        )
    if (
        out.exists()
        and any(out.iterdir())
        and not (out / "vitcompress.json").is_file()
        and not (out / METRICS).is_file()
    ):
        raise FinetuneError(f"{out} exists and is not a fine-tuning output; not writing into it")
    return None


def write_artifact_into(
    model: nn.Module,
    out: Path,
    source: Any,
    input_size: tuple[int, ...],
    extra: dict[str, Any],
) -> None:
    """Write the artifact's two files into ``out`` beside checkpoints/ and metrics.jsonl.

    ``save_artifact`` replaces a whole directory, which would delete the checkpoints; so it
    writes into a hidden folder and the files are renamed into ``out`` (weights first, the JSON
    that marks the folder as a model last, each rename atomic).
    """
    from vitcompress.artifacts.artifact import WEIGHTS_FILE, save_artifact
    from vitcompress.loading import ARTIFACT_MARKER

    staging = out / ".artifact.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    save_artifact(model, staging, source=source, input_size=input_size, extra=extra)
    os.replace(staging / WEIGHTS_FILE, out / WEIGHTS_FILE)
    os.replace(staging / ARTIFACT_MARKER, out / ARTIFACT_MARKER)
    shutil.rmtree(staging, ignore_errors=True)


def write_run_artifacts(
    out: Path,
    model: nn.Module,
    ema: nn.Module | None,
    source: Any,
    input_size: tuple[int, ...],
    summary: dict[str, Any],
) -> None:
    """The fine-tuned artifact in ``out`` and, with an EMA, the EMA's in ``out/ema``."""
    model.eval()
    write_artifact_into(model, out, source, input_size, {"finetune": summary})
    if ema is not None:
        extra = {"finetune": {**summary, "weights": "ema"}}
        write_artifact_into(ema, out / EMA_DIR, source, input_size, extra)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended (a resumed run continues it)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def forget_after(self, step: int) -> int:
        """Drop the step and epoch records past ``step``, the step a resumed run restarts from:
        a run killed after its last checkpoint logged steps that the resumed run trains again,
        and the log would list them twice. Returns how many records were dropped; the file is
        replaced atomically."""
        if not self.enabled or not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by the kill: the resumed run trains its step again
                dropped += 1
                continue
            undone = record.get("type") in ("step", "epoch") and record.get("step", 0) > step
            if undone:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
        if dropped:
            staging = self.path.with_name(f".{self.path.name}.tmp")
            staging.write_text("".join(kept))
            os.replace(staging, self.path)
        return dropped
