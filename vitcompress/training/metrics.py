"""What a fine-tuning run measures and logs: the epoch's running totals (kept in checkpoints), the
images/s rate of the log lines, the records of ``metrics.jsonl`` and the run's summary
(validation itself: ``validation.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitcompress.data.segmentation import SEGMENTATION
from vitcompress.training.config import FinetuneConfig

# What the caller's ``extra`` says about the inputs, repeated on each run's ``start`` metrics line.
RUN_RECORD_KEYS = ("data", "data_config")
# The wall clock of the rate window; a test replaces it to control time.
_clock = time.perf_counter


@dataclass
class EpochTotals:
    """Sums over the current epoch's batches, kept in checkpoints so that the summary of an
    epoch cut by an interrupt covers the whole epoch once resumed."""

    loss_sum: float = 0.0
    batches: int = 0
    images: int = 0  # counted at optimizer steps (all processes together)
    seconds: float = 0.0  # training time of those images, without evaluation


class RateWindow:
    """Images over the wall time since the window began, everything in between included (data
    loading, steps, checkpoints): the rate a log line reports, sustained over the lines' interval
    rather than one step's, which prefetching data loaders make look many times faster."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.images = 0
        self.start = _clock()

    def add(self, images: int) -> None:
        self.images += images

    def rate(self) -> float | None:
        elapsed = _clock() - self.start
        return self.images / elapsed if elapsed > 0 and self.images else None


def start_record(
    step: int, resume_from: Path | None, dropped: int | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """The ``start`` line of one invocation: the step it starts from, the checkpoint it resumed
    from and the records it dropped (those past that step), and what it trains on."""
    record: dict[str, Any] = {
        "type": "start",
        "step": step,
        "resumed_from": str(resume_from) if resume_from else None,
    }
    if dropped is not None:
        record["records_dropped"] = dropped
    record.update({key: extra[key] for key in RUN_RECORD_KEYS if key in extra})
    return record


def run_summary(
    config: FinetuneConfig,
    *,
    epochs: int,
    steps: int,
    lr: float,
    processes: int,
    sharded: bool,
    loss_weights: dict[str, float],
    history: list[dict[str, Any]],
    started: float,
) -> dict[str, Any]:
    """The run's summary as the artifact records it; ``history`` covers every epoch of the
    run, those before a resume included; ``seconds`` are this invocation's."""
    return {
        "epochs": epochs,
        "max_steps": config.max_steps,
        "steps": steps,
        "lr": lr,
        "effective_batch": config.batch_size * config.accum * processes,
        "processes": processes,
        "fsdp": sharded,
        "seed": config.seed,
        "loss_weights": loss_weights,
        "ema_decay": config.ema_decay,
        "val_images": config.val_images,
        "amp": config.amp,
        "history": [dict(entry) for entry in history],
        "val_top1": history[-1].get("val_top1") if history else None,
        **(
            {"task": config.task, "val_miou": history[-1].get("val_miou") if history else None}
            if config.task == SEGMENTATION
            else {}
        ),
        "seconds": time.perf_counter() - started,
        **config.extra,
    }
