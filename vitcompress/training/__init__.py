"""Fine-tuning compressed models: losses, optimizer and schedule, training checkpoints."""

from vitcompress.training.checkpoint import find_latest, load_checkpoint, save_checkpoint
from vitcompress.training.losses import DistillationTaps, FinetuneLoss, LossWeights
from vitcompress.training.optim import build_optimizer, build_scheduler, default_lr, param_groups

__all__ = [
    "DistillationTaps",
    "FinetuneLoss",
    "LossWeights",
    "build_optimizer",
    "build_scheduler",
    "default_lr",
    "find_latest",
    "load_checkpoint",
    "param_groups",
    "save_checkpoint",
]
