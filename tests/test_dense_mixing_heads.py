"""A head that mixes the tokens along their axis after the blocks, its output keeping the tokens'
shape (a flip, a cumulative sum, a 1-D conv over the tokens, a position table added after the
blocks), or a pool over windows or bins of them: the full token set must be back before that op,
whatever the restore rule.

``host`` and ``zero`` restore where the tokens are read, after the ops that work on each token
alone; ops of an unchanged shape that take a token's value from others are not such ops. The
compressed model with the head must equal the head applied to the compressed model without it
(the same weights, the same choices: the head runs after the last block).
"""

from __future__ import annotations

import pytest
import torch
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from tests.fixtures.dense_models import compress_restoring

TOKENS, DIM = 64, 64
HEADS = (
    "id", "flip", "cumsum", "conv1d", "position_table", "avg_pool1d", "adaptive_max_pool",
    "max_indices",
)  # fmt: skip


class TokensOut(nn.Module):
    """Patches of 4 on a 32x32 image (an 8x8 grid), a cls token, four timm blocks, a final norm;
    the output is the patch tokens through ``head``."""

    def __init__(self, head: str) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, DIM, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, TOKENS + 1, DIM) * 0.02)
        self.blocks = nn.Sequential(*[Block(DIM, 2, qkv_bias=True) for _ in range(4)])
        self.norm = nn.LayerNorm(DIM)
        self.head = head
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=1)
        self.table = nn.Parameter(torch.randn(1, TOKENS, DIM))
        self.bins = nn.AdaptiveMaxPool1d(4)

    def forward(self, image: Tensor) -> Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.apply_head(self.norm(self.blocks(x))[:, 1:])

    def apply_head(self, patches: Tensor) -> Tensor:
        if self.head == "flip":
            return patches.flip(1)
        if self.head == "cumsum":
            return patches.cumsum(1)
        if self.head == "conv1d":
            return self.conv(patches.transpose(1, 2))
        if self.head == "position_table":
            return patches + self.table
        if self.head == "avg_pool1d":  # a window over the tokens: not a pool over them all
            return nn.functional.avg_pool1d(patches.transpose(1, 2), 2)
        if self.head == "adaptive_max_pool":  # four bins over the tokens
            return self.bins(patches.transpose(1, 2))
        if self.head == "max_indices":  # where each channel's largest token is: a position
            return patches.max(1).indices
        return patches


def _model(head: str) -> TokensOut:
    torch.manual_seed(0)
    model = TokensOut(head)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * DIM] *= 8.0  # peaked attention
    return model.eval()


def _compressed(model: nn.Module, method: str, rule: str) -> nn.Module:
    return compress_restoring(model, method, rule, (3, 32, 32))


@pytest.mark.parametrize(("method", "rule"), [("tome", "host"), ("dtps", "zero")])
@pytest.mark.parametrize("head", HEADS[1:])
def test_a_head_mixing_the_tokens_reads_them_all_back(head, method, rule):
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with_head = _model(head)
    without = _model("id")
    with torch.no_grad():
        out = _compressed(with_head, method, rule)(x)
        expected = with_head.apply_head(_compressed(without, method, rule)(x))
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
