"""Blocks the tool cannot reduce at are refused in one line naming the blocker, not with the
generic "no transformer block found" (nor left out of the map): SAM's windowed attention on 3-D
(batch x heads, N, D) tensors written as a matmul and a softmax (its SDPA form is given its
heads axis back at capture and maps: tests/test_windowed_families.py). (Parallel blocks, refused here before, now compress:
tests/test_parallel_blocks.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from tests.test_windowed_families import _sam_vit
from vitcompress import map_model
from vitcompress.analysis.analyse import MappingError
from vitcompress.analysis.model_map import AttentionCore
from vitcompress.analysis.windows import pooling_blocker

SIZE = (3, 32, 32)


def test_sam_windowed_attention_on_3d_tensors_gets_the_windowed_line():
    torch.manual_seed(0)
    sam = _sam_vit().eval()
    for block in sam.blocks:  # timm's unfused path: q @ k^T and a softmax on 3-D tensors
        block.attn.fused_attn = False
    with pytest.raises(MappingError) as refused:
        map_model(sam, (3, 64, 64))
    assert str(refused.value) == (
        "windowed attention: tokens cannot be dropped without breaking the windows "
        "(blocks.0.attn attends within 4 windows of 16 tokens per image)"
    )


@pytest.mark.parametrize(
    "name, kwargs, where, rows",
    [
        # TNT's inner attention over each patch's pixels, (B x patches, pixels, C).
        ("tnt_s_patch16_224", {"img_size": 64}, "blocks.0.attn_in", "32 rows of 16 tokens"),
        # MobileViT's transformer over the unfolded patches, (B x patch area, patches, C).
        ("mobilevit_xxs", {}, "stages.2.1.transformer.0.attn", "8 rows of 16 tokens"),
    ],
)
def test_a_stream_cut_into_windows_between_blocks_is_refused_with_that_line(
    name, kwargs, where, rows
):
    """Where the blocks' residual stream is itself batched as windows (no per-image tokens to
    put back between blocks), the line says so, naming the attention."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **kwargs).eval()
    with pytest.raises(MappingError) as refused:
        map_model(model, (3, 64, 64))
    assert str(refused.value) == (
        f"windowed attention at {where}: its block's tokens are themselves cut into windows "
        f"({rows} for 2 images, between blocks too), which is not supported"
    )


class _FramesOnly(nn.Module):
    """Video tokens (B, 1 + P * T, C): a class token, then P patch positions of T frames each.
    Each block attends within each position's frames, leaving the class token out, and adds back
    to ``x[:, 1:]``: TimeSformer's time attention without its space attention."""

    def __init__(self, positions: int = 4, frames: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.positions, self.frames = positions, frames
        self.embed = nn.Linear(3, dim)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.mlp = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, P * T, 3)
        x = self.embed(x)
        b, n, c = x.shape
        x = torch.cat([self.cls.expand(b, -1, -1), x], dim=1)
        for qkv, mlp in zip(self.qkv, self.mlp, strict=True):
            frames = x[:, 1:].reshape(b * self.positions, self.frames, c)
            q, k, v = qkv(frames).unsqueeze(1).chunk(3, dim=-1)  # one head: (B * P, 1, T, C)
            attn = (q @ k.transpose(-2, -1) * c**-0.5).softmax(dim=-1) @ v
            patches = x[:, 1:] + attn.reshape(b, n, c)
            x = torch.cat([x[:, :1], patches], dim=1)
            x = x + mlp(x)
        return x


def test_a_time_attention_added_back_to_a_slice_is_refused_with_that_line():
    """One attention within each patch position's frames, added back to ``x[:, 1:]`` inside the
    block: no residual add closes it, and, alone, it is no factorised attention either (that
    takes attentions over two different windowings, TimeSformer's time then space:
    tests/test_factorised.py). The line names the attention and the slice."""
    torch.manual_seed(0)
    with pytest.raises(MappingError) as refused:
        map_model(_FramesOnly().eval(), (16, 3))
    message = str(refused.value)
    assert "\n" not in message
    assert re.fullmatch(
        r"windowed attention at \w+: its residual add \(\w+\) is on 16 of its block's 17 "
        r"tokens \(x\[:, 1:\]\), so it closes no block of the residual stream \(a factorised "
        r"attention, e\.g\. TimeSformer's time attention, is not supported\)",
        message,
    ), message


def test_keys_pooled_below_the_queries_are_not_called_pooled_queries():
    # NextViT's E-MHSA pools its keys and values (64 queries against 4 keys, PVT's reduction)
    # inside a block whose residuals are on the conv grid: refused, but not for pooling its
    # queries, which it does not. SAM2-Hiera's transitions (16 queries against 64 keys per
    # window) are the pooled queries that line is for (tests/test_windowed_families.py).
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    nextvit = timm.create_model("nextvit_small", num_classes=10).eval()
    with pytest.raises(MappingError) as refused:
        map_model(nextvit, (3, 64, 64))
    message = str(refused.value)
    # One attention over its grid, no windows; the ones pooling their keys are left whole and
    # the first of the rest is where it is refused.
    assert "\n" not in message
    assert re.match(r"attention over its whole grid at stages\.\d\.blocks\.\d+\.e_mhsa: ", message)
    assert "queries are pooled" not in message


@pytest.mark.parametrize(
    "queries, keys, windowed, line",
    [
        (64, 4, True, "its keys are pooled within each window (64 queries against 4 keys), "),
        (64, 4, False, "its keys are pooled from its grid (64 queries against 4 keys), "),
        (16, 64, True, "its queries are pooled (16 queries against 64 keys per window), "),
        (16, 64, False, "its queries are pooled (16 queries against 64 keys), "),
        (16, 16, True, None),
    ],
)
def test_pooled_queries_are_fewer_queries_than_keys_and_pooled_keys_are_named_so(
    queries, keys, windowed, line
):
    core = AttentionCore("sdpa", "attn", 1, "a", query_tokens=queries, key_tokens=keys)
    reason = pooling_blocker(core, windowed)
    if line is None:
        assert reason is None
        return
    endings = {
        "keys": "and reducing the tokens they are pooled from is not supported there",
        True: "so the block changes the token count and its windows cannot be reduced alike",
        False: "so the block changes the token count and no reduction keeps it",
    }
    ending = endings["keys"] if queries > keys else endings[windowed]
    assert reason == line + ending


# A class token beside windows that cut the grid: each block attends within four 4 x 4 windows
# of the 8 x 8 patch tokens, the class token in none, and adds the class token's own value back.
class _Attention(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class _WindowsBesideCls(nn.Module):
    def __init__(self, dim, side=8, window=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.side, self.window = side, window

    def forward(self, x):
        B, N, C = x.shape
        h = self.norm1(x)
        cls, patches = h[:, :1], h[:, 1:]
        s, w = self.side, self.window
        win = (
            patches.reshape(B, s // w, w, s // w, w, C)
            .permute(0, 1, 3, 2, 4, 5)
            .reshape(-1, w * w, C)
        )
        win = self.attn(win)
        back = (
            win.reshape(B, s // w, s // w, w, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B, s * s, C)
        )
        x = x + torch.cat([cls, back], dim=1)
        return x + self.mlp(self.norm2(x))


class _ClsBesideWindows(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.Sequential(_WindowsBesideCls(dim), _WindowsBesideCls(dim))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(self.blocks(x)[:, 0])


def test_a_class_token_beside_windows_that_cut_the_grid_is_refused_with_that_line():
    torch.manual_seed(0)
    with pytest.raises(MappingError) as refused:
        map_model(_ClsBesideWindows().eval(), (3, 32, 32))
    assert str(refused.value) == (
        "windowed attention at blocks.0.attn: 4 windows beside 1 prefix token(s), which no "
        "window holds"
    )
