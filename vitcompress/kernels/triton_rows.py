"""Row reductions shared by the Triton kernels (``triton_select_squeeze``, ``triton_tome_merge``):
one program reads one row of a score matrix and takes its first maximum as ``torch.max``
does.

Imported only by those kernel modules, so that a CPU-only install never imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_first_max(ptr, row, first, width, BLOCK: tl.constexpr):
    """``(maximum, index)`` of row ``row`` of a contiguous (rows, ``width``) matrix, its columns
    before ``first`` read as -inf (``first >= width``: the whole row), as :func:`first_max`."""
    cols = tl.arange(0, BLOCK)
    values = tl.load(ptr + row * width + cols, mask=cols < width, other=-float("inf"))
    return first_max(tl.where(cols < first, -float("inf"), values), cols, BLOCK)


@triton.jit
def first_max(values, cols, BLOCK: tl.constexpr):
    """``(maximum, index)`` of a row as ``torch.max`` gives them: a NaN is the maximum (the
    first NaN), and of equal maxima the first index (a row all -inf: index 0). ``tl.max``'s own
    indices leave NaN to the comparison order of its reduction tree, which differs on a GPU."""
    key = tl.where(values != values, float("inf"), values)
    top = tl.max(key, axis=0)
    first = tl.min(tl.where(key == top, cols, BLOCK), axis=0)
    # The value at that index (NaN, +inf or a number): one element survives the where.
    best = tl.sum(tl.where(cols == first, values, 0.0), axis=0)
    return best, first
