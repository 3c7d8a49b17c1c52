"""Parameter counting."""

from __future__ import annotations

from torch import nn


def count_params(model: nn.Module) -> int:
    """Number of scalar parameters in ``model``, trainable or frozen.

    ``Module.parameters()`` de-duplicates by identity, so a parameter shared between two submodules
    (tied embeddings, a reused projection) is counted once, as the papers do.
    """
    return sum(p.numel() for p in model.parameters())
