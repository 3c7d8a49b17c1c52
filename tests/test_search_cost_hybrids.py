"""The search's analytic MACs equal the counted MACs of the compressed model on hybrid families.

A reduced pyramid block gives its grid ops the full grid back: with the ``value``/``delta``
restores the residual stream is restored and the norm before the grid runs again on the full
tokens (PVT's spatial-reduction conv, CvT's conv projections); with ``host``/``zero`` the tokens
are restored after it, so a stage's norm before its exit grid runs on the tokens left. CvT's
BatchNorm after its query's conv runs on the grid, and its final norm on the tokens left after
blocks whose keys are pooled. CaiT's talking heads act on the (queries x keys) map. Tokens a
model reads by position (its output, a stage's exit grid) are restored after the norm before
them (``host``/``zero``), or the stream before it (``value``/``delta``).
"""

from __future__ import annotations

import importlib.util

import pytest
import timm
from torch import nn

import vitcompress
from tests.fixtures import dense_models
from vitcompress.api import capture_and_map
from vitcompress.compilation.plan import make_plan
from vitcompress.measure import count_macs
from vitcompress.search.cost import CostModel, profile
from vitcompress.variants import get_variant

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = (3, 64, 64)

MODELS = {
    "pvt_v2_b0": lambda: timm.create_model("pvt_v2_b0", num_classes=2),
    "pvt_v1": lambda: timm.create_model("pvt_tiny", num_classes=2, img_size=64),  # the zoo's
    # One block in each of the first two stages, two in the last (the class token's).
    "cvt_13": lambda: timm.create_model("cvt_13", num_classes=2, depths=(1, 1, 2)),
    "cait": lambda: timm.create_model(
        "cait_xxs24_224", num_classes=2, img_size=64, depth=4, depth_token_only=1
    ),
}

CASES = [
    # Locations in three stages: every later block of a reduced stage restores its grid ops.
    ("pvt_v2_b0", "dtps", [1, 3, 5], None),
    ("pvt_v2_b0", "dynamicvit", [1, 3, 5], None),
    ("pvt_v2_b0", "etps", [0, 2, 4, 6], None),
    ("pvt_v2_b0", "evit", [0, 2, 4, 6], None),
    ("pvt_v2_b0", "etps", [0, 2, 4, 6], "zero"),
    ("pvt_v2_b0", "dtps", [1, 3, 5], "host"),
    ("pvt_v1", "dtps", [1, 3, 5], None),
    ("pvt_v1", "etps", [0, 2, 4, 6], None),
    ("pvt_v1", "evit", [0, 2, 4, 6], "zero"),
    ("cvt_13", "dtps", [1, 2, 3], None),
    ("cvt_13", "dynamicvit", [1, 2, 3], "zero"),
    ("cvt_13", "etps", [2, 3], None),
    ("cvt_13", "evit", [2], None),
    ("cvt_13", "etps", [2], "host"),
    ("cait", "etps", [1, 2, 3], None),
    ("cait", "evit", [0, 2], None),
]


@pytest.fixture(scope="module")
def profiled() -> dict[str, tuple[nn.Module, object, CostModel]]:
    found = {}
    for name, factory in MODELS.items():
        model = factory().eval()
        _, model_map = capture_and_map(model, SIZE)
        found[name] = (model, model_map, profile(model, model_map))
    return found


@pytest.mark.parametrize(("family", "variant", "locs", "restore"), CASES)
def test_the_analytic_macs_are_the_counted_ones(profiled, family, variant, locs, restore):
    model, model_map, cost = profiled[family]
    assert cost.base_macs == count_macs(model, SIZE)
    settings = {} if restore is None else {"restore": restore}
    keep = [0.6] * len(locs)
    plan = make_plan(model_map, get_variant(variant, settings), keep, locs)
    compressed = vitcompress.compress(model, variant, keep, locs, SIZE, variant_args=settings)
    counted = count_macs(compressed, SIZE)
    assert counted < 0.97 * cost.base_macs  # a real reduction is counted
    assert abs(cost.macs(plan) - counted) < 0.5  # the same count, float rounding aside


def _transformers_pvt_v2() -> tuple[nn.Module, tuple[int, ...]]:
    from tests.fixtures import hf_models

    model, size = hf_models.build("hf_pvt_v2", seed=0)
    return hf_models.sharpen(hf_models.Logits(model)).eval(), size


READERS = [
    # The segmentation head on the patch tokens, after the final norm, reads them as a grid.
    ("dense_segmenter", "etps", None),
    ("dense_segmenter", "dtps", "zero"),
    # The output's tokens restored; the pooler still reads the class token of the final norm's.
    ("dense_hf_dinov2", "evit", None),
    ("dense_hf_dinov2", "tome", "zero"),
    # A stage's norm before each exit grid; the last stage's too, before the head's pooling.
    ("hf_pvt_v2", "dtps", None),
    ("hf_pvt_v2", "etps", "zero"),
]


@pytest.mark.parametrize(("family", "variant", "restore"), READERS)
def test_the_analytic_macs_are_the_counted_ones_where_tokens_are_read(family, variant, restore):
    if family.startswith(("dense_hf", "hf_")) and not HAS_TRANSFORMERS:
        pytest.skip("needs transformers")
    if family == "hf_pvt_v2":
        model, size = _transformers_pvt_v2()
        locs = [0, 1, 2, 3]
    else:
        model, size = dense_models.build(family, seed=0)
        locs = [1, 2]
    _, model_map = capture_and_map(model, size)
    cost = profile(model, model_map)
    settings = {} if restore is None else {"restore": restore}
    locs = [1] if variant == "tome" else locs  # ToMe: one location, merging from there on
    keep = [0.6] * len(locs)
    plan = make_plan(model_map, get_variant(variant, settings), keep, locs)
    compressed = vitcompress.compress(model, variant, keep, locs, size, variant_args=settings)
    counted = count_macs(compressed, size)
    assert counted < 0.97 * cost.base_macs
    assert abs(cost.macs(plan) - counted) < 0.5
