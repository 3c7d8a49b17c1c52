"""Cumulative keep lists (the official configs' form) become per-location ratios whose plan keeps
exactly the official token counts, ``int(N0 * fraction)``, at every location."""

from __future__ import annotations

import pytest
import timm

from tests.models import timm_small
from vitcompress.api import map_model
from vitcompress.compilation.plan import make_plan
from vitcompress.method import KeepListError, per_location_keep
from vitcompress.variants import get_variant

OFFICIAL_DEIT_S = [0.7, 0.49, 0.343]  # keep_ratio_list of the official DeiT-S configs


@pytest.fixture(scope="module")
def deit_small_map():
    return map_model(timm.create_model("deit_small_patch16_224"), (3, 224, 224))


@pytest.fixture(scope="module")
def small_map():  # 8 x 8 = 64 patch tokens, 4 blocks
    return map_model(timm_small("vit_small_patch16_224"), (3, 32, 32))


def planned_counts(model_map, fractions: list[float], locs: list[int]) -> list[int]:
    stages = [model_map.blocks[b].stage for b in locs]
    grids = [model_map.stages[s].grid for s in stages]
    ratios = per_location_keep(fractions, stages, [h * w for h, w in grids])
    plan = make_plan(model_map, get_variant("dtps"), ratios, locs)
    for loc, fraction in zip(plan.locations, fractions, strict=True):
        assert loc.cumulative_keep == pytest.approx(fraction, rel=1e-9)  # the ratio loss target
    return [loc.keep_tokens for loc in plan.locations]


def test_official_deit_small_list_gives_the_official_counts(deit_small_map):
    assert deit_small_map.blocks[0].tokens == 197
    counts = planned_counts(deit_small_map, OFFICIAL_DEIT_S, [3, 6, 9])
    # The official code: num_keep_node = int(init_n * keep_ratio_list[p]), init_n = 196.
    assert counts == [int(196 * c) for c in OFFICIAL_DEIT_S] == [137, 96, 67]
    ratios = per_location_keep(OFFICIAL_DEIT_S, [0, 0, 0], [196] * 3)
    assert ratios == [0.7, 0.7, 0.7]  # what --keep 0.7 means: the same plan


def test_counts_are_exact_where_the_fraction_lands_on_an_integer(small_map):
    # k / 64 fractions: N0 * fraction is an integer, so a product one ulp low would lose a token.
    # The plain quotients c_s / c_{s-1} do lose one on several of these lists.
    checked = 0
    for a in range(64, 0, -9):
        for b in range(a, 0, -7):
            for c in range(b, 0, -5):
                fractions = [a / 64, b / 64, c / 64]
                assert planned_counts(small_map, fractions, [1, 2, 3]) == [a, b, c]
                checked += 1
    assert checked > 50


def test_fractions_restart_at_each_stage():
    # A pyramid: each stage's fractions are of its own initial grid.
    ratios = per_location_keep([0.7, 0.49, 0.7], stages=[1, 1, 2], patch_tokens=[784, 784, 196])
    assert ratios == [0.7, 0.7, 0.7]


@pytest.mark.parametrize(
    "fractions, message",
    [
        ([0.7, 0.8, 0.5], "must not increase"),
        ([0.7, 0.49], "has 2 values for 3 locations"),
        ([0.7, 0.49, 0.343, 0.2], "has 4 values for 3 locations"),
        ([1.2, 0.49, 0.343], "must be in (0, 1]"),
        ([0.7, 0.49, 0.0], "must be in (0, 1]"),
        ([0.7, 0.49, -0.3], "must be in (0, 1]"),
        ([0.7, float("nan"), 0.3], "must be in (0, 1]"),
        ([0.7, "x", 0.3], "must be numbers"),
    ],
)
def test_bad_lists_are_one_line(fractions, message):
    with pytest.raises(KeepListError, match=message.replace("(", r"\(").replace("]", r"\]")) as e:
        per_location_keep(fractions, [0, 0, 0], [196] * 3)
    assert "\n" not in str(e.value)


def test_equal_fractions_mean_keeping_all_at_that_location():
    assert per_location_keep([0.5, 0.5], [0, 0], [196, 196]) == [0.5, 1.0]
