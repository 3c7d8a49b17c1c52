"""MACs of a reduced ConViT, whose gated positional self-attention (GPSA) scores every (query,
key) pair by its relative position, against a count by hand.

A GPSA block runs a linear layer of 3 -> heads over its table of relative positions (N x N x
3), before the softmax that mixes it with the patch attention: ``N x N x 3 x heads`` MACs. A
reduction before such a block gathers the table's rows and columns by the kept tokens, so that
layer runs on the kept tokens' pairs: it grows with queries x keys, as the attention products
do, not with the tokens. The search's analytic MACs must count it so.
"""

from __future__ import annotations

import math

import pytest
import timm
from torch import nn

import vitcompress
from tests.test_counts_hand_attention import LN, conv
from vitcompress.api import capture_and_map
from vitcompress.compilation.plan import make_plan
from vitcompress.measure import count_macs
from vitcompress.search.cost import profile
from vitcompress.variants import get_variant

pytestmark = pytest.mark.usefixtures("one_thread")

IMG, DEPTH, LOCAL, DIM, HEADS, CLASSES, KEEP = 64, 4, 2, 192, 4, 10, 0.7
SIZE = (3, IMG, IMG)
PATCHES = (IMG // 16) ** 2
HIDDEN = 4 * DIM


def convit() -> nn.Module:
    return timm.create_model(
        "convit_tiny",
        num_classes=CLASSES,
        img_size=IMG,
        depth=DEPTH,
        local_up_to_layer=LOCAL,
    ).eval()


def mlp(tokens: int) -> int:
    return LN * tokens * DIM + 2 * tokens * DIM * HIDDEN  # norm2, fc1, fc2


def gpsa(tokens: int) -> int:
    """A GPSA block's attention on ``tokens`` (no class token yet): norm1, q and k, v, the
    positional scores of every pair, q @ k^T and attn @ v, the output projection."""
    linear = LN * tokens * DIM + 3 * tokens * DIM * DIM + tokens * DIM * DIM
    return linear + tokens * tokens * 3 * HEADS + 2 * tokens * tokens * DIM


def mhsa(tokens: int) -> int:
    """A plain attention on ``tokens`` (the class token among them)."""
    return LN * tokens * DIM + 4 * tokens * DIM * DIM + 2 * tokens * tokens * DIM


def predictor(tokens: int) -> int:
    """DynamicViT's predictor on ``tokens`` patch tokens: LayerNorm, C->C, the local half
    C/2->C/2 per token and the global half once, C/2->C/4, C/4->2."""
    half, quarter = DIM // 2, DIM // 4
    per_token = 5 * DIM + DIM * DIM + half * half + half * quarter + quarter * 2
    return tokens * per_token + half * half


def hand(variant: str, blocks: list[int]) -> int:
    """MACs of ``variant`` at ``blocks`` (GPSA blocks) at KEEP: eTPS after the attention residual
    (ceil of the tokens present), dTPS before the block (of the initial count), each squeezing
    the pruned tokens into the kept ones (pruned x kept x C)."""
    total, n = conv(PATCHES, 3, DIM, 16), PATCHES
    for index in range(DEPTH):
        if index >= LOCAL:  # the class token joins before the first plain block
            n = PATCHES  # in a new stage: the GPSA stage's tokens are given back on its grid
            total += mhsa(n + 1) + mlp(n + 1)
            continue
        if index not in blocks:
            total += gpsa(n) + mlp(n)
        elif variant == "dtps":
            kept = int(PATCHES * KEEP ** (blocks.index(index) + 1) + 1e-9)
            total += predictor(n) + (n - kept) * kept * DIM + gpsa(kept) + mlp(kept)
            n = kept
        else:  # etps: the softmax in the graph gives the received attention for free
            kept = math.ceil(KEEP * n - 1e-9)
            total += gpsa(n) + (n - kept) * kept * DIM + mlp(kept)
            n = kept
    return total + LN * (n + 1) * DIM + DIM * CLASSES  # final norm on every token, head


CASES = [("etps", [0]), ("etps", [0, 1]), ("dtps", [0]), ("dtps", [1])]


@pytest.mark.parametrize(("variant", "blocks"), CASES)
def test_a_compressed_convit_counts_like_a_hand_count(variant, blocks):
    compressed = vitcompress.compress(convit(), variant, [KEEP] * len(blocks), blocks, SIZE)
    assert count_macs(compressed, SIZE) == hand(variant, blocks)


@pytest.mark.parametrize(("variant", "blocks"), CASES)
def test_the_searchs_analytic_macs_scale_the_pairwise_positions_with_queries_x_keys(
    variant, blocks
):
    model = convit()
    _, model_map = capture_and_map(model, SIZE)
    cost = profile(model, model_map)
    assert cost.base_macs == hand(variant, []) == count_macs(model, SIZE)
    plan = make_plan(model_map, get_variant(variant), [KEEP] * len(blocks), blocks)
    assert cost.macs(plan) == hand(variant, blocks)
