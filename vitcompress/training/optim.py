"""AdamW with DeiT's decay groups and a per-step cosine schedule with linear warm-up."""

from __future__ import annotations

import math

import torch
from torch import nn

BASE_LR = 2.5e-4  # per 1024 images (the paper's lr = batch / 1024 * 2.5e-4)
NO_DECAY_NAMES = ("pos_embed", "cls_token", "dist_token", "reg_token")


def default_lr(batch_size: int, accumulation: int = 1, world_size: int = 1) -> float:
    """The linear scaling rule on the effective batch (per-process batch x accumulation x ranks)."""
    return batch_size * accumulation * world_size / 1024 * BASE_LR


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Norm weights, biases, position embeddings and prefix tokens are not decayed (DeiT/timm)."""
    return param.ndim <= 1 or any(key in name for key in NO_DECAY_NAMES)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if no_weight_decay(name, param) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.05) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr)


def cosine_with_warmup(step: int, total_steps: int, warmup_steps: int,
                       min_factor: float = 0.0) -> float:
    """LR factor at optimizer step ``step`` (0-based): linear from 1/warmup up to 1, then cosine."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, total_steps, warmup_steps))
