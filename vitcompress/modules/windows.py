"""Tokens into their attention's windows and back, for a reduction within windows
(``analysis/windows.py`` finds each block's window order)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class WindowPartition(nn.Module):
    """(B, L, C) tokens -> (B * windows, tokens per window, C), window slot ``s`` of an image
    holding its token ``order[s]``: the windows the block's attention used."""

    def __init__(self, order: tuple[int, ...], windows: int) -> None:
        super().__init__()
        self.windows = windows
        # Not state: a saved model is rewritten again on load, which recomputes the order.
        self.register_buffer("order", torch.tensor(order, dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, tokens={self.order.numel()}"

    def forward(self, x: Tensor) -> Tensor:
        batch, channels = x.shape[0], x.shape[-1]
        windows = x.reshape(batch, -1, channels).index_select(1, self.order)
        return windows.reshape(batch * self.windows, -1, channels)


class WindowMerge(nn.Module):
    """The inverse of :class:`WindowPartition`: (B * windows, tokens per window, C) -> (B, L, C),
    every token back at its index."""

    def __init__(self, order: tuple[int, ...], windows: int) -> None:
        super().__init__()
        self.windows = windows
        order_t = torch.tensor(order, dtype=torch.long)
        inverse = torch.empty_like(order_t)
        inverse[order_t] = torch.arange(order_t.numel())
        self.register_buffer("inverse", inverse, persistent=False)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, tokens={self.inverse.numel()}"

    def forward(self, windows: Tensor) -> Tensor:
        channels = windows.shape[-1]
        tokens = windows.reshape(-1, self.inverse.numel(), channels)
        return tokens.index_select(1, self.inverse)
