"""What a fine-tuning run is given and what it reports: its configuration, the progress
interface, and the two ways a run ends early (divergence, interrupt)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from vitcompress.workflows.run_directory import FinetuneError

StepCallback = Callable[[int, nn.Module], None]


class TrainingDiverged(FinetuneError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""

    exit_code = 1  # not the input's fault as such: the run failed


class FinetuneInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM (or a ``KeyboardInterrupt``) between optimizer steps.

    ``checkpoint`` holds the last completed step, or is None when nothing could be saved (a
    second signal forced the stop, or the interrupt came in the middle of an update); the
    message is the one line the command prints."""

    def __init__(
        self, reason: str, step: int, checkpoint: Path | None, latest: Path | None = None
    ) -> None:
        self.reason, self.step, self.checkpoint = reason, step, checkpoint
        if checkpoint is not None:
            text = (
                f"interrupted ({reason}): step {step} saved in {checkpoint}; continue with --resume"
            )
        elif latest is not None:
            text = (
                f"interrupted ({reason}): no checkpoint written; the newest, {latest}, "
                "stands (--resume continues from it)"
            )
        else:
            text = f"interrupted ({reason}): no checkpoint written, nothing to resume"
        super().__init__(text)


class FinetuneProgress:
    """What a run reports as it goes, on the main process only; this base class shows nothing.
    The CLI's rich progress bar subclasses it."""

    def start(self, epochs: int, steps_per_epoch: int, total_steps: int | None = None) -> None:
        """Before the first step; ``total_steps``: the run's length (``--max-steps`` may end the
        last epoch early)."""

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        """``steps_done`` > 0 when a resumed run starts inside the epoch."""

    def step(self, record: dict[str, Any]) -> None:
        """After each optimizer step: the metrics-log record (step, loss, lr, img_per_s...)."""

    def epoch_done(self, summary: dict[str, Any]) -> None:
        """After each epoch: train loss and, with validation data, val_top1."""

    def stop(self) -> None:
        """After the last step, also when the run fails or is interrupted."""


@dataclass
class FinetuneConfig:
    epochs: int = 30
    batch_size: int = 128  # per process
    accum: int = 1
    lr: float | None = None  # None: batch x accum x processes / 1024 x 2.5e-4
    warmup_epochs: float = 5.0
    weight_decay: float = 0.05
    ratio_weight: float = 2.0
    distill_weight: float = 0.5
    token_distill_weight: float = 0.5
    ema_decay: float | None = None
    amp: str | None = None  # None, "bf16" or "fp16"
    max_steps: int | None = None  # the run's length in optimizer steps; overrides ``epochs``
    save_every: int = 0  # optimizer steps; 0: only at the end of each epoch
    keep_checkpoints: int = 2
    resume: bool = False
    seed: int = 0
    num_workers: int = 0
    log_every: int = 10
    mixup: dict[str, Any] | None = None  # keyword arguments of timm.data.Mixup
    smoothing: float = 0.0
    fsdp: bool = False  # shard the model with FSDP2 over the processes (several processes only)
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the artifact's summary
