"""Padding and masking around ops that need the full 2-D token grid (hybrid ViTs).

Tokens laid out as a grid are patch tokens only (models split prefix tokens off before such a
reshape), so masks and positions here refer to the stage's N0 = H * W patch positions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitcompress.method import gather_tokens


class GridPad(nn.Module):
    """Before a grid op: in inference scatter the kept tokens into a zero grid at their original
    positions (pad); in training zero the dropped tokens (mask). A token at position -1 (EViT's
    fused token) is not on the grid and is left out."""

    def __init__(self, grid: tuple[int, int]) -> None:
        super().__init__()
        self.grid = tuple(grid)

    def extra_repr(self) -> str:
        return f"grid={self.grid}"

    def forward(
        self, tokens: Tensor, keep_mask: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        cells = self.grid[0] * self.grid[1]
        if keep_mask is not None:
            return tokens * keep_mask[:, -tokens.shape[1] :].unsqueeze(-1).to(tokens.dtype)
        if positions is None:
            return tokens
        on_grid = (positions >= 0).unsqueeze(-1).to(tokens.dtype)
        index = positions.clamp(min=0).unsqueeze(-1).expand(-1, -1, tokens.shape[-1])
        full = tokens.new_zeros(tokens.shape[0], cells, tokens.shape[-1])
        return full.scatter_add(1, index, tokens * on_grid)


class GridGather(nn.Module):
    """After a grid op that flattens back at the same resolution: keep the positions present."""

    def __init__(self, grid: tuple[int, int]) -> None:
        super().__init__()
        self.grid = tuple(grid)

    def extra_repr(self) -> str:
        return f"grid={self.grid}"

    def forward(self, flat: Tensor, positions: Tensor | None = None) -> Tensor:
        if positions is None:
            return flat
        gathered = gather_tokens(flat, positions.clamp(min=0))
        return torch.where((positions >= 0).unsqueeze(-1), gathered, torch.zeros_like(gathered))
