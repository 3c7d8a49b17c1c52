"""``vitcompress::select_squeeze`` on CUDA: the gather and the squeeze as Triton kernels.

Imported only by the op's CUDA implementation (``kernels/ops.py``), so that a CPU-only install
never imports Triton for it. The same computation as the method's path
(:func:`~vitcompress.kernels.ops.select_squeeze_reference`): a stable descending sort of the
scores; the prefix and the ``K`` best tokens kept in that order; with ``squeeze``, each of the
``R`` pruned tokens (donors) goes to the kept token (host) of highest cosine similarity, and
``y_j = x_j + sum_{i -> j} c_i (x_i - x_j)`` with ``c_i = w_i / (e + sum_{i -> j} w_i)``,
``w_i = exp(similarity)``, computed in float32 and returned in the tokens' dtype.

The split, per location (launches counted from :func:`select_squeeze_triton`):

1. ``torch.sort`` of the scores (stable, descending): a sort stays a library op;
2. :func:`_gather_kernel`: prefix and kept tokens into the output, the kept tokens' indices, the
   hosts divided by their norms, the donors and their norms, the hosts' weight sums zeroed;
3. ``torch.bmm``: every donor against every unit host (the one product the method counts);
4. :func:`_match_kernel`: each donor's host (the first maximum, as ``torch.max``), its weight,
   and the weight sums per host (atomic adds);
5. :func:`_squeeze_kernel`: each donor's contribution added into its host (atomic adds).

Five launches with ``squeeze`` (a sixth casts the float32 result back for half-precision
tokens), two without (sort, gather), where the method's path runs about 36 ops. The atomic sums
add the donors of one host in an unspecified order: equal to the method's result to float32
rounding, not bit for bit, when tokens are squeezed; the gather alone (keep 1, or no squeeze) is
exact.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from vitcompress.kernels.triton_rows import row_first_max

_SELF_WEIGHT = math.e  # exp(1): a token's similarity to itself (method.squeeze.SELF_WEIGHT)
_NORM_EPS = 1e-6  # added to a norm, as method.squeeze does


@triton.jit
def _gather_kernel(
    x_ptr,
    order_ptr,
    out_ptr,
    keep_index_ptr,
    unit_hosts_ptr,
    donors_ptr,
    donor_norms_ptr,
    totals_ptr,
    prefix: int,
    patches: int,
    keep: int,
    channels: int,
    FUSE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NORM_EPS: tl.constexpr,
):
    """One program per (image, output row): rows < prefix are copied, then the tokens in score
    order: the first ``keep`` are kept (and, with FUSE, normalised as hosts), the rest are
    donors (FUSE only; without it the grid stops at the kept rows)."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    in_row = cols < channels
    tokens = prefix + patches
    kept_rows = prefix + keep
    if t < prefix:
        row = tl.load(x_ptr + (b * tokens + t) * channels + cols, mask=in_row)
        tl.store(out_ptr + (b * kept_rows + t) * channels + cols, row, mask=in_row)
    else:
        rank = t - prefix
        source = tl.load(order_ptr + b * patches + rank)
        row = tl.load(x_ptr + (b * tokens + prefix + source) * channels + cols, mask=in_row)
        if rank < keep:
            tl.store(out_ptr + (b * kept_rows + t) * channels + cols, row, mask=in_row)
            tl.store(keep_index_ptr + b * keep + rank, source)
            if FUSE:
                value = row.to(tl.float32)
                norm = tl.sqrt(tl.sum(value * value, axis=0))
                unit = value / (norm + NORM_EPS)
                tl.store(unit_hosts_ptr + (b * keep + rank) * channels + cols, unit, mask=in_row)
                tl.store(totals_ptr + b * keep + rank, 0.0)
        else:
            donors = patches - keep
            value = row.to(tl.float32)
            norm = tl.sqrt(tl.sum(value * value, axis=0))
            tl.store(donors_ptr + (b * donors + rank - keep) * channels + cols, value, mask=in_row)
            tl.store(donor_norms_ptr + b * donors + rank - keep, norm)


@triton.jit
def _match_kernel(
    dots_ptr,
    donor_norms_ptr,
    host_ptr,
    weight_ptr,
    totals_ptr,
    keep: int,
    donors: int,
    BLOCK_K: tl.constexpr,
    NORM_EPS: tl.constexpr,
):
    """One program per (image, donor): its host is the first maximum of its row of donor . unit
    host products; its similarity divides the donor's norm out after the argmax (as
    ``method.squeeze.match_hosts_cosine``); its weight exp(similarity) joins its host's sum."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    best, host = row_first_max(dots_ptr, b * donors + r, 0, keep, BLOCK_K)
    similarity = best / (tl.load(donor_norms_ptr + b * donors + r) + NORM_EPS)
    weight = tl.exp(similarity)
    tl.store(host_ptr + b * donors + r, host)
    tl.store(weight_ptr + b * donors + r, weight)
    tl.atomic_add(totals_ptr + b * keep + host, weight)


@triton.jit
def _squeeze_kernel(
    x_ptr,
    donors_ptr,
    host_ptr,
    weight_ptr,
    totals_ptr,
    keep_index_ptr,
    out_ptr,
    prefix: int,
    patches: int,
    keep: int,
    channels: int,
    BLOCK_C: tl.constexpr,
    SELF_WEIGHT: tl.constexpr,
):
    """One program per (image, donor): ``c (x_donor - x_host)`` added into its host's output
    row, ``x_host`` read from the input (the output row changes under the other donors' adds)."""
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    donors = patches - keep
    cols = tl.arange(0, BLOCK_C)
    in_row = cols < channels
    host = tl.load(host_ptr + b * donors + r).to(tl.int64)
    coefficient = tl.load(weight_ptr + b * donors + r) / (
        tl.load(totals_ptr + b * keep + host) + SELF_WEIGHT
    )
    source = tl.load(keep_index_ptr + b * keep + host)
    original = tl.load(
        x_ptr + (b * (prefix + patches) + prefix + source) * channels + cols, mask=in_row
    ).to(tl.float32)
    donor = tl.load(donors_ptr + (b * donors + r) * channels + cols, mask=in_row)
    contribution = (donor - original) * coefficient
    target = out_ptr + (b * (prefix + keep) + prefix + host) * channels + cols
    tl.atomic_add(target, contribution, mask=in_row)


def select_squeeze_triton(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool
) -> tuple[Tensor, Tensor]:
    """``(tokens (B, P + K, C), keep_index (B, K))`` as ``select_squeeze_reference``; ``x`` and
    ``scores`` on one device Triton launches on (CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""
    if x.dim() != 3 or scores.dim() != 2:
        raise ValueError("select_squeeze: x must be (B, N, C) and scores (B, N)")
    batch, tokens, channels = x.shape
    patches = tokens - prefix_tokens
    if scores.shape != (batch, patches):
        raise ValueError("select_squeeze: scores must have one entry per non-prefix token")
    if not 1 <= keep_tokens <= patches:
        raise ValueError(f"keep_tokens must be in 1..{patches}, got {keep_tokens}")
    x = x.contiguous()
    donors = patches - keep_tokens
    fuse = squeeze and donors > 0
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices.contiguous()
    work = torch.float32 if fuse else x.dtype  # the squeeze adds in float32, as the method
    out = x.new_empty(batch, prefix_tokens + keep_tokens, channels, dtype=work)
    keep_index = order.new_empty(batch, keep_tokens)
    f32 = dict(dtype=torch.float32, device=x.device)
    unit_hosts = torch.empty(batch, keep_tokens if fuse else 0, channels, **f32)
    donor_rows = torch.empty(batch, donors if fuse else 0, channels, **f32)
    donor_norms = torch.empty(batch, donors if fuse else 0, **f32)
    totals = torch.empty(batch, keep_tokens if fuse else 0, **f32)
    block_c = triton.next_power_of_2(channels)
    rows = tokens if fuse else prefix_tokens + keep_tokens
    _gather_kernel[(batch, rows)](
        x,
        order,
        out,
        keep_index,
        unit_hosts,
        donor_rows,
        donor_norms,
        totals,
        prefix_tokens,
        patches,
        keep_tokens,
        channels,
        FUSE=fuse,
        BLOCK_C=block_c,
        NORM_EPS=_NORM_EPS,
    )
    if not fuse:
        return out, keep_index
    dots = torch.bmm(donor_rows, unit_hosts.transpose(1, 2))  # (B, R, K)
    host = torch.empty(batch, donors, dtype=torch.int32, device=x.device)
    weight = torch.empty(batch, donors, **f32)
    _match_kernel[(batch, donors)](
        dots,
        donor_norms,
        host,
        weight,
        totals,
        keep_tokens,
        donors,
        BLOCK_K=triton.next_power_of_2(keep_tokens),
        NORM_EPS=_NORM_EPS,
    )
    _squeeze_kernel[(batch, donors)](
        x,
        donor_rows,
        host,
        weight,
        totals,
        keep_index,
        out,
        prefix_tokens,
        patches,
        keep_tokens,
        channels,
        BLOCK_C=block_c,
        SELF_WEIGHT=_SELF_WEIGHT,
    )
    return out.to(x.dtype), keep_index
