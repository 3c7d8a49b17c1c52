"""Token merging (ToMe, Bolya et al., ICLR 2023): bipartite soft matching and the size-weighted
merge, as pure tensor functions.

Tokens are split alternately into two sets over the whole sequence, ``a`` (even indices) and ``b``
(odd); every ``a`` token is matched to its most similar ``b`` token (cosine of the metric, ToMe's
keys averaged over heads), and the ``r`` best-matched ``a`` tokens are merged into their matches
by an average weighted by the tokens' sizes (how many patches each already stands for). Protected
tokens (the first ``protected``: cls, distillation, registers) are never merged and never merged
into. The merged sequence is in ToMe's order, which the next block's alternating split depends
on: the protected tokens first (in their order), then the unmerged ``a`` tokens in their order,
then the ``b`` tokens (merged into or not) in theirs. ToMe's code sorts the unmerged tokens only
when it protects a class token (otherwise it leaves them in similarity order); here they are
always sorted, so the order never depends on ties.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from vitcompress.method.squeeze import SCATTER, index_sum, product_outside_autocast, sum_form


class Matching(NamedTuple):
    """The outcome of :func:`bipartite_soft_matching` for a ``(B, t, C)`` token sequence.

    ``src`` (B, r): the merged ``a`` tokens, as indices into ``a`` (sequence index ``2 * i``);
    ``dst`` (B, r): the ``b`` token each merges into, as indices into ``b`` (``2 * j + 1``);
    ``unmerged`` (B, ta - r): the other ``a`` tokens, ascending; ``protected``: the first tokens
    of the sequence, never merged.
    """

    src: Tensor
    dst: Tensor
    unmerged: Tensor
    protected: int = 0


def merge_count(tokens: int, r: int, protected: int) -> int:
    """How many tokens a block merges: ``r``, at most half the unprotected tokens (ToMe's bound)."""
    return max(0, min(r, (tokens - protected) // 2))


def bipartite_soft_matching(metric: Tensor, r: int, protected: int = 0) -> Matching:
    """Match ``metric`` ``(B, t, C)`` for merging ``r`` tokens (clamped by :func:`merge_count`).

    Scores are the cosine similarities of ``a`` to ``b`` tokens; a protected ``a`` token's row and
    a protected ``b`` token's column are ``-inf``. Each ``a`` token's best ``b`` (first maximum)
    is its destination; the ``r`` ``a`` tokens with the highest best score (a stable sort, ties
    to the earlier token) are merged. No gradient flows through the matching (indices only).
    """
    t = metric.shape[1]
    r = merge_count(t, r, protected)
    with torch.no_grad():
        unit = metric.float()
        unit = unit / unit.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        a, b = unit[:, ::2], unit[:, 1::2]
        if b.shape[1] == 0:  # a single token (a padded window's corner): nothing to match
            none = torch.zeros(metric.shape[0], 0, dtype=torch.long, device=metric.device)
            unmerged = torch.arange(a.shape[1], device=metric.device).expand(metric.shape[0], -1)
            return Matching(src=none, dst=none, unmerged=unmerged, protected=protected)
        scores = product_outside_autocast(a, b.transpose(-1, -2))  # (B, ta, tb)
        protected_a = (protected + 1) // 2  # sequence indices 0, 2, ... below `protected`
        protected_b = protected // 2  # 1, 3, ...
        if protected:  # a mask rather than slice assignments, which ONNX writes as ScatterND
            rows = torch.arange(scores.shape[1], device=scores.device) < protected_a
            columns = torch.arange(scores.shape[2], device=scores.device) < protected_b
            scores = scores.masked_fill(rows.unsqueeze(-1) | columns, float("-inf"))
        best, best_b = scores.max(dim=-1)  # (B, ta)
        order = torch.sort(best, dim=-1, descending=True, stable=True).indices
        src = order[:, :r]
        unmerged = order[:, r:].sort(dim=-1).values
        dst = best_b.gather(1, src)
    return Matching(src=src, dst=dst, unmerged=unmerged, protected=protected)


def merge_tokens(
    x: Tensor, sizes: Tensor, matching: Matching, form: str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Merge ``x`` ``(B, t, C)`` with token sizes ``(B, t)`` as ``matching`` says.

    A destination becomes ``(s_b x_b + sum s_i x_i) / (s_b + sum s_i)`` over the ``a`` tokens ``i``
    merged into it, and its size ``s_b + sum s_i``; computed in float32, returned in x's dtype.
    Returns the merged tokens ``(B, t - r, C)`` in ToMe's order (see the module), their sizes and
    their indices in the input sequence ``(B, t - r)`` (a merged token takes its destination's).
    ``form``: how the merged tokens are summed per destination (``method.squeeze.index_sum``;
    default ``sum_form()``: the scatter, except in an ONNX export).
    """
    form = form or sum_form()
    b_count = x.shape[1] // 2
    src, dst, unmerged, protected = matching
    if src.shape[1] == 0:
        index = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return x, sizes, index
    weights = sizes.float().unsqueeze(-1)
    weighted = x.float() * weights
    wa, wb = weighted[:, ::2], weighted[:, 1::2]
    sa, sb = weights[:, ::2], weights[:, 1::2]
    channels = x.shape[-1]
    src_tokens = wa.gather(1, src.unsqueeze(-1).expand(-1, -1, channels))
    src_sizes = sa.gather(1, src.unsqueeze(-1))
    if form == SCATTER:
        dst_index = dst.unsqueeze(-1)
        merged = wb.scatter_add(1, dst_index.expand(-1, -1, channels), src_tokens)
        merged_sizes = sb.scatter_add(1, dst_index, src_sizes)
    else:
        merged = wb + index_sum(src_tokens, dst, wb.shape[1], form)
        merged_sizes = sb + index_sum(src_sizes, dst, sb.shape[1], form)
    kept_a = wa.gather(1, unmerged.unsqueeze(-1).expand(-1, -1, channels))
    kept_a_sizes = sa.gather(1, unmerged.unsqueeze(-1))
    b_index = torch.arange(b_count, device=x.device).expand(x.shape[0], -1) * 2 + 1
    index = torch.cat([unmerged * 2, b_index], dim=1)
    unmerged_a = unmerged.shape[1]
    index = in_tome_order(index, unmerged_a, protected)
    tokens = in_tome_order(torch.cat([kept_a, merged], dim=1), unmerged_a, protected)
    new_sizes = in_tome_order(torch.cat([kept_a_sizes, merged_sizes], dim=1), unmerged_a, protected)
    out = (tokens / new_sizes).to(x.dtype)
    return out, new_sizes.squeeze(-1).to(sizes.dtype), index


def in_tome_order(t: Tensor, unmerged_a: int, protected: int) -> Tensor:
    """``t`` ``(B, n, ...)``, laid out along dim 1 as ``cat([unmerged a, b])``, in ToMe's order:
    the protected tokens first, in sequence order (the first unmerged ``a`` and ``b`` tokens
    alternating: a0 b0 a1 ...), then the other unmerged ``a`` tokens, then the other ``b`` tokens.

    Slices and one concatenation rather than an index made from a Python list: on a GPU such an
    index is a copy from the host and a wait for the device on every call, and it cannot be
    captured in a CUDA graph. With at most one protected token the layout is that order already.
    """
    protected_b = protected // 2  # the protected b tokens; the protected a ones: one more if odd
    if protected_b == 0:
        return t
    a, b = t[:, :unmerged_a], t[:, unmerged_a:]
    pairs = torch.stack([a[:, :protected_b], b[:, :protected_b]], dim=2).flatten(1, 2)
    return torch.cat([pairs, a[:, protected_b:], b[:, protected_b:]], dim=1)


def merged_hosts(matching: Matching) -> tuple[Tensor, Tensor]:
    """Where each merged token went, for restoring (unmerge): ``(prune_index, host_index)``, both
    (B, r), over the non-prefix tokens: each merged ``a`` token's index in the input, and its
    destination's among the merged output's (ToMe's order, see the module: the unprotected
    unmerged ``a`` tokens, then the unprotected ``b`` tokens)."""
    p = matching.protected
    protected_a, protected_b = (p + 1) // 2, p // 2
    prune_index = matching.src * 2 - p
    host_index = (matching.unmerged.shape[1] - protected_a) + (matching.dst - protected_b)
    return prune_index, host_index


def merge_sources(matching: Matching, tokens: int) -> dict[int, list[int]]:
    """For the first image: each destination's sequence index -> the sequence indices merged into
    it at this step (for drawing merged groups)."""
    groups: dict[int, list[int]] = {}
    for i, j in zip(matching.src[0].tolist(), matching.dst[0].tolist(), strict=True):
        groups.setdefault(2 * j + 1, []).append(2 * i)
    return groups
