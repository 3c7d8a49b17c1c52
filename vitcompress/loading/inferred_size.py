"""The input size of an image model that does not declare one, read from its modules.

A ViT's patch embedding is a convolution whose stride is the patch size, and its absolute
position table holds one row per patch token (plus its prefix tokens): the image side is the
stride times the square root of the patch-token count. Where no such table exists, 224 (the
common ImageNet size) is tried; either way one line on stderr says what was assumed, and the
caller's run of the model on that size confirms it or ends in a one-line error.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

GUESSED_SIDE = 224
MAX_PREFIX_TOKENS = 16  # cls, distillation and register tokens in front of the patch tokens


def _convolutions(model: nn.Module) -> list[nn.Conv2d]:
    return [m for m in model.modules() if isinstance(m, nn.Conv2d)]


def _square_patch_count(tokens: int, prefix: int) -> tuple[int, int] | None:
    """``(side, prefix rows)`` of a square patch grid among ``tokens`` rows, trying the counted
    prefix first."""
    for p in [prefix] + [p for p in range(MAX_PREFIX_TOKENS + 1) if p != prefix]:
        patches = tokens - p
        side = math.isqrt(patches) if patches > 0 else 0
        if side > 1 and side * side == patches:
            return side, p
    return None


def _position_table(model: nn.Module, dim: int) -> tuple[str, torch.Tensor, int] | None:
    """The largest (1, T, dim) parameter or buffer (the absolute position table), with the
    tokens held by the other (1, k, dim) parameters (prefix tokens such as a cls token)."""
    tables = [
        (name, t)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.dim() == 3 and t.shape[0] == 1 and t.shape[2] == dim
    ]
    if not tables:
        return None
    name, table = max(tables, key=lambda item: item[1].shape[1])
    prefix = sum(t.shape[1] for n, t in tables if n != name)
    return name, table, prefix


def inferred_input_size(model: nn.Module) -> tuple[int, int, int] | None:
    """(C, H, W) read from the patch embedding and the position table, else (C, 224, 224) with a
    note; None for a model with no 2-D convolution (not recognisably an image model)."""
    convs = _convolutions(model)
    if not convs:
        return None
    channels = convs[0].in_channels  # the first convolution reads the image
    # The patch embedding reads the image and projects to the position table's width; a conv
    # behind a stem (a hybrid) would give the stem's stride, not the image's, so only the first.
    embed = convs[0]
    stride = embed.stride[0]
    found = _position_table(model, embed.out_channels)
    grid = _square_patch_count(found[1].shape[1], found[2]) if found is not None else None
    if found is not None and grid is not None and stride > 1 and embed.kernel_size[0] == stride:
        name, table, counted = found
        side, prefix = grid
        # Where the model's own prefix tokens leave no square, the grid is a guess: say so.
        guessed = (
            f", taking its first {prefix} rows for prefix tokens: the model's {counted} leave "
            f"{table.shape[1] - counted} rows, no square"
            if prefix != counted
            else ""
        )
        size = (channels, stride * side, stride * side)
        print(
            f"note: the model declares no input size; using {','.join(map(str, size))} "
            f"(patch embedding stride {stride} x {side}, the side of the {side * side} patch "
            f"rows of position table {name} {tuple(table.shape)}{guessed}); pass --input-size "
            "to override",
            file=sys.stderr,
        )
        return size
    size = (channels, GUESSED_SIDE, GUESSED_SIDE)
    print(
        f"note: the model declares no input size and has no position table to read one from; "
        f"trying {','.join(map(str, size))}; pass --input-size C,H,W if it takes another",
        file=sys.stderr,
    )
    return size
