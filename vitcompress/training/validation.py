"""A fine-tuning run's validation: top-1 (or, for segmentation, mean IoU) of the model and of its
EMA on the validation set, which ``--val-images`` may bound (:func:`spread_subset`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from vitcompress.data import num_classes
from vitcompress.data.segmentation import SEGMENTATION
from vitcompress.training.config import FinetuneConfig
from vitcompress.training.evaluate import (
    EvalProgress,
    evaluate,
    evaluate_miou,
    evaluate_segmentation,
    evaluate_top1,
)
from vitcompress.training.interrupt import StopSignals

__all__ = ["validation_metrics", "validation_miou", "validation_top1"]


def _one_process(
    evaluation: Callable[..., dict[str, float]],
    metric: str,
    net: nn.Module,
    accelerator: Any,
    val_set: Dataset | None,
    config: FinetuneConfig,
    signals: StopSignals,
    progress: EvalProgress | None,
) -> float:
    """``metric`` as a fraction from the project's own ``evaluation`` (the numbers of the
    ``eval`` command), stopped at once by a signal (nothing there can be torn), with
    ``progress`` told of each batch."""
    with signals.immediate():
        result = evaluation(
            accelerator.unwrap_model(net),
            val_set,
            batch_size=config.batch_size,
            device=str(accelerator.device),
            num_workers=config.num_workers,
            progress=progress,
        )
    return result[metric] / 100


def validation_top1(
    net: nn.Module,
    accelerator: Any,
    val_set: Dataset | None,
    batches: Any,
    config: FinetuneConfig,
    signals: StopSignals,
    progress: EvalProgress | None = None,
) -> float:
    """Top-1 as a fraction. One process: :func:`_one_process` with ``evaluate``; several: a loop
    over ``batches`` (the prepared loader with a safe point per batch) that gathers predictions
    from every process."""
    if accelerator.num_processes == 1:
        return _one_process(evaluate, "top1", net, accelerator, val_set, config, signals, progress)
    return evaluate_top1(net, batches, accelerator)


def validation_miou(
    net: nn.Module,
    accelerator: Any,
    val_set: Dataset,
    batches: Any,
    config: FinetuneConfig,
    signals: StopSignals,
    progress: EvalProgress | None = None,
) -> float:
    """Mean IoU as a fraction, as :func:`validation_top1` measures top-1: one process, the
    ``eval --task segmentation`` numbers; several, the per-pixel predictions gathered."""
    if accelerator.num_processes == 1:
        return _one_process(
            evaluate_segmentation, "miou", net, accelerator, val_set, config, signals, progress
        )
    return evaluate_miou(net, batches, accelerator, num_classes(val_set))


def validation_metrics(
    models: dict[str, nn.Module],
    accelerator: Any,
    val_set: Dataset,
    batches: Callable[[], Any],
    config: FinetuneConfig,
    signals: StopSignals,
    progress: Callable[[], EvalProgress],
) -> dict[str, float]:
    """``val_top1`` (segmentation: ``val_miou``) of each model, named by its suffix in
    ``models`` (``""`` for the model, ``"_ema"`` for its EMA). ``batches()`` gives the prepared
    loader with its safe points, ``progress()`` a fresh progress for each evaluation."""
    measure, name = validation_top1, "val_top1"
    if config.task == SEGMENTATION:
        measure, name = validation_miou, "val_miou"
    return {
        f"{name}{suffix}": measure(
            net, accelerator, val_set, batches(), config, signals, progress()
        )
        for suffix, net in models.items()
    }
