"""Attention with a key mask, for training with soft-dropped tokens (DynamicViT's form)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def masked_softmax(logits: Tensor, keep_mask: Tensor, eps: float = 1e-6) -> Tensor:
    """Softmax over keys where dropped keys (``keep_mask == 0``) get no weight.

    ``logits`` is ``(B, H, Nq, Nk)``, ``keep_mask`` is ``(B, Nk)`` (1 = kept, prefix tokens 1).
    The diagonal is always allowed so a dropped token still attends to itself and the row never
    becomes empty: ``G_ij = p_j + (1 - p_j) [i == j]``. Computed in float32 with the max over all
    keys, as DynamicViT does, so gradients reach the mask through the straight-through estimator.
    """
    n_q, n_k = logits.shape[-2], logits.shape[-1]
    policy = keep_mask.float().reshape(keep_mask.shape[0], 1, 1, n_k)
    eye = torch.eye(n_q, n_k, dtype=torch.float32, device=logits.device).reshape(1, 1, n_q, n_k)
    allowed = policy + (1.0 - policy) * eye
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    weights = shifted.exp() * allowed
    probs = (weights + eps / n_k) / (weights.sum(dim=-1, keepdim=True) + eps)
    return probs.to(logits.dtype)


def add_attention_bias(logits: Tensor, bias: Tensor | None) -> Tensor:
    """``logits`` with an SDPA-style ``attn_mask`` applied: a float one added (a relative-position
    bias), a boolean one (True = may attend) as -inf where False."""
    if bias is None:
        return logits
    if bias.dtype == torch.bool:
        return logits.masked_fill(~bias, float("-inf"))
    return logits + bias


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep_mask: Tensor,
    scale: float | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Multi-head attention ``(B, H, N, D)`` with a key mask; returns the output and the probs.
    ``bias``: the attention's own ``attn_mask`` (a relative-position bias), applied to the
    logits before the key mask, as in the model."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = add_attention_bias((q @ k.transpose(-2, -1)) * scale, bias)
    probs = masked_softmax(logits, keep_mask)
    return probs @ v, probs
