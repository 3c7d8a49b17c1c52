"""The rich progress bar ``vitcompress finetune`` shows while it trains."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from vitcompress.cli.app import console
from vitcompress.workflows.finetune import FinetuneProgress


class RichProgress(FinetuneProgress):
    """Epoch, step, loss, lr, images/s and ETA, one bar per epoch."""

    def __init__(self) -> None:
        self.bar: Progress | None = None
        self.task: Any = None
        self.epochs = 0
        self.steps_per_epoch = 0

    def start(self, epochs: int, steps_per_epoch: int) -> None:
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                            TimeRemainingColumn(), console=console)
        self.bar.start()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar, self.task = None, None

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        if self.bar is None:
            return
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(f"epoch {epoch + 1}/{self.epochs}",
                                      total=self.steps_per_epoch, completed=steps_done, info="")

    def step(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        speed = record.get("img_per_s")
        info = (f"step {record['step']} loss {record['loss']:.4f} lr {record['lr']:.2e}"
                + (f" {speed:.0f} img/s" if speed else ""))
        self.bar.update(self.task, advance=1, info=info)

    def epoch_done(self, summary: dict[str, Any]) -> None:
        if self.bar is not None and summary.get("val_top1") is not None:
            self.bar.console.print(f"epoch {summary['epoch'] + 1}: train loss "
                                   f"{summary['train_loss']:.4f}, val top-1 "
                                   f"{100 * summary['val_top1']:.2f}%")
