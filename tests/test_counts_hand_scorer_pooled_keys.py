"""MACs of eTPS/EViT scoring with keys pooled by a window wider than its stride, against a count
by hand.

CvT's first two stages have no class token, so a token's score is the attention it receives;
their keys come from a 3 x 3 depthwise conv at stride 2 (padding 1), so each key reads a 3 x 3
window of tokens and the windows overlap. The score of a token is the mean score of the keys
whose window reads it: the keys' scores, and a map of ones that counts the windows reading each
token, each go through a transposed 3 x 3 convolution of one channel over the keys' grid, at
``keys x 9`` MACs each (per image). The softmax in the graph gives the attention for free. The
rest of a reduced block is the base's, its MLP on the tokens kept; TPS's squeeze adds the
similarity of every pruned token to every kept one (pruned x kept x C).
"""

from __future__ import annotations

import math

import pytest
import timm
from torch import nn

import vitcompress
import vitcompress.zoo  # noqa: F401 - registers CvT with timm
from tests.test_counts_hand_attention import LN, cvt_hand
from vitcompress.api import capture_and_map
from vitcompress.compilation.plan import make_plan
from vitcompress.measure import count_macs
from vitcompress.search.cost import profile
from vitcompress.variants import ScoringCost, get_variant

pytestmark = pytest.mark.usefixtures("one_thread")

IMG, DEPTHS, CLASSES, KEEP = 64, (1, 1, 2), 10, 0.6
SIZE = (3, IMG, IMG)
DIMS = (64, 192, 384)


def cvt() -> nn.Module:
    return timm.create_model("cvt_13", num_classes=CLASSES, depths=DEPTHS).eval()


def grids() -> list[int]:
    """Each stage's grid side: a 7 x 7 conv at stride 4 (padding 2), then 3 x 3 at stride 2."""
    side, found = IMG, []
    for kernel, stride, pad in ((7, 4, 2), (3, 2, 1), (3, 2, 1)):
        side = (side + 2 * pad - kernel) // stride + 1
        found.append(side)
    return found


def pooled_keys(side: int) -> int:
    """The keys of a grid of ``side`` x ``side`` tokens: a 3 x 3 conv at stride 2, padding 1."""
    pooled = (side + 2 - 3) // 2 + 1
    return pooled * pooled


def spread(keys: int) -> int:
    """The two transposed 3 x 3 convolutions of one channel over the keys' grid."""
    return 2 * keys * 3 * 3


def hand(variant: str, blocks: list[int]) -> int:
    """The compressed CvT's MACs: the base's, less the MLP of the tokens each reduced block
    (the only block of its stage) no longer runs, plus its scoring and its squeeze. Each stage's
    tokens are given back on its full grid for the next stage's patch embedding."""
    total = cvt_hand(IMG, DIMS, DEPTHS)  # with a head of 10 classes
    for block in blocks:  # blocks 0 and 1: stages 0 and 1, one block each
        side, dim = grids()[block], DIMS[block]
        tokens = side * side
        kept = math.ceil(KEEP * tokens)
        after = kept + (1 if variant == "evit" else 0)  # EViT's fused token
        squeeze = (tokens - kept) * kept * dim if variant == "etps" else 0
        mlp = LN * dim + 2 * dim * 4 * dim  # norm2, fc1, fc2 per token
        total += spread(pooled_keys(side)) + squeeze - (tokens - after) * mlp
    return total


CASES = [("etps", [0]), ("evit", [1]), ("etps", [0, 1]), ("evit", [0, 1])]


@pytest.mark.parametrize(("variant", "blocks"), CASES)
def test_a_compressed_cvt_counts_like_a_hand_count(variant, blocks):
    compressed = vitcompress.compress(cvt(), variant, [KEEP] * len(blocks), blocks, SIZE)
    assert count_macs(compressed, SIZE) == hand(variant, blocks)


@pytest.mark.parametrize(("variant", "blocks"), CASES)
def test_the_searchs_analytic_macs_count_the_spread_of_pooled_keys_scores(variant, blocks):
    model = cvt()
    _, model_map = capture_and_map(model, SIZE)
    plan = make_plan(model_map, get_variant(variant), [KEEP] * len(blocks), blocks)
    assert profile(model, model_map).macs(plan) == hand(variant, blocks)


@pytest.mark.parametrize("block", [0, 1])
def test_the_scorers_macs_are_the_spread_where_keys_are_pooled_by_overlapping_windows(block):
    side, dim = grids()[block], DIMS[block]
    keys = pooled_keys(side)
    cost = ScoringCost(
        prefix_tokens=0,
        patch_tokens=side * side,
        dim=dim,
        heads=(1, 3)[block],
        attention_width=float(dim),
        key_tokens=keys,
        cls_token=True,  # the model's, in its last stage: none in these blocks
        fused_attention=False,
        grid=(side, side),
        key_pool=((3, 3), (2, 2), (1, 1)),
    )
    for variant in ("etps", "evit"):
        assert get_variant(variant).scorer.macs(cost) == spread(keys)
    # Each key standing for its own cell (PVT's kernel equal to its stride): a nearest
    # upsampling, which counts nothing; and keys that are the block's own: nothing to spread.
    cells = ScoringCost(**{**cost.__dict__, "key_pool": ((2, 2), (2, 2), (0, 0))})
    own = ScoringCost(**{**cost.__dict__, "key_tokens": None})
    assert get_variant("etps").scorer.macs(cells) == get_variant("etps").scorer.macs(own) == 0
