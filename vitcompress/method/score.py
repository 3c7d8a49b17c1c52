"""Token scores from attention: the cls row (EViT/eTPS) or the attention each token receives."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vitcompress.method.attention import add_attention_bias
from vitcompress.method.squeeze import product_outside_autocast


def cls_attention_score(
    q: Tensor, k: Tensor, prefix_tokens: int, scale: float | None = None, bias: Tensor | None = None
) -> Tensor:
    """Head-mean attention from the cls query (position 0) to every non-prefix key.

    ``q`` and ``k`` are ``(B, H, N, D)``. Only the cls row is computed, so a fused attention kernel
    never has to materialise the ``N x N`` matrix just to score tokens. ``bias``: the attention's
    own ``attn_mask`` (..., N, N) (a relative-position bias), so the score is the attention the
    model computes. Returned in float32, the softmax's dtype: a half-precision score would tie
    tokens the float32 one orders, and be cast back wherever it weighs tokens (EViT).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # The product in the inputs' dtype: upcasting k first would copy all of it (B, H, N, D) when
    # the model runs in half precision. The cls query is scaled first (as attention does), so the
    # half-precision product stays in range; only the (B, H, 1, N) row is taken to float32.
    logits = ((q[:, :, :1] * scale) @ k.transpose(-2, -1)).float()  # (B, H, 1, N)
    if bias is not None:
        logits = add_attention_bias(logits, bias[..., :1, :])
    probs = logits.softmax(dim=-1)
    return probs[:, :, 0, prefix_tokens:].mean(dim=1)


def received_attention_score(
    q: Tensor, k: Tensor, prefix_tokens: int, scale: float | None = None, bias: Tensor | None = None
) -> Tensor:
    """Mean attention each non-prefix key receives, over heads and queries (models without cls);
    ``bias`` as for :func:`cls_attention_score`; float32, as it."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = product_outside_autocast(q.float(), k.float().transpose(-2, -1)) * scale
    probs = add_attention_bias(logits, bias).softmax(dim=-1)
    return score_from_probs(probs, prefix_tokens, has_cls=False)


def score_from_probs(probs: Tensor, prefix_tokens: int, has_cls: bool) -> Tensor:
    """Score non-prefix keys from post-softmax attention ``(B, H, Nq, Nk)``.

    With a cls token: its row, averaged over heads. Without: the attention each key receives,
    averaged over heads and queries.
    """
    if has_cls:
        return probs[:, :, 0, prefix_tokens:].mean(dim=1)
    return probs[..., prefix_tokens:].mean(dim=(1, 2))


# (kernel, stride, padding), each per grid dim: the op that pools an attention's keys (the
# same alias as ``analysis.model_map.KeyPool``; the method's functions import no analysis).
KeyPool = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def key_scores_to_tokens(
    scores: Tensor,
    grid: tuple[int, int],
    positions: Tensor | None = None,
    pool: KeyPool | None = None,
) -> Tensor:
    """Scores of pooled keys (spatial-reduction attention: one key per cell of a coarser grid)
    spread to the tokens each key reads, then taken at the tokens present (``positions``).

    Without ``pool``, or where it is a kernel equal to its stride without padding (PVT's SR),
    each key stands for the tokens of its cell (nearest upsampling of the keys' grid): a token's
    score is that key's. With another ``pool`` (the op that pools the keys: kernel, stride and
    padding per grid dim), a token's score is the mean score of the keys whose window reads it.
    A token no key reads (MViTv2's 3 x 3 keys at stride 4 read three rows and columns of every
    four) ranks below every token a key reads, and among such tokens by the score of the key
    whose cell holds it: not 0 for all, which would leave their order to their positions.
    """
    b, cells = scores.shape
    height, width = grid
    shape = pooled_key_grid(cells, grid)
    if shape is None:
        raise ValueError(f"{cells} pooled keys do not form a grid like {height}x{width}")
    coarse = scores.reshape(b, 1, *shape).float()
    nearest = F.interpolate(coarse, size=(height, width), mode="nearest")
    spread = None
    if pool is not None and not pools_own_cell(pool):
        spread = _spread_by_window(coarse, nearest, pool)
    full = (nearest if spread is None else spread).reshape(b, height * width).to(scores.dtype)
    if positions is None:
        return full
    return torch.gather(full, 1, positions.clamp(min=0))


def pooled_key_grid(cells: int, grid: tuple[int, int]) -> tuple[int, int] | None:
    """The (rows, columns) of ``cells`` pooled keys over a token ``grid`` of the same aspect, or
    ``None`` where they form no such grid."""
    height, width = grid
    rows = max(1, round(math.sqrt(cells * height / width)))
    columns = cells // rows
    return (rows, columns) if rows * columns == cells else None


def pools_own_cell(pool: KeyPool) -> bool:
    """Whether each key pools exactly its own cell: kernel equal to stride, no padding."""
    kernel, stride, padding = (tuple(v) for v in pool)
    return kernel == stride and not any(padding)


def window_spread_padding(
    grid: tuple[int, ...], key_grid: tuple[int, ...], pool: KeyPool
) -> tuple[int, ...] | None:
    """The ``output_padding`` with which the transposed convolution of ``pool``'s windows maps
    the keys' grid back onto the tokens' ``grid``; ``None`` where no such padding does (the
    scores are then spread as nearest cells). Shared by the spread and its MAC count."""
    kernel, stride, padding = (tuple(v) for v in pool)
    extra = tuple(
        full - ((cells - 1) * s - 2 * p + k)
        for full, cells, k, s, p in zip(grid, key_grid, kernel, stride, padding, strict=True)
    )
    if any(not 0 <= e < max(s, 1) for e, s in zip(extra, stride, strict=True)):
        return None
    return extra


def _spread_by_window(coarse: Tensor, nearest: Tensor, pool: KeyPool) -> Tensor | None:
    """Each key's score over the tokens its window reads, averaged where windows overlap; a token
    no key reads gets its ``nearest`` score scaled below the least score of a read token.
    ``None`` where the pool does not map the keys' grid onto the tokens' (then ``nearest``).
    Two transposed convolutions of a ones kernel (:func:`window_spread_padding`)."""
    kernel, stride, padding = (tuple(v) for v in pool)
    extra = window_spread_padding(tuple(nearest.shape[2:]), tuple(coarse.shape[2:]), pool)
    if extra is None:
        return None
    ones = coarse.new_ones(1, 1, *kernel)
    spread = dict(stride=stride, padding=padding, output_padding=extra)
    total = F.conv_transpose2d(coarse, ones, **spread)
    reads = F.conv_transpose2d(torch.ones_like(coarse[:1]), ones, **spread)
    read = reads > 0
    mean = total / reads.clamp(min=1)
    # A token no key reads: below the least read score, in the order of the keys whose cells hold
    # them. No branch on whether every token is read: that would read a value on the host (on a
    # GPU a wait for the device at every scoring); where all are, the selection is ``mean``.
    least = mean.masked_fill(~read, float("inf")).amin(dim=(2, 3), keepdim=True)
    most = nearest.amax(dim=(2, 3), keepdim=True).clamp(min=torch.finfo(nearest.dtype).tiny)
    return torch.where(read, mean, nearest * (least / most) * 0.5)
