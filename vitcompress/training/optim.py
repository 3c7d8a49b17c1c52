"""AdamW with DeiT's decay groups and a per-step cosine schedule with linear warm-up."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from vitcompress.compilation.weight_decay import NO_WEIGHT_DECAY_ATTRIBUTE, declared_no_weight_decay
from vitcompress.training.config import FinetuneConfig

BASE_LR = 2.5e-4  # per 1024 images (the paper's lr = batch / 1024 * 2.5e-4)
# Layers whose weights are ordinary weights even when their first dimension is 1 (a head with one
# output, a convolution with one filter).
_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.MultiheadAttention)


def default_lr(batch_size: int, accumulation: int = 1, world_size: int = 1) -> float:
    """The linear scaling rule on the effective batch (per-process batch x accumulation x ranks)."""
    return batch_size * accumulation * world_size / 1024 * BASE_LR


def no_weight_decay_rule(model: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """Which of ``model``'s parameters are not decayed (DeiT/timm): those of one dimension or
    less (norm weights, biases), and position tables and prefix tokens, taken from, in order:

    * the set recorded at compression time (``vitcompress/compilation/weight_decay.py``): the base's
      ``no_weight_decay()``, else the parameters the graph adds or concatenates to the tokens;
    * the model's own ``no_weight_decay()`` (names or ``fnmatch`` patterns, as in timm);
    * else, with no graph to read, parameters of a leading dimension of 1 held by a module
      itself rather than by one of torch's layers (the shape of a table broadcast over the batch).
    """
    recorded = getattr(model, NO_WEIGHT_DECAY_ATTRIBUTE, None)
    if recorded is not None:
        names = set(recorded)
        return lambda name, param: param.ndim <= 1 or name in names
    declared = declared_no_weight_decay(model)
    if declared is not None:
        return lambda name, param: param.ndim <= 1 or declared(name)
    layer_params = {
        id(p)
        for m in model.modules()
        if isinstance(m, _LAYERS)
        for p in m.parameters(recurse=False)
    }
    return lambda name, param: (
        param.ndim <= 1 or (param.shape[0] == 1 and id(param) not in layer_params)
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    skip = no_weight_decay_rule(model)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if skip(name, param) else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.05) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr)


def cosine_with_warmup(
    step: int, total_steps: int, warmup_steps: int, min_factor: float = 0.0
) -> float:
    """LR factor at optimizer step ``step`` (0-based): linear from 1/warmup up to 1, then cosine."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, total_steps, warmup_steps)
    )


@dataclass(frozen=True)
class RunLength:
    """A run's length in optimizer steps: per epoch, in all (``--max-steps``, else the epochs'),
    the epochs that spans, and the warm-up's."""

    steps_per_epoch: int
    total_steps: int
    epochs: int
    warmup_steps: int

    @classmethod
    def of(cls, batches_per_epoch: int, config: FinetuneConfig) -> RunLength:
        """The length of a run of ``config`` over ``batches_per_epoch`` batches per epoch."""
        per_epoch = math.ceil(batches_per_epoch / config.accum)
        total = config.max_steps or per_epoch * config.epochs
        warmup = round(config.warmup_epochs * per_epoch)
        return cls(per_epoch, total, math.ceil(total / per_epoch), warmup)

    def warning(self) -> str | None:
        """One line when the warm-up spans the whole run: the rate never peaks nor decays."""
        if not 0 < self.total_steps <= self.warmup_steps:
            return None
        return (
            f"warning: the warm-up ({self.warmup_steps} steps) is as long as the run "
            f"({self.total_steps} steps) or longer: the learning rate never reaches its peak "
            "and never decays; lower --warmup-epochs"
        )
