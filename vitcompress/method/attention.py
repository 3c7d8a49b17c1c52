"""Attention computed explicitly: with a key mask, for training with soft-dropped tokens
(DynamicViT's form), and with its probabilities kept, for a score that needs them all."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# exp(30) ~ 1.1e13: a dropped key's weight and its gradient to the mask (that weight times the
# upstream gradient) stay finite in float32 (up to ~3.4e38) for upstream gradients up to ~1e25;
# at e^80 an upstream gradient of 1e4 already overflowed (a sharpened SAM's position term).
_MAX_EXPONENT = 30.0


def masked_softmax(logits: Tensor, keep_mask: Tensor, eps: float = 1e-6) -> Tensor:
    """Softmax over keys where dropped keys (``keep_mask == 0``) get no weight.

    ``logits`` is ``(B, H, Nq, Nk)``, ``keep_mask`` is ``(B, Nk)`` (1 = kept, prefix tokens 1).
    The diagonal is always allowed so a dropped token still attends to itself and the row never
    becomes empty: ``G_ij = p_j + (1 - p_j) [i == j]``. Computed in float32, so gradients reach
    the mask through the straight-through estimator as in DynamicViT.

    The logits are shifted by the max over the *allowed* keys, where DynamicViT takes it over all
    keys: a dropped key whose logit stands ~90 above the kept ones (a high-norm outlier token) would
    otherwise underflow every allowed weight to 0 and turn the row into a uniform ``1 / Nk`` over
    all keys, dropped ones included, with no error. The shift cancels in the softmax, so where
    nothing underflows the two differ only in the ``eps`` term.
    """
    n_q, n_k = logits.shape[-2], logits.shape[-1]
    policy = keep_mask.float().reshape(keep_mask.shape[0], 1, 1, n_k)
    eye = torch.eye(n_q, n_k, dtype=torch.float32, device=logits.device).reshape(1, 1, n_q, n_k)
    allowed = policy + (1.0 - policy) * eye
    dtype, logits = logits.dtype, logits.float()
    row_max = logits.masked_fill(allowed == 0, float("-inf")).amax(dim=-1, keepdim=True)
    # A row whose allowed keys are all -inf (a boolean attn_mask) has no finite max to shift by.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    # A dropped key may now stand far above the shift; capping its exponent keeps its weight
    # finite (so ``0 * weight`` is 0, not NaN) and its gradient to the mask finite. Only dropped
    # keys reach the cap (the allowed ones are at most 0), and their weight is multiplied by 0.
    shifted = (logits - row_max.detach()).clamp(max=_MAX_EXPONENT)
    weights = shifted.exp() * allowed
    probs = (weights + eps / n_k) / (weights.sum(dim=-1, keepdim=True) + eps)
    return probs.to(dtype)


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


def attention_with_probs(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Attention ``(B, H, N, D)`` and its probabilities from one ``q @ k^T``: for a score read off
    every query's attention (no cls row), where the fused kernel and a second ``q @ k^T`` for
    the score would cost 1.5 times the attention. The softmax runs in at least float32 (half
    precision is widened); the probabilities are returned so, the output in ``v``'s dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    wide = torch.promote_types(q.dtype, torch.float32)  # half precision up, float64 kept
    logits = add_attention_bias((q.to(wide) @ k.to(wide).transpose(-2, -1)) * scale, bias)
    probs = logits.softmax(dim=-1)
    return probs.to(v.dtype) @ v, probs
