"""Selecting tokens: keep counts, top-k that keeps original indices, gather and scatter."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# How tokens are chosen: by the variant's scores, or uniformly at random (same counts; ablation).
SELECTION_POLICIES = ("score", "random")


def keep_count(n: int, keep: float, mode: str) -> int:
    """How many of ``n`` tokens to keep.

    ``mode="floor"``: DynamicViT/dTPS, where ``n`` is the ORIGINAL patch count and ``keep`` the
    cumulative ratio rho**s (``int(N0 * rho**s)``). ``mode="ceil"``: EViT/eTPS, ``ceil(rho * n)``
    of the ``n`` tokens present now. At least one token is always kept.
    """
    if mode == "floor":
        k = int(n * keep)
    elif mode == "ceil":
        k = math.ceil(keep * n)
    else:
        raise ValueError(f"unknown keep-count mode {mode!r}")
    return max(1, min(n, k))


def split_by_score(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Split ``(B, N)`` scores into the indices of the ``k`` best and of the rest.

    Both come in descending score order (the order DynamicViT and EViT use); they are indices into
    ``N``, so callers can map them back to grid positions. A stable sort makes ties deterministic.
    """
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return order[:, :k], order[:, k:]


def gather_tokens(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, index[b, i]]`` for ``x`` of shape ``(B, N, C)`` and ``index`` of shape ``(B, k)``."""
    return torch.gather(x, 1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def scatter_tokens(tokens: Tensor, index: Tensor, n: int) -> Tensor:
    """Put ``(B, k, C)`` tokens at positions ``index`` of a zero-filled ``(B, n, C)`` tensor (pad)."""
    out = tokens.new_zeros(tokens.shape[0], n, tokens.shape[-1])
    return out.scatter(1, index.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]), tokens)
