"""DynamicViT's score predictor, used by dTPS and the DynamicViT baseline."""

from __future__ import annotations

import torch.nn.functional as F
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

    def logits(self, tokens: Tensor, keep_mask: Tensor | None = None) -> Tensor:
        """Unnormalised (keep, drop) logits, ``(B, N, 2)``."""
        x = self.in_conv(tokens)
        half = x.shape[-1] // 2
        local, rest = x[..., :half], x[..., half:]
        if keep_mask is None:
            global_ = rest.mean(dim=1, keepdim=True)
        else:
            weight = keep_mask.unsqueeze(-1).to(x.dtype)
            # The mask is hard (0/1), so its sum counts the tokens kept: at least 1 changes
            # nothing, except where a Gumbel draw kept none (few tokens), which gave 0/0 = NaN.
            kept = weight.sum(dim=1, keepdim=True).clamp_min(1.0)
            global_ = (rest * weight).sum(dim=1, keepdim=True) / kept
        # out_conv[0] applied to cat([local, global broadcast]) without building the concatenation:
        # the global half is one row per image, so its product is computed once, not per token.
        first = self.out_conv[0]
        hidden = F.linear(local, first.weight[:, :half], first.bias) + F.linear(
            global_, first.weight[:, half:]
        )
        for layer in list(self.out_conv)[1:-1]:  # everything between the first Linear and softmax
            hidden = layer(hidden)
        return hidden

    def keep_score(self, tokens: Tensor) -> Tensor:
        """A score that orders tokens as the keep log-probability does (inference)."""
        logits = self.logits(tokens)
        return logits[..., 0] - logits[..., 1]  # log p_keep = -softplus(l_drop - l_keep): monotone

    def forward(self, tokens: Tensor, keep_mask: Tensor | None = None) -> Tensor:
        """Log-probabilities ``(B, N, 2)``; column 0 is "keep"."""
        return self.out_conv[-1](self.logits(tokens, keep_mask))
