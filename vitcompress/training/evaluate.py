"""Top-1 / top-5 accuracy of a model on a dataset from ``vitcompress.data``; for a segmentation
set, mean IoU and pixel accuracy from a confusion matrix over all pixels."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from vitcompress.data import DataError, num_classes
from vitcompress.data.config import DataConfig, mismatch_note
from vitcompress.measure.logits import unwrap_logits
from vitcompress.status import warn

__all__ = [
    "EvalProgress",
    "confusion_matrix",
    "evaluate",
    "evaluate_miou",
    "evaluate_segmentation",
    "evaluate_top1",
    "segmentation_scores",
    "spread_subset",
    "unwrap_logits",
]


class EvalProgress:
    """What an evaluation reports as it goes (a progress bar); this base class shows nothing."""

    def start(self, images: int) -> None:
        """Before the first batch: ``images`` will be evaluated."""

    def advance(self, images: int) -> None:
        """After each batch of ``images``."""

    def stop(self) -> None:
        """After the last batch, also when the evaluation fails or is interrupted."""


def spread_subset(dataset: Dataset, images: int | None) -> Dataset:
    """``images`` images spread evenly over ``dataset`` (indices ``i * len // images``, in
    order), so that a folder sorted by class still gives every class its share; the whole set
    when ``images`` is None or not smaller. ``num_classes`` reads through the subset."""
    size = len(dataset)  # type: ignore[arg-type]
    if images is None or images >= size:
        return dataset
    return Subset(dataset, [i * size // images for i in range(images)])


def _head_mismatch(outputs: int, classes: int) -> DataError:
    return DataError(
        f"the model predicts {outputs} classes but the data has {classes}: fine-tune it on "
        f"this data first (finetune gives it a {classes}-class head), or give its base "
        f"{classes} outputs (timm or a model file: --model-arg num_classes={classes}; "
        f"HuggingFace: a ...ForImageClassification with num_labels={classes}) and compress that"
    )


def _class_scores(output: Any, images: torch.Tensor) -> torch.Tensor:
    """The (B, classes) scores of a classifier's output; anything else (a token grid, a
    feature map, per-token scores) is refused in one line naming its shape: scored as classes,
    its last dimension would give nonsense."""
    logits = unwrap_logits(output)
    batch = images.shape[0]
    if logits.dim() != 2 or logits.shape[0] != batch:
        raise DataError(
            f"the model returns {tuple(logits.shape)} for {batch} images, not class scores "
            f"({batch}, classes): it is not a classifier (a model returning tokens or a map "
            "is evaluated by its task, e.g. --task segmentation, or needs a head)"
        )
    return logits


def _loader(dataset: Dataset, batch_size: int, device: str, num_workers: int) -> DataLoader:
    """The evaluation loader: in order, pinned for CUDA; an empty set is refused."""
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise DataError("the dataset is empty: nothing to evaluate")
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=str(device).startswith("cuda"),
    )


def _classes_or_none(dataset: Dataset) -> int | None:
    """The data's classes; None for a plain dataset without ``.classes`` (nothing to check the
    model's outputs against)."""
    try:
        return num_classes(dataset)
    except DataError:
        return None


def _check_preprocessing(model: nn.Module, dataset: Dataset) -> None:
    """Warn (one line) when the set's images are normalised otherwise than ``model`` states:
    scores on such inputs are wrong without anything failing (a set from ``build_dataset``
    alone uses ImageNet's statistics, whatever the model)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    config = getattr(dataset, "data_config", None)
    if isinstance(config, DataConfig):
        note = mismatch_note(model, config)
        if note is not None:
            warn(note)


Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


@contextlib.contextmanager
def _evaluation(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int,
    device: str,
    num_workers: int,
    progress: EvalProgress | None,
) -> Iterator[Batches]:
    """The set's (images, labels) batches on ``device``, in order; meanwhile ``model`` runs in
    eval mode on ``device`` under ``inference_mode`` and is put back in its previous mode after,
    also on an error. ``progress`` hears of each batch once the caller has scored it."""
    loader = _loader(dataset, batch_size, device, num_workers)
    _check_preprocessing(model, dataset)
    was_training = model.training
    model.eval().to(device)
    progress = progress or EvalProgress()

    def batches(shown: EvalProgress) -> Batches:
        for images, labels in loader:
            yield images.to(device), labels.to(device)
            shown.advance(labels.shape[0])

    progress.start(len(dataset))  # type: ignore[arg-type]
    try:
        with torch.inference_mode():
            yield batches(progress)
    finally:
        model.train(was_training)
        progress.stop()


def evaluate(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int = 64,
    device: str = "cpu",
    num_workers: int = 0,
    exact_head: bool = False,
    progress: EvalProgress | None = None,
) -> dict[str, Any]:
    """``{"top1", "top5", "images"}``: accuracies in percent, as timm's validate reports them.

    Top-5 becomes top-k with k = the model's number of outputs when it has fewer than 5 (so it is
    100 for two classes), as timm does. Correct predictions are counted over the whole set
    rather than averaging per-batch percentages, so a short last batch weighs what it should.
    The model runs in eval mode under ``inference_mode`` and is put back in its previous mode.
    A model with fewer outputs than the data's classes is refused at the first batch; with
    ``exact_head``, one with more too (its extra classes would be scored as wrong answers).
    ``progress`` hears of the images as they are done.
    """
    classes = _classes_or_none(dataset)
    correct1 = correct5 = total = 0
    with _evaluation(model, dataset, batch_size, device, num_workers, progress) as batches:
        for images, labels in batches:
            logits = _class_scores(model(images), images)
            outputs = logits.shape[-1]
            if classes is not None and (outputs < classes or (exact_head and outputs != classes)):
                raise _head_mismatch(outputs, classes)
            top = logits.topk(min(5, outputs), dim=-1).indices
            hits = top == labels[:, None]
            correct1 += int(hits[:, 0].sum())
            correct5 += int(hits.any(dim=-1).sum())
            total += labels.numel()
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
            logits = _class_scores(model(images), images)
        predictions, labels = accelerator.gather_for_metrics((logits.argmax(-1), labels))
        correct += int((predictions == labels).sum())
        total += int(labels.numel())
    model.train(was_training)
    return correct / max(total, 1)


# ---------------------------------------------------------------------------------------------
# Segmentation


def confusion_matrix(predictions: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """(classes, classes) int64 counts of pixels: row = label, column = prediction. Labels
    outside ``[0, classes)`` (an ignore index such as 255) are not counted."""
    labels, predictions = labels.reshape(-1).long(), predictions.reshape(-1).long()
    valid = (labels >= 0) & (labels < classes)
    index = labels[valid] * classes + predictions[valid].clamp(0, classes - 1)
    return torch.bincount(index, minlength=classes * classes).reshape(classes, classes).cpu()


def segmentation_scores(confusion: torch.Tensor) -> dict[str, Any]:
    """``{"miou", "pixel_acc", "iou", "pixels"}`` from a confusion matrix (row = label).

    IoU of class c = TP / (TP + FP + FN); the mean is over the classes present, those with a
    nonzero union (in the labels or in the predictions: a class predicted but absent from the
    labels scores 0; one neither labelled nor predicted is left out, None in ``iou``), background
    included. ``miou`` and ``pixel_acc`` (correct pixels over all) in percent.
    """
    confusion = confusion.double()
    true_positive = confusion.diag()
    union = confusion.sum(0) + confusion.sum(1) - true_positive
    present = union > 0
    iou = torch.where(present, true_positive / union.clamp(min=1), torch.nan)
    total = float(confusion.sum())
    return {
        "miou": 100.0 * float(iou[present].mean()) if bool(present.any()) else 0.0,
        "pixel_acc": 100.0 * float(true_positive.sum()) / total if total else 0.0,
        "iou": [
            None if not bool(p) else 100.0 * float(v) for v, p in zip(iou, present, strict=True)
        ],
        "pixels": int(total),
    }


def _pixel_logits(output: Any, labels: torch.Tensor, classes: int | None) -> torch.Tensor:
    """The (B, K, H, W) logits of a segmentation model's output, checked against the labels
    (B, H, W): one line naming the shapes otherwise."""
    logits = unwrap_logits(output)
    if logits.dim() != 4 or logits.shape[-2:] != labels.shape[-2:]:
        raise DataError(
            f"the model returns {tuple(logits.shape)}, not per-pixel logits (B, classes, "
            f"{labels.shape[-2]}, {labels.shape[-1]}) matching the labels: --task segmentation "
            "needs a segmentation model"
        )
    if classes is not None and logits.shape[1] < classes:
        raise DataError(
            f"the model predicts {logits.shape[1]} classes per pixel but the data has "
            f"{classes}: pass e.g. --model-arg num_classes={classes}"
        )
    return logits


def evaluate_segmentation(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int = 64,
    device: str = "cpu",
    num_workers: int = 0,
    progress: EvalProgress | None = None,
) -> dict[str, Any]:
    """``{"miou", "pixel_acc", "iou", "pixels", "images"}`` of a model returning (B, K, H, W)
    logits on a set of (image, labels (H, W)) pairs (:func:`segmentation_scores`; percent).

    The confusion matrix covers K = the larger of the model's outputs and the data's classes.
    The model runs in eval mode under ``inference_mode`` and is put back in its previous mode.
    """
    classes = _classes_or_none(dataset)
    confusion: torch.Tensor | None = None
    images_seen = 0
    with _evaluation(model, dataset, batch_size, device, num_workers, progress) as batches:
        for images, labels in batches:
            logits = _pixel_logits(model(images), labels, classes)
            size = max(logits.shape[1], classes or 0)
            counts = confusion_matrix(logits.argmax(1), labels, size)
            confusion = counts if confusion is None else confusion + counts
            images_seen += labels.shape[0]
    assert confusion is not None
    return {**segmentation_scores(confusion), "images": images_seen}


@torch.no_grad()
def evaluate_miou(model: nn.Module, loader: DataLoader, accelerator: Any, classes: int) -> float:
    """Mean IoU as a fraction over a loader prepared by ``accelerator`` (several processes:
    each sees its shard, and the per-pixel predictions are gathered, as ``evaluate_top1``
    gathers its predictions, so the samples that pad the last shard count once)."""
    was_training = model.training
    model.eval()
    confusion: torch.Tensor | None = None
    for images, labels in loader:
        with accelerator.autocast():
            logits = _pixel_logits(model(images), labels, classes)
        size = max(logits.shape[1], classes)
        predictions, labels = accelerator.gather_for_metrics((logits.argmax(1), labels))
        counts = confusion_matrix(predictions, labels, size)
        confusion = counts if confusion is None else confusion + counts
    model.train(was_training)
    if confusion is None:
        return 0.0
    return segmentation_scores(confusion)["miou"] / 100
