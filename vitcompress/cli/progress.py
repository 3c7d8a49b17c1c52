"""What ``vitcompress finetune`` shows while it trains: a rich progress bar on a terminal, plain
log lines on stderr otherwise (CI logs, ``| tee``), where a bar would print nothing until the end.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from vitcompress.cli.app import console
from vitcompress.training.evaluate import EvalProgress
from vitcompress.workflows.finetune import FinetuneProgress


def _rate(img_per_s: float) -> str:
    """Whole images a second, or three significant digits below 10 (a CPU run under bf16
    autocast can train at under one image a second; ``0 img/s`` would read as stalled)."""
    return f"{img_per_s:.0f}" if img_per_s >= 10 else f"{img_per_s:.3g}"


def _bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
    )


class RichEvalProgress(EvalProgress):
    """One bar over the images of an evaluation: on its own, or as a second line of a training
    run's ``bar`` (which stays, frozen, above it while the images are evaluated)."""

    def __init__(self, description: str = "evaluating", bar: Progress | None = None) -> None:
        self.description = description
        self.shared = bar
        self.bar: Progress | None = None
        self.task: Any = None

    def start(self, images: int) -> None:
        self.bar = self.shared or _bar()
        if self.shared is None:
            self.bar.start()
        self.task = self.bar.add_task(self.description, total=images, info="images")

    def advance(self, images: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=images)

    def stop(self) -> None:
        if self.bar is None:
            return
        if self.shared is None:
            self.bar.stop()
        else:
            self.bar.remove_task(self.task)
        self.bar, self.task = None, None


class RichProgress(FinetuneProgress):
    """Epoch, step, loss, lr, images/s and ETA: one bar per epoch, or, when ``--max-steps``
    ends the run before its last epoch's end, one bar over the run's steps; validation draws a
    bar of its own under it."""

    def __init__(self) -> None:
        self.bar: Progress | None = None
        self.task: Any = None
        self.epochs = 0
        self.steps_per_epoch = 0
        self.total_steps = 0
        self.whole_run = False  # one bar over --max-steps rather than one per epoch

    def start(self, epochs: int, steps_per_epoch: int, total_steps: int | None = None) -> None:
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.total_steps = total_steps or epochs * steps_per_epoch
        self.whole_run = self.total_steps != epochs * steps_per_epoch
        self.bar = _bar()
        self.bar.start()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar, self.task = None, None

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        if self.bar is None:
            return
        description = f"epoch {epoch + 1}/{self.epochs}"
        if self.whole_run and self.task is not None:
            self.bar.update(self.task, description=description)
            return
        if self.task is not None:
            self.bar.remove_task(self.task)
        total, completed = self.steps_per_epoch, steps_done
        if self.whole_run:  # every epoch before this one was whole
            total, completed = self.total_steps, epoch * self.steps_per_epoch + steps_done
        self.task = self.bar.add_task(description, total=total, completed=completed, info="")

    def step(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        speed = record.get("img_per_s")
        info = f"step {record['step']} loss {record['loss']:.4f} lr {record['lr']:.2e}" + (
            f" {_rate(speed)} img/s" if speed else ""
        )
        self.bar.update(self.task, advance=1, info=info)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, highlight=False)
        else:
            click.echo(text, err=True)

    def evaluation(self) -> EvalProgress:
        return RichEvalProgress("validating", self.bar)

    def epoch_done(self, summary: dict[str, Any]) -> None:
        if self.bar is not None and summary.get("val_top1") is not None:
            self.bar.console.print(
                f"epoch {summary['epoch'] + 1}: train loss "
                f"{summary['train_loss']:.4f}, val top-1 "
                f"{100 * summary['val_top1']:.2f}%"
            )
        elif self.bar is not None and summary.get("val_miou") is not None:
            self.bar.console.print(
                f"epoch {summary['epoch'] + 1}: train loss "
                f"{summary['train_loss']:.4f}, val mIoU "
                f"{100 * summary['val_miou']:.2f}%"
            )


class LogLines(FinetuneProgress):
    """One plain line every ``every`` optimizer steps, one as each validation starts and one per
    epoch, flushed at once:

        step 20/80 (epoch 1/4): loss 0.6931, lr 2.50e-04, 118 img/s
        validating 512 images
        epoch 1/4 done at step 20: train loss 0.7012, lr 2.50e-04, 120 img/s, val top-1 51.20%

    The images/s of a step line is the record's: the images over the wall time since the last
    logged step (the run logs every ``every`` steps, as these lines are).
    """

    def __init__(self, every: int = 10, stream: TextIO | None = None) -> None:
        self.every = max(1, every)
        self.stream = stream
        self.epochs = self.total_steps = 0

    def _print(self, text: str) -> None:
        stream = self.stream or sys.stderr  # looked up late: tests and click swap stderr
        print(text, file=stream, flush=True)

    def start(self, epochs: int, steps_per_epoch: int, total_steps: int | None = None) -> None:
        self.epochs = epochs
        self.total_steps = total_steps or epochs * steps_per_epoch

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        self.epoch = epoch

    def note(self, text: str) -> None:
        self._print(text)

    def evaluation(self) -> EvalProgress:
        return _ValidationLine(self._print)

    def step(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step % self.every and step != 1 and step != self.total_steps:
            return
        speed = record.get("img_per_s")
        rate = f", {_rate(speed)} img/s" if speed else ""
        self._print(
            f"step {step}/{self.total_steps} (epoch {record['epoch'] + 1}/{self.epochs})"
            f": loss {record['loss']:.4f}, lr {record['lr']:.2e}{rate}"
        )

    def epoch_done(self, summary: dict[str, Any]) -> None:
        parts = [f"train loss {summary['train_loss']:.4f}"]
        if summary.get("lr") is not None:
            parts.append(f"lr {summary['lr']:.2e}")
        if summary.get("img_per_s"):
            parts.append(f"{_rate(summary['img_per_s'])} img/s")
        if summary.get("val_top1") is not None:
            parts.append(f"val top-1 {100 * summary['val_top1']:.2f}%")
        if summary.get("val_top1_ema") is not None:
            parts.append(f"EMA val top-1 {100 * summary['val_top1_ema']:.2f}%")
        if summary.get("val_miou") is not None:
            parts.append(f"val mIoU {100 * summary['val_miou']:.2f}%")
        if summary.get("val_miou_ema") is not None:
            parts.append(f"EMA val mIoU {100 * summary['val_miou_ema']:.2f}%")
        self._print(
            f"epoch {summary['epoch'] + 1}/{self.epochs} done at step {summary['step']}: "
            + ", ".join(parts)
        )


class _ValidationLine(EvalProgress):
    """The line a log announces a validation with, so that a long one does not read as a hang:

    validating 512 images
    """

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write

    def start(self, images: int) -> None:
        self.write(f"validating {images} images")
