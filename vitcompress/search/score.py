"""Scoring a candidate without fine-tuning: how closely it follows the base on calibration images.

The base's logits are computed once; each candidate is compressed from one capture of the base
(copied, so the capture is made once) and run in eval mode on the same images. Reported per
candidate: the KL divergence of its logits from the base's (temperature 1, mean over images), its
top-1 agreement with the base, and its accuracy where the images have labels. The score that
ranks candidates is ``-KL``: higher is better, 0 is the base itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from vitcompress.analysis.capture import CapturedGraph
from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.compression import capture_and_map, compress_copy
from vitcompress.compilation.plan import resolve_variant
from vitcompress.data import DataError
from vitcompress.measure.logits import unwrap_logits
from vitcompress.variants import Variant

MIN_CALIB_IMAGES = 8  # below this a KL mean says little, and the predictor warm-up has no data


def calibration_images(dataset: Dataset, count: int, seed: int = 0) -> tuple[Tensor, Tensor | None]:
    """``count`` images drawn without replacement (fixed seed) from ``dataset``, stacked, and
    their labels (None when the dataset has none)."""
    size = len(dataset)  # type: ignore[arg-type]
    if count < MIN_CALIB_IMAGES:
        raise DataError(
            f"--calib-images {count} is too few to score candidates; give at least "
            f"{MIN_CALIB_IMAGES}"
        )
    if size < count:
        raise DataError(
            f"the calibration data has {size} images, fewer than --calib-images {count}; lower "
            "--calib-images or give more data"
        )
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count]
    images, labels = [], []
    for index in order.tolist():
        item = dataset[index]
        if isinstance(item, tuple | list):
            images.append(item[0])
            labels.append(item[1] if len(item) > 1 else None)
        else:
            images.append(item)
            labels.append(None)
    stacked = torch.stack(images)
    if any(label is None for label in labels):
        return stacked, None
    return stacked, torch.as_tensor([int(label) for label in labels])


@torch.no_grad()
def logits_of(model: nn.Module, images: Tensor, batch_size: int) -> Tensor:
    """The model's logits (eval mode) on ``images``, batch by batch, as float32 on the CPU."""
    was_training = model.training
    model.eval()
    device = next(iter(model.parameters())).device
    try:
        out = [
            unwrap_logits(model(images[i : i + batch_size].to(device))).float().cpu()
            for i in range(0, len(images), batch_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(out)


def agreement_metrics(
    logits: Tensor, base_logits: Tensor, labels: Tensor | None
) -> dict[str, float | None]:
    """KL(base || candidate), top-1 agreement with the base, accuracy (None without labels)."""
    kl = F.kl_div(
        F.log_softmax(logits, dim=-1),
        F.log_softmax(base_logits, dim=-1),
        reduction="batchmean",
        log_target=True,
    )
    predicted = logits.argmax(-1)
    agreement = float((predicted == base_logits.argmax(-1)).float().mean())
    accuracy = None if labels is None else float((predicted == labels).float().mean())
    kl_value = max(0.0, float(kl))
    return {"kl": kl_value, "agreement": agreement, "accuracy": accuracy, "score": -kl_value}


@dataclass
class Calibration:
    images: Tensor
    labels: Tensor | None
    base_logits: Tensor


class CandidateBuilder:
    """Compressed models of one base, from one capture of it."""

    def __init__(
        self,
        model: nn.Module,
        input_size: tuple[int, ...],
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.model = model.eval()
        self.input_size = input_size
        self.settings = settings  # every named method's settings (a search's kept_multiple)
        captured, model_map = capture_and_map(self.model, input_size)
        self._captured: CapturedGraph = captured
        self.model_map: ModelMap = model_map

    def build(self, variant: str | Variant, keep: list[float], locs: list[int]) -> nn.Module:
        """The base compressed by ``variant`` (a candidate's name, made with the builder's
        settings, or the method itself)."""
        method = resolve_variant(variant, None if isinstance(variant, Variant) else self.settings)
        compressed = compress_copy(
            self.model, self._captured, self.model_map, self.input_size, method, keep, locs, "score"
        )
        return compressed.eval()


def score_model(
    model: nn.Module, calibration: Calibration, batch_size: int
) -> dict[str, float | None]:
    logits = logits_of(model, calibration.images, batch_size)
    if not torch.isfinite(logits).all():
        return {"kl": math.inf, "agreement": 0.0, "accuracy": None, "score": -math.inf}
    return agreement_metrics(logits, calibration.base_logits, calibration.labels)


ScoreFn = Callable[[Any], dict[str, Any]]
