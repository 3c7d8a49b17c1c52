"""A position table made to follow the kept tokens: gathered per image by their grid positions.

After a token reduction the tokens of an image are its prefix tokens, then the kept patch tokens
in any order (``positions`` (B, n): each one's index on the patch grid; -1 for a token that has
no grid position, EViT's fused token). A table laid out by token position (a relative-position
bias (..., N, N), RoPE's sin/cos rows (N, D)) is read at the same places, so each token meets
its own row again: the table gets the image batch as its first dim and is gathered along each
token dim. A dim over the prefix and patch tokens (P + N0) takes rows ``0..P-1`` then ``P + pos``;
a dim over the patch tokens alone (N0) takes ``pos``.

A token without a grid position takes the table's neutral value on its row (and column), the
value that leaves what the table meets unchanged: 0 where the table is added (no positional
bias), 1 where it multiplies (RoPE's cos: with 0 for the paired sin, no rotation), as the prefix
tokens, which have no grid position either, are treated by the models. It never takes another
token's row: -1 is not used as an index.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PositionGather(nn.Module):
    """Gathers ``table`` by ``positions`` along ``token_dims``, per image.

    ``ndim``: the rank the table is read at (leading ones added, as broadcasting does), its first
    dim then being the image batch; ``prefixes``: for each token dim, how many prefix rows it
    holds before the patch tokens (0 for a table over the patch tokens only); ``neutral``: the
    value a token without a grid position takes (``None`` when the plan never makes one: such a
    token would then get NaN, never another token's row).
    """

    def __init__(
        self,
        token_dims: tuple[int, ...],
        prefixes: tuple[int, ...],
        ndim: int,
        neutral: float | None = None,
    ) -> None:
        super().__init__()
        if len(token_dims) != len(prefixes) or not token_dims:
            raise ValueError("one prefix count per token dim, at least one token dim")
        if any(not 0 < d < ndim for d in token_dims):
            raise ValueError(f"token dims {token_dims} must lie in 1..{ndim - 1}")
        self.token_dims = tuple(token_dims)
        self.prefixes = tuple(prefixes)
        self.ndim = ndim
        self.neutral = neutral

    def extra_repr(self) -> str:
        return (
            f"token_dims={self.token_dims}, prefixes={self.prefixes}, ndim={self.ndim}, "
            f"neutral={self.neutral}"
        )

    def forward(self, table: Tensor, positions: Tensor | None) -> Tensor:
        if positions is None:  # tokens still all there, in grid order (or training's mask path)
            return table
        batch = positions.shape[0]
        gathered = table.reshape((1,) * (self.ndim - table.dim()) + tuple(table.shape))
        gathered = gathered.expand(batch, *gathered.shape[1:])
        off_grid = positions < 0  # (B, n): tokens without a grid position
        missing: Tensor | None = None
        for dim, prefix in zip(self.token_dims, self.prefixes, strict=True):
            index = positions.clamp(min=0) + prefix
            no_row = off_grid
            if prefix:
                head = torch.arange(prefix, device=positions.device, dtype=positions.dtype)
                index = torch.cat([head.expand(batch, prefix), index], dim=1)
                no_row = torch.cat([off_grid.new_zeros(batch, prefix), off_grid], dim=1)
            shape = [batch] + [1] * (self.ndim - 1)
            shape[dim] = index.shape[1]
            size = list(gathered.shape)
            size[dim] = index.shape[1]
            gathered = torch.gather(gathered, dim, index.reshape(shape).expand(size))
            no_row = no_row.reshape(shape)
            missing = no_row if missing is None else missing | no_row
        if gathered.dtype == torch.bool:
            return gathered.masked_fill(missing, True)  # an allowed key, as any other
        # No neutral value known (the plan refuses EViT then): NaN, loud, never a wrong row.
        fill = float("nan") if self.neutral is None else self.neutral
        return gathered.masked_fill(missing, fill)
