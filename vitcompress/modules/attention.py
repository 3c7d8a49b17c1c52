"""Replacements for attention cores found in the graph.

Each hook does what the original node did, plus, when asked:
- ``keep_mask``: mask dropped keys (training of predictor-based variants, DynamicViT's form);
  applied only where the keys are the block's own tokens (a spatial-reduction attention attends
  to pooled keys, whose masking happens on the grid before the reduction);
- ``score=True``: also return a per-token score for eTPS/EViT: the cls row, head-mean, or without
  a cls token the mean attention each token receives; with ``keys=True`` instead the keys
  averaged over heads, ``(B, N, D)``, ToMe's matching metric;
- ``sizes`` (B, N): how many patches each token stands for after ToMe's merges; ``log(size)`` is
  added to the key logits (proportional attention), so a merged token draws the attention its
  patches would have drawn together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitcompress.method import (
    KeyPool,
    attention_with_probs,
    cls_attention_score,
    key_scores_to_tokens,
    masked_attention,
    masked_softmax,
    received_attention_score,
    score_from_probs,
)


class _ScoringHook(nn.Module):
    def __init__(
        self,
        prefix_tokens: int,
        has_cls: bool,
        score: bool,
        grid: tuple[int, ...] | None = None,
        keys: bool = False,
        key_pool: KeyPool | None = None,
    ) -> None:
        super().__init__()
        self.prefix_tokens = prefix_tokens
        self.has_cls = has_cls
        self.score = score
        self.keys = keys  # with score: give the head-mean keys instead of a per-token score
        self.grid = tuple(grid) if grid is not None else None
        # What pools the keys (kernel, stride, padding): which tokens each pooled key reads.
        self.key_pool = tuple(tuple(v) for v in key_pool) if key_pool is not None else None

    def extra_repr(self) -> str:
        keys = ", keys=True" if self.keys else ""
        pool = f", key_pool={self.key_pool}" if self.key_pool is not None else ""
        return (
            f"prefix_tokens={self.prefix_tokens}, has_cls={self.has_cls}, score={self.score}"
            f"{keys}{pool}"
        )

    def _scores_every_query(self) -> bool:
        """Whether the score is read off every query's attention (no cls row to read it from)."""
        return self.score and not self.keys and not self.has_cls

    def _score_qk(
        self,
        q: Tensor,
        k: Tensor,
        scale: float | None,
        positions: Tensor | None = None,
        bias: Tensor | None = None,
    ) -> Tensor:
        """The score from the attention the model computes: ``bias`` is its ``attn_mask``."""
        if self.has_cls:
            scores = cls_attention_score(q, k, self.prefix_tokens, scale, bias)
        else:
            scores = received_attention_score(q, k, self.prefix_tokens, scale, bias)
        return self._per_token(scores, q.shape[-2], positions)

    def _per_token(self, scores: Tensor, query_tokens: int, positions: Tensor | None) -> Tensor:
        """Pooled keys (spatial-reduction attention) score the cells they cover."""
        if scores.shape[1] == query_tokens - self.prefix_tokens or self.grid is None:
            return scores
        if len(self.grid) != 2:
            raise NotImplementedError(
                f"scores of pooled keys on a {len(self.grid)}-D token grid {self.grid} "
                "(only a 2-D grid's pooled keys are spread to the tokens they cover)"
            )
        return key_scores_to_tokens(scores, self.grid, positions, self.key_pool)


def _applies(keep_mask: Tensor | None, key_tokens: int) -> bool:
    return keep_mask is not None and keep_mask.shape[1] == key_tokens


def _size_bias(sizes: Tensor, key_tokens: int, dtype: torch.dtype) -> Tensor:
    """``log(size)`` of every key as an additive logit bias ``(B, 1, 1, N)``."""
    if sizes.shape[1] != key_tokens:
        raise NotImplementedError(
            f"token sizes for {sizes.shape[1]} tokens but {key_tokens} keys (pooled keys)"
        )
    return sizes.log().to(dtype)[:, None, None, :]


def _with_bias(attn_mask: Tensor | None, bias: Tensor, dtype: torch.dtype) -> Tensor:
    """An SDPA ``attn_mask`` that also adds ``bias``; a boolean mask becomes 0 / -inf first."""
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
            ~attn_mask, float("-inf")
        )
    return attn_mask + bias


class SDPAHook(_ScoringHook):
    """Stands in for ``F.scaled_dot_product_attention(q, k, v, ...)`` on (B, H, N, D) tensors."""

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        keep_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        positions: Tensor | None = None,
        sizes: Tensor | None = None,
        **kwargs,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if sizes is not None:
            if is_causal:
                raise NotImplementedError("token sizes combined with causal attention")
            attn_mask = _with_bias(attn_mask, _size_bias(sizes, k.shape[-2], q.dtype), q.dtype)
        if _applies(keep_mask, k.shape[-2]):
            if is_causal:
                raise NotImplementedError("a key mask combined with causal attention")
            # The model's own mask (a relative-position bias) first, then the key mask.
            out, probs = masked_attention(q, k, v, keep_mask, scale, attn_mask)
            if dropout_p > 0.0:
                out = F.dropout(probs, dropout_p, self.training) @ v
        elif self._scores_every_query() and dropout_p == 0.0 and not is_causal and not kwargs:
            # Without a cls row the score needs every query's probabilities: compute them once
            # and the output from them (2 N^2 D), not the fused kernel and a second q k^T (3).
            # The score stays in the probabilities' float32, as the cls row's does: a
            # half-precision score would tie tokens the float32 one orders.
            out, probs = attention_with_probs(q, k, v, scale, attn_mask)
            scores = score_from_probs(probs, self.prefix_tokens, has_cls=False)
            return out, self._per_token(scores, q.shape[-2], positions)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                **kwargs,
            )
        if not self.score:
            return out
        if self.keys:
            return out, k.mean(dim=1)
        return out, self._score_qk(q, k, scale, positions, attn_mask)


class SoftmaxHook(_ScoringHook):
    """Stands in for the softmax of an explicit ``q @ k^T`` (or einsum) attention."""

    def forward(
        self,
        logits: Tensor,
        keep_mask: Tensor | None = None,
        positions: Tensor | None = None,
        sizes: Tensor | None = None,
        keys: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``keys``: the right operand of ``q @ k^T``, ``(B, H, D, N)``, when the keys are asked."""
        if sizes is not None:
            if logits.dim() != 4:
                raise NotImplementedError(f"token sizes on {logits.dim()}-D attention logits")
            logits = logits + _size_bias(sizes, logits.shape[-1], logits.dtype)
        if _applies(keep_mask, logits.shape[-1]):
            probs = masked_softmax(logits, keep_mask)
        else:
            probs = logits.softmax(dim=-1)
        if not self.score:
            return probs
        if self.keys:
            if keys is None or keys.dim() != 4:
                raise NotImplementedError("the keys of a (B, H, D, N) query-key product")
            return probs, keys.transpose(-2, -1).mean(dim=1)
        scores = score_from_probs(probs, self.prefix_tokens, self.has_cls)
        return probs, self._per_token(scores, logits.shape[-2], positions)


class MHAHook(_ScoringHook):
    """Stands in for a call of an ``nn.MultiheadAttention`` module, which hides its attention
    weights: with a mask or a score requested it recomputes attention from the module's own
    projections. The module is passed in (not owned) so its state-dict keys stay where they were.
    """

    def forward(
        self,
        mha: nn.MultiheadAttention,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        keep_mask: Tensor | None = None,
        positions: Tensor | None = None,
        sizes: Tensor | None = None,
        **kwargs,
    ):
        if keep_mask is None and sizes is None and not self.score:
            return mha(query, key, value, **kwargs)
        if (
            not mha._qkv_same_embed_dim
            or mha.bias_k is not None
            or mha.add_zero_attn
            or kwargs.get("attn_mask") is not None
            or kwargs.get("key_padding_mask") is not None
        ):
            raise NotImplementedError(
                "nn.MultiheadAttention with separate k/v dims, bias_k, zero attention or masks"
            )
        if not mha.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, n, c = query.shape
        heads = mha.num_heads
        w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
        b_q, b_k, b_v = (
            mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None, None, None)
        )
        q = F.linear(query, w_q, b_q).reshape(b, n, heads, c // heads).transpose(1, 2)
        k = F.linear(key, w_k, b_k).reshape(b, -1, heads, c // heads).transpose(1, 2)
        v = F.linear(value, w_v, b_v).reshape(b, -1, heads, c // heads).transpose(1, 2)
        scores = None  # a score read off the attention computed here, where one is
        if _applies(keep_mask, k.shape[-2]):
            y, probs = masked_attention(q, k, v, keep_mask)
            if mha.dropout > 0.0 and self.training:
                y = F.dropout(probs, mha.dropout) @ v
        else:
            dropout = mha.dropout if self.training else 0.0
            bias = None if sizes is None else _size_bias(sizes, k.shape[-2], q.dtype)
            if self._scores_every_query() and dropout == 0.0:  # as SDPAHook: one q k^T
                y, probs = attention_with_probs(q, k, v, None, bias)
                scores = score_from_probs(probs, self.prefix_tokens, has_cls=False)
                scores = self._per_token(scores, n, positions)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout)
        out = mha.out_proj(y.transpose(1, 2).reshape(b, n, c))
        if not mha.batch_first:
            out = out.transpose(0, 1)
        if not self.score:
            return out, None
        if self.keys:
            return out, None, k.mean(dim=1)
        if scores is None:
            scores = self._score_qk(q, k, None, positions)
        return out, None, scores
