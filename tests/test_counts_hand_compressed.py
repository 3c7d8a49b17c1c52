"""MACs and parameters of compressed models against a count by hand.

A compressed model's MACs are the base's blocks on the tokens each block sees, plus each
reducer's own work: the score predictor's MLP (dTPS, DynamicViT), the similarity of every pruned
token to every kept one (TPS's squeeze: pruned x kept x C), the class token's row of attention
recomputed beside a fused SDPA (eTPS, EViT; free where the softmax is in the graph) and ToMe's
bipartite similarity (ceil(t/2) x floor(t/2) x head width). Sorting, gathering, the fuse's
weighted sums and ToMe's size-weighted averages are not multiply-accumulates of a product. The
search's analytic MACs must equal the counted ones on a plain ViT. Counts are per image: batch
and dtype do not change them. Parameters are the base's plus the predictors', shared ones once.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
from torch import nn

import vitcompress
from vitcompress.api import capture_and_map
from vitcompress.compilation.plan import make_plan
from vitcompress.measure import count_macs, count_params
from vitcompress.measure.macs import count_call_macs
from vitcompress.search.cost import profile
from vitcompress.variants import get_variant

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, HIDDEN, DEPTH, IMG = 192, 3, 768, 4, 64
PATCHES = (IMG // 16) ** 2
SIZE = (3, IMG, IMG)
LOCS, KEEP = [1, 2], 0.7


def vit(fused_attn: bool = True) -> nn.Module:
    model = timm.create_model("vit_tiny_patch16_224", img_size=IMG, depth=DEPTH)
    for block in model.blocks:
        block.attn.fused_attn = fused_attn
    return model.eval()


def block(tokens: int, mlp_tokens: int | None = None) -> int:
    """One block: its attention on ``tokens``, its MLP on ``mlp_tokens`` (default the same)."""
    m = tokens if mlp_tokens is None else mlp_tokens
    attention = 5 * tokens * DIM + 4 * tokens * DIM * DIM + 2 * tokens * tokens * DIM
    return attention + 5 * m * DIM + 2 * m * DIM * HIDDEN


def stem() -> int:
    return PATCHES * 3 * 16 * 16 * DIM


def tail(tokens: int) -> int:
    return 5 * tokens * DIM + DIM * 1000  # final norm on every token, head on the class token


def predictor(tokens: int) -> int:
    """DynamicViT's predictor on ``tokens`` patch tokens: LayerNorm, C->C, the local half
    C/2->C/2 per token and the global half once, C/2->C/4, C/4->2."""
    half, quarter = DIM // 2, DIM // 4
    per_token = 5 * DIM + DIM * DIM + half * half + half * quarter + quarter * 2
    return tokens * per_token + half * half


def predictor_params() -> int:
    half, quarter = DIM // 2, DIM // 4
    norm, first = 2 * DIM, DIM * DIM + DIM
    mlp = DIM * half + half + half * quarter + quarter + quarter * 2 + 2
    return norm + first + mlp


def hand(variant: str, fused_attn: bool) -> int:
    """MACs of ``variant`` at LOCS, KEEP on this file's ViT."""
    total, n = stem(), PATCHES  # n: patch tokens present
    for index in range(DEPTH):
        if index not in LOCS:
            total += block(n + 1)
            continue
        if variant in ("dtps", "dynamicvit"):
            # before the block, int(N0 x cumulative keep) of the stage's initial count
            kept = int(PATCHES * KEEP ** (LOCS.index(index) + 1) + 1e-9)
            total += predictor(n) + (n - kept) * kept * DIM * (variant == "dtps")
            total += block(kept + 1)
            n = kept
        else:  # etps, evit: after the attention residual, ceil(keep x present)
            kept = math.ceil(KEEP * n - 1e-9)
            cls_row = (n + 1) * DIM if fused_attn else 0  # q_cls @ k^T beside the fused kernel
            squeeze = (n - kept) * kept * DIM if variant == "etps" else 0
            after = kept + (1 if variant == "evit" else 0)  # EViT's fused token
            total += cls_row + squeeze + block(n + 1, after + 1)
            n = after
    return total + tail(n + 1)


def tome_hand(first: int, r: int) -> int:
    total, t = stem(), PATCHES + 1
    for index in range(DEPTH):
        if index < first:
            total += block(t)
            continue
        merged = min(r, (t - 1) // 2)  # the class token is protected: half of the rest at most
        matching = ((t + 1) // 2) * (t // 2) * (DIM // HEADS)  # on the head-mean keys
        total += block(t, t - merged) + matching
        t -= merged
    return total + tail(t)


def test_the_base_counts_like_a_hand_count():
    assert count_macs(vit(), SIZE) == stem() + DEPTH * block(PATCHES + 1) + tail(PATCHES + 1)


@pytest.mark.parametrize("fused_attn", [True, False])
@pytest.mark.parametrize("variant", ["dtps", "dynamicvit", "etps", "evit"])
def test_a_compressed_vit_counts_like_a_hand_count(variant, fused_attn):
    compressed = vitcompress.compress(vit(fused_attn), variant, [KEEP] * len(LOCS), LOCS, SIZE)
    assert count_macs(compressed, SIZE) == hand(variant, fused_attn)


@pytest.mark.parametrize("fused_attn", [True, False])
@pytest.mark.parametrize("r", [2, 5])
def test_tome_counts_like_a_hand_count(r, fused_attn):
    compressed = vitcompress.compress(
        vit(fused_attn), "tome", None, [1], SIZE, variant_args={"r": r}
    )
    assert count_macs(compressed, SIZE) == tome_hand(1, r)


@pytest.mark.parametrize(
    ("locs", "keep"), [([1, 2], 0.7), ([0, 1, 2, 3], 0.8), ([0, 1, 2, 3], 0.5)]
)
@pytest.mark.parametrize("fused_attn", [True, False])
def test_the_searchs_analytic_macs_equal_the_counted_ones_on_a_vit(fused_attn, locs, keep):
    model = vit(fused_attn)
    _, model_map = capture_and_map(model, SIZE)
    cost = profile(model, model_map)
    assert cost.base_macs == count_macs(model, SIZE)
    for variant in ("dtps", "dynamicvit", "etps", "evit", "tome"):
        keeps = [keep] * len(locs)
        plan = make_plan(model_map, get_variant(variant), keeps, locs)
        compressed = vitcompress.compress(model, variant, keeps, locs, SIZE)
        assert cost.macs(plan) == count_macs(compressed, SIZE), variant


@pytest.mark.parametrize("variant", ["dtps", "etps", "evit", "tome"])
def test_a_compressed_count_is_per_image_whatever_the_batch_and_dtype(variant):
    keep = None if variant == "tome" else [KEEP] * len(LOCS)
    extra = {"variant_args": {"r": 3}} if variant == "tome" else {}
    compressed = vitcompress.compress(vit(), variant, keep, LOCS, SIZE, **extra).eval()
    one = count_macs(compressed, SIZE)
    images = torch.randn(3, *SIZE)
    with torch.no_grad():
        assert count_call_macs(lambda: compressed(images)) == 3 * one
    assert count_macs(compressed.to(torch.bfloat16), SIZE) == one


@pytest.mark.parametrize("variant", ["dtps", "dynamicvit", "etps", "evit", "tome"])
def test_a_compressed_models_parameters_are_the_bases_and_its_predictors(variant):
    base = vit()
    keep = None if variant == "tome" else [KEEP] * len(LOCS)
    extra = {"variant_args": {"r": 3}} if variant == "tome" else {}
    compressed = vitcompress.compress(base, variant, keep, LOCS, SIZE, **extra)
    predictors = len(LOCS) * predictor_params() if variant in ("dtps", "dynamicvit") else 0
    assert count_params(base) == sum(p.numel() for p in base.parameters())
    assert count_params(compressed) == count_params(base) + predictors


def test_weights_shared_in_the_base_are_counted_once_in_the_compressed_model():
    base = vit()
    for later in base.blocks[1:]:
        later.mlp = base.blocks[0].mlp  # one MLP for every block
    base.blocks[1].attn.qkv.weight = base.blocks[0].attn.qkv.weight
    mlp = sum(p.numel() for p in base.blocks[0].mlp.parameters())
    unshared = sum(p.numel() for p in vit().parameters())
    assert count_params(base) == unshared - (DEPTH - 1) * mlp - 3 * DIM * DIM
    compressed = vitcompress.compress(base, "dtps", [KEEP] * len(LOCS), LOCS, SIZE)
    assert count_params(compressed) == count_params(base) + len(LOCS) * predictor_params()
