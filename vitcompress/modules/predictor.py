"""DynamicViT's score predictor, used by dTPS and the DynamicViT baseline."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ScorePredictor(nn.Module):
    """Per-token keep/drop log-probabilities from local features and a masked global feature.

    LayerNorm -> Linear -> GELU on the residual stream; the first half of the channels stay local,
    the second half is averaged over the tokens still kept (weighted by the previous keep mask);
    then an MLP C -> C/2 -> C/4 -> 2 with a log-softmax. Column 0 is "keep". The parameter layout
    matches DynamicViT's ``PredictorLG`` (``in_conv``/``out_conv``), so its weights load.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_conv = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.out_conv = nn.Sequential(
            nn.Linear(dim, dim // 2),
            nn.GELU(),
            nn.Linear(dim // 2, dim // 4),
            nn.GELU(),
            nn.Linear(dim // 4, 2),
            nn.LogSoftmax(dim=-1),
        )

    def forward(self, tokens: Tensor, keep_mask: Tensor | None = None) -> Tensor:
        x = self.in_conv(tokens)
        b, n, c = x.shape
        local = x[:, :, : c // 2]
        if keep_mask is None:
            global_ = x[:, :, c // 2 :].mean(dim=1, keepdim=True)
        else:
            weight = keep_mask.unsqueeze(-1).to(x.dtype)
            global_ = (x[:, :, c // 2 :] * weight).sum(dim=1, keepdim=True) / weight.sum(
                dim=1, keepdim=True
            )
        x = torch.cat([local, global_.expand(b, n, c // 2)], dim=-1)
        return self.out_conv(x)
