"""Top-1 / top-5 accuracy of a model on a dataset from ``vitcompress.data``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vitcompress.data import DataError, num_classes
from vitcompress.measure.logits import unwrap_logits

__all__ = ["evaluate", "evaluate_top1", "unwrap_logits"]


def evaluate(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int = 64,
    device: str = "cpu",
    num_workers: int = 0,
) -> dict[str, Any]:
    """``{"top1", "top5", "images"}``: accuracies in percent, as timm's validate reports them.

    Top-5 becomes top-k with k = the model's number of outputs when it has fewer than 5 (so it is
    100 for two classes), as timm does. Correct predictions are counted over the whole set
    rather than averaging per-batch percentages, so a short last batch weighs what it should.
    The model runs in eval mode under ``inference_mode`` and is put back in its previous mode.
    """
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise DataError("the dataset is empty: nothing to evaluate")
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=str(device).startswith("cuda"),
    )
    was_training = model.training
    model.eval().to(device)
    correct1 = correct5 = total = 0
    try:
        classes: int | None = num_classes(dataset)
    except DataError:  # a plain dataset without .classes: no check against the model's outputs
        classes = None
    try:
        with torch.inference_mode():
            for images, labels in loader:
                images, labels = images.to(device), labels.to(device)
                logits = unwrap_logits(model(images))
                outputs = logits.shape[-1]
                if classes is not None and outputs < classes:
                    raise DataError(
                        f"the model predicts {outputs} classes but the data has "
                        f"{classes}: pass e.g. --model-arg num_classes={classes}"
                    )
                top = logits.topk(min(5, outputs), dim=-1).indices
                hits = top == labels[:, None]
                correct1 += int(hits[:, 0].sum())
                correct5 += int(hits.any(dim=-1).sum())
                total += labels.numel()
    finally:
        model.train(was_training)
    return {"top1": 100.0 * correct1 / total, "top5": 100.0 * correct5 / total, "images": total}


@torch.no_grad()
def evaluate_top1(model: nn.Module, loader: DataLoader, accelerator: Any) -> float:
    """Top-1 accuracy as a fraction over a loader prepared by ``accelerator`` (several
    processes: each sees its shard, and the predictions are gathered)."""
    was_training = model.training
    model.eval()
    correct = total = 0
    for images, labels in loader:
        with accelerator.autocast():
            logits = unwrap_logits(model(images))
        predictions, labels = accelerator.gather_for_metrics((logits.argmax(-1), labels))
        correct += int((predictions == labels).sum())
        total += int(labels.numel())
    model.train(was_training)
    return correct / max(total, 1)
