"""After an op that needs the full token grid (hybrid ViTs): the present tokens gathered again.

Tokens laid out as a grid are patch tokens only (models split prefix tokens off before such a
reshape), so positions here refer to the stage's N0 = H * W patch positions (a grid
of any rank: a video's N0 = T * H * W).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitcompress.method import gather_tokens


class GridGather(nn.Module):
    """After a grid op that flattens back at the same resolution: keep the positions present."""

    def __init__(self, grid: tuple[int, ...]) -> None:
        super().__init__()
        self.grid = tuple(grid)

    def extra_repr(self) -> str:
        return f"grid={self.grid}"

    def forward(self, flat: Tensor, positions: Tensor | None = None) -> Tensor:
        if positions is None:
            return flat
        gathered = gather_tokens(flat, positions.clamp(min=0))
        return torch.where((positions >= 0).unsqueeze(-1), gathered, torch.zeros_like(gathered))
