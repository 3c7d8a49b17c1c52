"""``vitcompress::tome_merge`` on CUDA: ToMe's matching and size-weighted merge as Triton kernels.

Imported only by the op's CUDA implementation (``kernels/ops.py``), so that a CPU-only install
never imports Triton for it. The same computation as the method's path
(:func:`~vitcompress.kernels.ops.tome_merge_reference`, ``method.merge``): the metric's rows made
unit (norm clamped at 1e-12); the even tokens (``a``) scored against the odd ones (``b``) by
their cosine, protected rows and columns at -inf; each ``a`` token's destination the first
maximum of its row (``torch.max``: the first NaN, if any); the ``r`` ``a`` tokens of highest
best score merged (a stable descending sort, ties to the earlier token), the rest kept in
ascending order; each destination ``(s_b x_b + sum s_i x_i) / (s_b + sum s_i)``, computed in
float32 and returned in the tokens' dtype, in ToMe's order (the protected tokens, the other
kept ``a`` tokens, the other ``b`` tokens).

The split, per block (launches counted from :func:`tome_merge_triton`):

1. the metric rows' norms, by torch (``Tensor.norm``, the method's own call): a sum of squares
   in another order rounds otherwise, and ToMe's best scores tie to the last bit where tokens
   are near copies of one another (a flat region of an image), so that the sort's order is
   then the norms' rounding;
2. :func:`_split_kernel`: the metric's rows over their clamped norms, and each ``b`` token's
   ``s_b x_b`` and ``s_b`` written as its destination's running sums;
3. ``torch.bmm``: the unit ``a`` rows against the unit ``b`` rows, on the same strided views as
   the method (the product it counts), so that the scores are the method's bit for bit on the
   same device;
4. :func:`_match_kernel`: each ``a`` token's best score and destination;
5. ``torch.sort`` of the best scores (stable, descending): a sort stays a library op;
6. :func:`_merge_kernel`: the first ``r`` in the sort's order added into their destinations
   (atomic adds), the others written to the output at their place in ascending order (the
   method's second sort, counted in the kernel);
7. :func:`_finish_kernel`: each ``b`` token's sums divided by its size into the output.

Seven launches where the method's path dispatches 27 to 34 ops (27 with sizes and no protected
token, 34 with a protected class token and no sizes, as in a ToMe model's first block). Half-
precision tokens take one more, the cast of the float32 result back (by torch: Triton's
interpreter truncates a float32 store into bfloat16 where torch rounds to nearest), and a
half-precision metric one more, its cast to float32 (the method's ``metric.float()``).

The atomic adds sum the sources of one destination in an unspecified order on a GPU: there the
merged tokens equal the method's to float32 rounding, not bit for bit (the method's own
``scatter_add`` on CUDA adds atomically too); the kept ``a`` tokens, the ``b`` tokens nothing
merged into, the sizes where they are whole numbers, and the index are exact. Under Triton's
interpreter the programs run in order, so the sums are added in the sort's order, the
method's, and every output is the method's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from vitcompress.kernels.triton_rows import row_first_max
from vitcompress.method import merge_count

_NORM_FLOOR = 1e-12  # the method's clamp_min on a metric row's norm


@triton.jit
def _weighted_row(x_ptr, sizes_ptr, b, t, tokens, channels, HAS_SIZES: tl.constexpr,
                  BLOCK_C: tl.constexpr):  # fmt: skip
    """Token ``t`` of image ``b`` times its size, in float32, and its size (1 without sizes)."""
    if HAS_SIZES:
        size = tl.load(sizes_ptr + b * tokens + t).to(tl.float32)
    else:
        size = 1.0
    cols = tl.arange(0, BLOCK_C)
    value = tl.load(x_ptr + (b * tokens + t) * channels + cols, mask=cols < channels)
    return value.to(tl.float32) * size, size


@triton.jit
def _store_out(out_ptr, out_sizes_ptr, index_ptr, row, value, size, t, channels,
               BLOCK_C: tl.constexpr):  # fmt: skip
    """Output row ``row`` (over the batch): the token's value, its size and its index ``t``."""
    cols = tl.arange(0, BLOCK_C)
    tl.store(out_ptr + row * channels + cols, value, mask=cols < channels)
    tl.store(out_sizes_ptr + row, size)
    tl.store(index_ptr + row, t)


@triton.jit
def _split_kernel(
    x_ptr,
    metric_ptr,
    norms_ptr,
    sizes_ptr,
    unit_ptr,
    sums_ptr,
    sum_sizes_ptr,
    tokens: int,
    channels: int,
    width: int,
    HAS_SIZES: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM_FLOOR: tl.constexpr,
):
    """One program per (image, token): its metric row over its clamped norm; a ``b`` (odd)
    token also starts its destination's sums (``s x`` and ``s``), which :func:`_merge_kernel`
    adds the sources to."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    in_metric = dims < width
    row = tl.load(metric_ptr + (b * tokens + t) * width + dims, mask=in_metric)
    norm = tl.load(norms_ptr + b * tokens + t)
    # clamp_min as a comparison, which keeps a NaN norm NaN (as torch's clamp_min does); an IEEE
    # division (not Triton's approximate default on a GPU), so that the unit rows are torch's.
    norm = tl.where(norm < NORM_FLOOR, NORM_FLOOR, norm)
    tl.store(unit_ptr + (b * tokens + t) * width + dims, tl.div_rn(row, norm), mask=in_metric)
    if t % 2 == 1:
        pairs = tokens // 2
        cols = tl.arange(0, BLOCK_C)
        in_row = cols < channels
        weighted, size = _weighted_row(x_ptr, sizes_ptr, b, t, tokens, channels, HAS_SIZES, BLOCK_C)
        tl.store(sums_ptr + (b * pairs + t // 2) * channels + cols, weighted, mask=in_row)
        tl.store(sum_sizes_ptr + b * pairs + t // 2, size)


@triton.jit
def _match_kernel(
    scores_ptr,
    best_ptr,
    best_b_ptr,
    pairs: int,
    protected_a: int,
    protected_b: int,
    BLOCK_B: tl.constexpr,
):
    """One program per (image, ``a`` token): its best score and the first ``b`` token that has
    it, protected rows and columns at -inf (a protected row: -inf at ``b`` 0, as ``torch.max``
    gives for a row of -inf). ``scores`` is the product's (B, evens, pairs), contiguous."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    evens = tl.num_programs(1)
    # A protected a token's whole row is -inf; a protected b token's column in every row.
    first = tl.where(i < protected_a, pairs, protected_b)
    best, best_b = row_first_max(scores_ptr, b * evens + i, first, pairs, BLOCK_B)
    tl.store(best_ptr + b * evens + i, best)
    tl.store(best_b_ptr + b * evens + i, best_b)


@triton.jit
def _merge_kernel(
    x_ptr,
    sizes_ptr,
    order_ptr,
    best_b_ptr,
    sums_ptr,
    sum_sizes_ptr,
    out_ptr,
    out_sizes_ptr,
    index_ptr,
    tokens: int,
    channels: int,
    r: int,
    protected: int,
    HAS_SIZES: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_A: tl.constexpr,
):
    """One program per (image, rank in the sort): the ``a`` token at that rank. The first ``r``
    add ``s x`` and ``s`` into their destination's sums; the others are kept, at the output row
    their index has among the kept ``a`` tokens (ascending: the method's second sort, counted
    here), as ``(s x) / s`` (the method's arithmetic, not always ``x`` to the last bit)."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    evens = tl.num_programs(1)
    pairs = tokens // 2
    rows_out = tokens - r
    i = tl.load(order_ptr + b * evens + k)
    t = 2 * i
    cols = tl.arange(0, BLOCK_C)
    in_row = cols < channels
    weighted, size = _weighted_row(x_ptr, sizes_ptr, b, t, tokens, channels, HAS_SIZES, BLOCK_C)
    if k < r:
        j = tl.load(best_b_ptr + b * evens + i).to(tl.int64)
        tl.atomic_add(sums_ptr + (b * pairs + j) * channels + cols, weighted, mask=in_row)
        tl.atomic_add(sum_sizes_ptr + b * pairs + j, size)
    else:
        # How many kept a tokens come before this one: ranks r.. of the sort, read as a vector.
        ranks = tl.arange(0, BLOCK_A)
        kept = tl.load(order_ptr + b * evens + ranks, mask=(ranks >= r) & (ranks < evens), other=i)
        before = tl.sum((kept < i).to(tl.int64), axis=0)
        protected_a = (protected + 1) // 2
        # A protected a token keeps its sequence index (the protected tokens come first, in
        # order; none of them is merged: their -inf scores sort last); the others follow them.
        slot = tl.where(i < protected_a, t, protected + before - protected_a)
        row = b * rows_out + slot
        _store_out(out_ptr, out_sizes_ptr, index_ptr, row, tl.div_rn(weighted, size), size, t,
                   channels, BLOCK_C)  # fmt: skip


@triton.jit
def _finish_kernel(
    sums_ptr,
    sum_sizes_ptr,
    out_ptr,
    out_sizes_ptr,
    index_ptr,
    tokens: int,
    channels: int,
    r: int,
    protected: int,
    BLOCK_C: tl.constexpr,
):
    """One program per (image, ``b`` token): its sums divided by its size, at its output row
    (its sequence index if protected, else after the kept ``a`` tokens)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    pairs = tokens // 2
    rows_out = tokens - r
    t = 2 * j + 1
    protected_a = (protected + 1) // 2
    protected_b = protected // 2
    kept_a = (tokens + 1) // 2 - r
    slot = tl.where(t < protected, t, protected + (kept_a - protected_a) + (j - protected_b))
    cols = tl.arange(0, BLOCK_C)
    size = tl.load(sum_sizes_ptr + b * pairs + j)
    sums = tl.load(sums_ptr + (b * pairs + j) * channels + cols, mask=cols < channels)
    row = b * rows_out + slot
    _store_out(out_ptr, out_sizes_ptr, index_ptr, row, tl.div_rn(sums, size), size, t, channels,
               BLOCK_C)  # fmt: skip


def tome_merge_triton(
    x: Tensor, metric: Tensor, sizes: Tensor | None, r: int, protected: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(tokens (B, t - r, C), sizes (B, t - r) float32, index (B, t - r))`` as
    ``tome_merge_reference``, ``r`` clamped by ``merge_count``; ``x`` (B, t, C), ``metric``
    (B, t, D) and ``sizes`` (B, t) or ``None`` (all 1) on one device Triton launches on (CUDA, or
    the CPU under ``TRITON_INTERPRET=1``). Where the clamped ``r`` is 0 (the reference's
    ``None``), the tokens as they came (a copy: an op's outputs may not alias its inputs), their
    sizes and their indices in order, as ``merge_tokens`` gives for an empty matching."""
    if x.dim() != 3 or metric.dim() != 3 or metric.shape[:2] != x.shape[:2]:
        raise ValueError("tome_merge: x must be (B, t, C) and metric (B, t, D)")
    batch, tokens, channels = x.shape
    if sizes is not None and sizes.shape != (batch, tokens):
        raise ValueError("tome_merge: sizes must be (B, t)")
    if not 0 <= protected <= tokens:
        raise ValueError(f"protected must be in 0..{tokens}, got {protected}")
    r = merge_count(tokens, r, protected)
    if r == 0:
        kept_sizes = (
            x.new_ones(batch, tokens, dtype=torch.float32)
            if sizes is None
            else sizes.to(torch.float32, copy=True)
        )
        index = torch.arange(tokens, device=x.device).repeat(batch, 1)
        return x.clone(), kept_sizes, index
    width = metric.shape[2]
    evens, pairs = (tokens + 1) // 2, tokens // 2
    x = x.contiguous()
    # The method's metric.float() and norm (see the module: the sort's order can be the norms'
    # rounding); no launch for a float32 metric but the norm.
    metric = metric.float().contiguous()
    norms = metric.norm(dim=-1)
    has_sizes = sizes is not None
    sizes = sizes.contiguous() if has_sizes else x  # never read without HAS_SIZES
    f32 = dict(dtype=torch.float32, device=x.device)
    unit = torch.empty(batch, tokens, width, **f32)
    sums = torch.empty(batch, pairs, channels, **f32)
    sum_sizes = torch.empty(batch, pairs, **f32)
    block_c = triton.next_power_of_2(channels)
    _split_kernel[(batch, tokens)](
        x,
        metric,
        norms,
        sizes,
        unit,
        sums,
        sum_sizes,
        tokens,
        channels,
        width,
        HAS_SIZES=has_sizes,
        BLOCK_C=block_c,
        BLOCK_D=triton.next_power_of_2(width),
        NORM_FLOOR=_NORM_FLOOR,
    )
    # The method's product on the same strided views (a: even rows, b: odd), so that the same
    # GEMM serves it and the scores are the method's bit for bit on the same device.
    scores = torch.bmm(unit[:, ::2], unit[:, 1::2].transpose(1, 2)).contiguous()
    best = torch.empty(batch, evens, **f32)
    best_b = torch.empty(batch, evens, dtype=torch.int32, device=x.device)
    _match_kernel[(batch, evens)](
        scores,
        best,
        best_b,
        pairs,
        (protected + 1) // 2,
        protected // 2,
        BLOCK_B=triton.next_power_of_2(pairs),
    )
    # The method's order: NaN first, ties to the earlier token (the protected a tokens, at
    # -inf, last); its second sort (of the kept a tokens) is counted in _merge_kernel.
    order = torch.sort(best, dim=1, descending=True, stable=True).indices.contiguous()
    out = torch.empty(batch, tokens - r, channels, **f32)
    out_sizes = torch.empty(batch, tokens - r, **f32)
    index = torch.empty(batch, tokens - r, dtype=torch.long, device=x.device)
    _merge_kernel[(batch, evens)](
        x,
        sizes,
        order,
        best_b,
        sums,
        sum_sizes,
        out,
        out_sizes,
        index,
        tokens,
        channels,
        r,
        protected,
        HAS_SIZES=has_sizes,
        BLOCK_C=block_c,
        BLOCK_A=triton.next_power_of_2(evens),
    )
    _finish_kernel[(batch, pairs)](
        sums,
        sum_sizes,
        out,
        out_sizes,
        index,
        tokens,
        channels,
        r,
        protected,
        BLOCK_C=block_c,
    )
    # Cast by torch (rounding to nearest even); a no-op for float32 tokens.
    return out.to(x.dtype), out_sizes, index
