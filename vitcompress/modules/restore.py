"""The module the rewrite puts where something reads a reduced stage's tokens by position: it
brings back the full token set in the base's order (``method/restore.py``), from the trace of
the stage's reductions (``modules/reducers.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitcompress.method import MaskedRemoval, restore_masked, restore_tokens


class TokenRestore(nn.Module):
    """``tokens`` with the token axis at ``axis`` and ``prefix_tokens`` prefix tokens first (none
    for a grid's patch tokens) -> the same with every patch token of the stage back, in grid
    order. An empty trace (nothing reduced yet) passes the tokens through."""

    def __init__(self, rule: str, prefix_tokens: int, axis: int = 1, where: str = "") -> None:
        super().__init__()
        self.rule = rule
        self.prefix_tokens = prefix_tokens
        self.axis = axis
        self.where = where  # what reads the restored tokens, for repr and reports

    def extra_repr(self) -> str:
        return f"rule={self.rule!r}, prefix_tokens={self.prefix_tokens}, axis={self.axis}" + (
            f", for={self.where!r}" if self.where else ""
        )

    def forward(self, tokens: Tensor, trace: tuple = ()) -> Tensor:
        if not trace:
            return tokens
        x = tokens.movedim(self.axis, 1)
        shape = x.shape
        x = x.reshape(shape[0], shape[1], -1)  # the features as one axis
        p = self.prefix_tokens
        prefix, patches = x[:, :p], x[:, p:]
        if isinstance(trace[0], MaskedRemoval):
            patches = restore_masked(patches, trace, self.rule)
        else:
            patches = restore_tokens(patches, trace, self.rule)
        x = torch.cat([prefix, patches], dim=1)
        return x.reshape(shape[0], x.shape[1], *shape[2:]).movedim(1, self.axis)
