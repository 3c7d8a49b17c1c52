"""MACs of every attention form against a count by hand from the shapes.

The convention (docs/measurement.md): one multiply-accumulate counts 1, at batch 1; every linear
layer and convolution (``out positions x out channels x in channels / groups x kernel area``),
both attention products (``q @ k^T`` and ``attn @ v``: queries x keys x width each), and every
other product the model runs (a linear over the heads of an attention map, a product with a
vector); LayerNorm and GroupNorm 5 per element (4 without an affine transform), inference
BatchNorm 2, a training-mode BatchNorm (a weight-standardised convolution's, over its weight) 4;
softmax, GELU, biases, residual adds, position-table gathers and adds, masks, pooling and
interpolation count nothing. Each model is counted both through ``F.scaled_dot_product_attention``
(timm's ``fused_attn``) and through the explicit ``q @ k^T``, softmax, ``@ v``: the two counts must
be equal, and equal to the hand count.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import vitcompress.zoo  # noqa: F401 - registers PVT v1 and CvT with timm
from vitcompress.measure import count_macs

pytestmark = pytest.mark.usefixtures("one_thread")

LN = 5  # per element of an affine LayerNorm / GroupNorm


def conv(positions: int, c_in: int, c_out: int, kernel: int, groups: int = 1) -> int:
    return positions * c_out * (c_in // groups) * kernel * kernel


def fused(model: nn.Module, on: bool) -> nn.Module:
    """The model with every attention's ``fused_attn`` set to ``on`` (SDPA or explicit)."""
    found = False
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = on
            found = True
    assert found, "the model has no switchable attention"
    return model.eval()


def both_forms(build, size: tuple[int, ...]) -> tuple[int, int]:
    return count_macs(fused(build(), True), size), count_macs(fused(build(), False), size)


# ---------------------------------------------------------------------------------------------
# Plain ViT (MHSA), at several input sizes and dtypes


def vit_hand(img: int, depth: int, dim: int = 192, hidden: int = 768, classes: int = 1000) -> int:
    patches = (img // 16) ** 2
    n = patches + 1  # and the class token
    block = (
        LN * n * dim  # norm1
        + n * dim * 3 * dim  # qkv
        + 2 * n * n * dim  # q @ k^T and attn @ v over all heads
        + n * dim * dim  # proj
        + LN * n * dim  # norm2
        + 2 * n * dim * hidden  # fc1, fc2
    )
    stem = conv(patches, 3, dim, 16)
    return stem + depth * block + LN * n * dim + dim * classes  # final norm on every token


@pytest.mark.parametrize("img", [32, 48, 80])
def test_vit_counts_like_a_hand_count_through_sdpa_and_explicit_attention(img):
    def build():
        return timm.create_model("vit_tiny_patch16_224", img_size=img, depth=2)

    sdpa, explicit = both_forms(build, (3, img, img))
    assert sdpa == explicit == vit_hand(img, depth=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_the_count_does_not_depend_on_the_dtype(dtype):
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2).to(dtype)
    for on in (True, False):
        assert count_macs(fused(model, on), (3, 32, 32)) == vit_hand(32, depth=2)


# ---------------------------------------------------------------------------------------------
# Spatial-reduction attention: PVT v1 (zoo) and PVT v2 (strided conv + norm, or pooling)


def pvt1_hand(img: int, dims=(64, 128, 320, 512), srs=(8, 4, 2, 1), mlps=(8, 8, 4, 4)) -> int:
    total, grid, c_in = 0, img, 3
    for i, dim in enumerate(dims):
        patch = 4 if i == 0 else 2
        grid //= patch
        n = grid * grid + (1 if i == 3 else 0)  # the class token joins in the last stage
        total += conv(grid * grid, c_in, dim, patch) + LN * grid * grid * dim
        keys = (grid // srs[i]) ** 2 if srs[i] > 1 else n
        for _ in range(2):
            total += LN * n * dim + n * dim * dim  # norm1, q
            if srs[i] > 1:  # keys from the strided conv's grid, normed
                total += conv(keys, dim, dim, srs[i]) + LN * keys * dim
            total += keys * 2 * dim * dim + 2 * n * keys * dim + n * dim * dim  # kv, products, proj
            total += LN * n * dim + 2 * n * dim * int(dim * mlps[i])
        c_in = dim
    return total + LN * n * dims[-1] + dims[-1] * 10


@pytest.mark.parametrize("img", [64, 96])
def test_pvt_v1_spatial_reduction_attention_counts_like_a_hand_count(img):
    model = timm.create_model("pvt_tiny", num_classes=10, img_size=img).eval()
    assert count_macs(model, (3, img, img)) == pvt1_hand(img)


def pvt2_hand(img: int, linear: bool, dims=(32, 64, 160, 256), srs=(8, 4, 2, 1)) -> int:
    mlps = (8, 8, 4, 4)
    grid = (img + 2 * 3 - 7) // 4 + 1
    total, c_in = 0, 3
    for i, dim in enumerate(dims):
        if i == 0:
            total += conv(grid * grid, 3, dim, 7)
        else:
            grid = (grid + 2 - 3) // 2 + 1
            total += conv(grid * grid, c_in, dim, 3)
        n = grid * grid
        total += LN * n * dim
        hidden = dim * mlps[i]
        for _ in range(2):
            total += LN * n * dim + n * dim * dim  # norm1, q
            if linear:  # pooled to 7 x 7 (not counted), a 1x1 conv, norm
                keys = 49
                total += conv(keys, dim, dim, 1) + LN * keys * dim
            elif srs[i] > 1:
                keys = (grid // srs[i]) ** 2
                total += conv(keys, dim, dim, srs[i]) + LN * keys * dim
            else:
                keys = n
            total += keys * 2 * dim * dim + 2 * n * keys * dim + n * dim * dim
            # MLP: fc1, the 3x3 depthwise conv on the grid, fc2
            total += LN * n * dim + n * dim * hidden + conv(n, hidden, hidden, 3, hidden)
            total += n * hidden * dim
        total += LN * n * dim  # the stage's norm
        c_in = dim
    return total + dims[-1] * 10  # the head reads the mean of the tokens (not counted)


@pytest.mark.parametrize("linear", [False, True])
def test_pvt_v2_reduced_and_linear_attention_count_like_a_hand_count(linear):
    def build():
        return timm.create_model("pvt_v2_b0", num_classes=10, linear=linear)

    sdpa, explicit = both_forms(build, (3, 64, 64))
    assert sdpa == explicit == pvt2_hand(64, linear)


# ---------------------------------------------------------------------------------------------
# Windowed attention: Swin, relative position bias, shifted windows' masks, padded windows


def swin_hand(img: int, window: int, dim: int = 32, depths=(2, 2, 2, 2)) -> int:
    grid = img // 4
    total = conv(grid * grid, 3, dim, 4) + LN * grid * grid * dim
    for stage, depth in enumerate(depths):
        if stage:  # patch merging: norm over 4C, then 4C -> 2C on a quarter of the tokens
            total += LN * grid * grid * dim
            grid //= 2
            total += grid * grid * 4 * dim * 2 * dim
            dim *= 2
        side = min(window, grid)
        padded = math.ceil(grid / side) * side
        tokens = padded * padded  # the attention runs on the padded windows
        for _ in range(depth):
            total += LN * grid * grid * dim  # norm1 before padding
            total += tokens * dim * 3 * dim + 2 * tokens * side * side * dim + tokens * dim * dim
            total += LN * grid * grid * dim + 2 * grid * grid * dim * 4 * dim
    return total + LN * grid * grid * dim + dim * 10


@pytest.mark.parametrize(("img", "window"), [(64, 7), (64, 4), (96, 3)])
def test_swin_windowed_attention_counts_like_a_hand_count(img, window):
    def build():
        return timm.create_model(
            "swin_tiny_patch4_window7_224",
            img_size=img,
            window_size=window,
            embed_dim=32,
            depths=(2, 2, 2, 2),
            num_heads=(1, 2, 4, 8),
            num_classes=10,
        )

    sdpa, explicit = both_forms(build, (3, img, img))
    assert sdpa == explicit == swin_hand(img, window)


# ---------------------------------------------------------------------------------------------
# CvT: depthwise conv + BatchNorm projections (keys and values on a strided grid)


def cvt_hand(img: int, dims=(64, 192, 384), depths=(1, 2, 10)) -> int:
    patch, stride, pad = (7, 3, 3), (4, 2, 2), (2, 1, 1)
    total, grid, c_in = 0, img, 3
    for i, dim in enumerate(dims):
        grid = (grid + 2 * pad[i] - patch[i]) // stride[i] + 1
        total += conv(grid * grid, c_in, dim, patch[i]) + LN * grid * grid * dim
        prefix = 1 if i == 2 else 0
        n = grid * grid + prefix
        pooled = (grid + 2 - 3) // 2 + 1
        keys = pooled * pooled + prefix
        # q: 3x3 depthwise conv + inference BatchNorm (2 per element) on the grid; k, v the
        # same at stride 2; then the three linear projections (the class token skips the convs)
        projections = conv(grid * grid, dim, dim, 3, dim) + 2 * grid * grid * dim
        projections += 2 * (conv(pooled * pooled, dim, dim, 3, dim) + 2 * pooled * pooled * dim)
        for _ in range(depths[i]):
            total += LN * n * dim + projections + n * dim * dim + 2 * keys * dim * dim
            total += 2 * n * keys * dim + n * dim * dim + LN * n * dim + 2 * n * dim * 4 * dim
        c_in = dim
    return total + LN * n * dims[-1] + dims[-1] * 10


@pytest.mark.parametrize("img", [64, 96])
def test_cvt_convolutional_projections_count_like_a_hand_count(img):
    model = timm.create_model("cvt_13", num_classes=10).eval()
    assert count_macs(model, (3, img, img)) == cvt_hand(img)


# ---------------------------------------------------------------------------------------------
# CaiT: talking-heads attention (linears over the heads of the attention map) and class attention


def cait_hand(img: int, dim: int = 64, heads: int = 2, depth: int = 4, class_blocks: int = 2):
    patches = (img // 4) ** 2
    block = (
        LN * patches * dim
        + patches * dim * 3 * dim
        + 2 * patches * patches * dim
        + 2 * patches * patches * heads * heads  # proj_l, proj_w over the heads
        + patches * dim * dim
        + LN * patches * dim
        + 2 * patches * dim * 4 * dim
    )
    n = patches + 1  # class attention: the class token's query over itself and every patch
    class_block = (
        LN * n * dim  # norm1 on all tokens
        + dim * dim  # q of the class token
        + 2 * n * dim * dim  # k, v of all tokens
        + 2 * n * dim  # its one row of q @ k^T and attn @ v
        + dim * dim  # proj
        + LN * dim  # norm2, MLP: the class token only
        + 2 * dim * 4 * dim
    )
    stem = conv(patches, 3, dim, 4)
    return stem + depth * block + class_blocks * class_block + LN * n * dim + dim * 10


@pytest.mark.parametrize("img", [32, 48])
def test_cait_talking_heads_and_class_attention_count_like_a_hand_count(img):
    def build():
        return timm.create_model(
            "cait_xxs24_224",
            img_size=img,
            patch_size=4,
            depth=4,
            embed_dim=64,
            num_heads=2,
            num_classes=10,
            depth_token_only=2,
        )

    sdpa, explicit = both_forms(build, (3, img, img))
    assert sdpa == explicit == cait_hand(img)


# ---------------------------------------------------------------------------------------------
# Grouped key/value heads, and a hybrid's convolutional stem


class GroupedQueryAttention(nn.Module):
    """8 query heads over 2 key/value heads, through SDPA's ``enable_gqa`` or written out."""

    def __init__(self, dim: int, heads: int, kv_heads: int, use_sdpa: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.use_sdpa = heads, kv_heads, use_sdpa
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1, 2)  # count_macs's input (1, 1, N, C): the tokens of one image
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, self.head_dim).transpose(1, 2)
        kv = self.kv(x).reshape(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            y = (q @ k.transpose(-2, -1) * self.head_dim**-0.5).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("use_sdpa", [True, False])
def test_grouped_key_value_heads_count_like_a_hand_count(use_sdpa):
    dim, heads, kv_heads, n = 64, 8, 2, 17
    model = GroupedQueryAttention(dim, heads, kv_heads, use_sdpa)
    kv_width = 2 * kv_heads * (dim // heads)
    # Every query head still sees every key: the products are those of 8 full heads.
    hand = n * dim * dim + n * dim * kv_width + 2 * n * n * dim + n * dim * dim
    assert count_macs(model, (1, n, dim)) == hand


def test_a_hybrids_convolutional_stem_counts_like_a_hand_count():
    """ResNetV2 stem (weight-standardised 7x7 conv, GroupNorm, max pool), then an 8x8 patch conv."""
    model = timm.create_model("vit_tiny_r_s16_p8_224", img_size=64, depth=1).eval()
    stem = conv(32 * 32, 3, 64, 7)
    standardise = 4 * 64 * 3 * 7 * 7  # a training-mode batch norm over the conv's weight
    group_norm = LN * 64 * 32 * 32
    embed = conv(2 * 2, 64, 192, 8)  # max pool to 16 x 16 (not counted), patches of 8
    n = 2 * 2 + 1
    dim = 192
    block = LN * n * dim * 2 + 4 * n * dim * dim + 2 * n * n * dim + 2 * n * dim * 4 * dim
    hand = stem + standardise + group_norm + embed + block + LN * n * dim + dim * 1000
    assert count_macs(model, (3, 64, 64)) == hand


# ---------------------------------------------------------------------------------------------
# A product with a vector operand


class VectorPoolViT(nn.Module):
    """Tokens scored by a learned vector (``x @ w``: aten.mv) and pooled by those weights."""

    def __init__(self, dim: int = 32, einsum: bool = False) -> None:
        super().__init__()
        self.einsum = einsum
        self.embed = nn.Conv2d(3, dim, 8, 8)
        self.query = nn.Parameter(torch.randn(dim))
        self.head = nn.Linear(dim, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.embed(image).flatten(2).transpose(1, 2)
        if self.einsum:
            scores = torch.einsum("bnc,c->bn", x, self.query)
        else:
            scores = x @ self.query
        pooled = (scores.softmax(dim=1).unsqueeze(-1) * x).sum(dim=1)
        return self.head(pooled)


def test_a_product_with_a_learned_vector_counts_as_its_einsum_twin_does():
    dim, tokens = 32, 16
    hand = conv(tokens, 3, dim, 8) + tokens * dim + dim * 10
    assert count_macs(VectorPoolViT(dim, einsum=True), (3, 32, 32)) == hand
    assert count_macs(VectorPoolViT(dim, einsum=False), (3, 32, 32)) == hand
