"""The capture gives attention written on (images x heads, N, D) tensors its heads axis back
(``analysis/attention_layouts.py``), only where the images come first in the folded batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitcompress.analysis import ops
from vitcompress.analysis.capture import capture


class FoldedAttention(nn.Module):
    """SAM's way, or (``images_first=False``) the heads first in the folded batch."""

    def __init__(self, dim: int = 16, heads: int = 2, images_first: bool = True) -> None:
        super().__init__()
        self.heads, self.images_first = heads, images_first
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(1, 5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, -1)
        order = (2, 0, 3, 1, 4) if self.images_first else (2, 3, 0, 1, 4)
        q, k, v = qkv.permute(*order).reshape(3, b * self.heads, n, -1).unbind(0)
        mask = self.bias.expand(b * self.heads, n, n)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.images_first:
            out = out.view(b, self.heads, n, -1).transpose(1, 2)
        else:
            out = out.view(self.heads, b, n, -1).permute(1, 2, 0, 3)
        return self.proj(out.reshape(b, n, c))


def _sdpa_ranks(module: nn.Module) -> list[int]:
    return [len(ops.shape(n.args[0])) for n in module.graph.nodes if ops.is_sdpa(n)]


@pytest.mark.parametrize("images_first", [True, False])
def test_folded_heads_are_given_back_only_where_images_come_first(images_first):
    torch.manual_seed(0)
    model = FoldedAttention(images_first=images_first).eval()
    example = torch.randn(3, 5, 16)
    captured = capture(model, example)
    # Rewritten to (B, heads, N, D) where the index run shows the images first; else left 3-D.
    assert _sdpa_ranks(captured.module) == [4 if images_first else 3]
    images = torch.randn(4, 5, 16)  # another batch size: the unflatten reads it at run time
    with torch.no_grad():
        assert torch.allclose(captured.module(images), model(images), atol=1e-6)
