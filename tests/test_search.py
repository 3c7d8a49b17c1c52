"""``vitcompress.search``: the candidate space, analytic MACs, the Pareto front, the strategy,
the predictor warm-up and the resumable cache (workflow level, tiny models)."""

from __future__ import annotations

import json
import math

import pytest
import timm
import torch
from torch.utils.data import TensorDataset

import vitcompress
import vitcompress.zoo  # noqa: F401 - registers pvt_* into timm
from tests.models import timm_small
from vitcompress.api import capture_and_map
from vitcompress.compilation.plan import make_plan
from vitcompress.loading import LoadedModel, ModelSource
from vitcompress.measure import count_macs
from vitcompress.search.cache import CACHE_NAME
from vitcompress.search.cost import profile, relative_error
from vitcompress.search.driver import Budget, SearchConfig, SearchError, search
from vitcompress.search.pareto import pareto_front
from vitcompress.search.score import CandidateBuilder, agreement_metrics
from vitcompress.search.space import Candidate, build_space
from vitcompress.search.strategy import match_budget
from vitcompress.search.warmup import block_signals, warm_predictors
from vitcompress.variants import get_variant

SIZE = (3, 32, 32)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_vit():
    return timm_small("vit_small_patch16_224").eval()


def pvt():
    return timm.create_model("pvt_v2_b0", num_classes=10).eval(), (3, 64, 64)


# ------------------------------------------------------------------------------------------------
# Space


def test_single_stage_space_is_every_set_of_one_to_four_blocks():
    _, model_map = capture_and_map(tiny_vit(), SIZE)
    space = build_space(model_map, ["etps"])
    sets = list(space.location_sets())
    assert len(sets) == 4 + 6 + 4 + 1 and len(set(sets)) == len(sets)
    assert all(list(s) == sorted(s) for s in sets)
    assert space.allows((0, 2)) and not space.allows((2, 0)) and not space.allows((1, 1))


def test_a_pyramid_gets_at_most_one_location_per_stage():
    model, size = pvt()
    _, model_map = capture_and_map(model, size)
    space = build_space(model_map, ["etps"])
    assert space.one_per_group and space.groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    sets = list(space.location_sets())
    # k stages out of 4, one of 2 blocks in each: sum C(4, k) 2^k
    assert len(sets) == sum(math.comb(4, k) * 2**k for k in range(1, 5))
    stage = {b: i for i, g in enumerate(space.groups) for b in g}
    assert all(len({stage[b] for b in s}) == len(s) for s in sets)
    assert not space.allows((2, 3))


# ------------------------------------------------------------------------------------------------
# Analytic MACs


PLANS = [
    ("etps", [0.6], [1, 2, 3]),
    ("evit", [0.5], [1, 3]),
    ("dtps", [0.7, 0.6, 0.5], [1, 2, 3]),
    ("dynamicvit", [0.4], [2]),
    ("tome", [0.5], [1]),  # r fitted to the cumulative keep, merging in blocks 1-3
    ("tome", [0.8, 0.7, 0.6], [1, 2, 3]),  # a ratio per merging block (a saved plan's form)
]


@pytest.mark.parametrize("variant, keep, locs", PLANS)
def test_analytic_macs_equal_the_counted_macs_on_a_vit(variant, keep, locs):
    model = tiny_vit()
    _, model_map = capture_and_map(model, SIZE)
    cost = profile(model, model_map)
    assert cost.base_macs == count_macs(model, SIZE)
    plan = make_plan(model_map, get_variant(variant), keep, locs)
    compressed = vitcompress.compress(model, variant, keep, locs, SIZE).eval()
    counted = count_macs(compressed, SIZE)
    assert counted < 0.95 * cost.base_macs  # a real reduction is being counted
    assert relative_error(cost.macs(plan), counted) < 0.01


@pytest.mark.parametrize(
    "variant, keep, locs", [("etps", [0.5], [2, 4, 6]), ("dtps", [0.7, 0.5], [3, 6])]
)
def test_analytic_macs_equal_the_counted_macs_on_a_hybrid(variant, keep, locs):
    model, size = pvt()  # spatial-reduction attention, a conv in the MLP, four stages
    _, model_map = capture_and_map(model, size)
    cost = profile(model, model_map)
    plan = make_plan(model_map, get_variant(variant), keep, locs)
    counted = count_macs(vitcompress.compress(model, variant, keep, locs, size).eval(), size)
    assert counted < 0.97 * cost.base_macs
    assert relative_error(cost.macs(plan), counted) < 0.015


def test_tokens_per_block_follow_the_plan():
    model = tiny_vit()
    _, model_map = capture_and_map(model, SIZE)
    cost = profile(model, model_map)
    # dTPS before block 1 keeps int(64 * 0.5) = 32; eTPS in block 1 keeps ceil(0.5 * 64) = 32
    assert cost.tokens_per_block(make_plan(model_map, get_variant("dtps"), [0.5], [1])) == [
        65,
        33,
        33,
        33,
    ]
    assert cost.tokens_per_block(make_plan(model_map, get_variant("etps"), [0.5], [1])) == [
        65,
        65,
        33,
        33,
    ]
    assert cost.tokens_per_block(make_plan(model_map, get_variant("evit"), [0.5], [1])) == [
        65,
        65,
        34,
        34,
    ]
    # ToMe from block 1: r = round(64 * 0.2) = 13, then round(51 * 0.3) = 15, merged after the
    # attention of blocks 1, 2, 3
    tome = make_plan(model_map, get_variant("tome"), [0.8, 0.7, 0.6], [1, 2, 3])
    assert cost.tokens_per_block(tome) == [65, 65, 52, 37]


def test_a_single_location_variant_gets_single_locations():
    _, model_map = capture_and_map(tiny_vit(), SIZE)
    space = build_space(model_map, ["etps", "tome"], single_location=["tome"])
    assert list(space.location_sets("tome")) == [(0,), (1,), (2,), (3,)]
    assert len(list(space.location_sets("etps"))) == 15
    assert space.allows((0, 2), "etps") and not space.allows((0, 2), "tome")
    # A pyramid plans each stage on its own: one location per stage, as for every variant.
    model, size = pvt()
    _, model_map = capture_and_map(model, size)
    pyramid = build_space(model_map, ["etps", "tome"], single_location=["tome"])
    assert list(pyramid.location_sets("tome")) == list(pyramid.location_sets("etps"))


# ------------------------------------------------------------------------------------------------
# Pareto front, budget matching, metrics


def test_pareto_front_on_hand_made_points():
    points = [(1.0, 0.1), (2.0, 0.5), (2.0, 0.4), (3.0, 0.3), (4.0, 0.9), (0.5, 0.05), (5, 0.9)]
    front = pareto_front(points, cost=lambda p: p[0], score=lambda p: p[1])
    assert front == [(0.5, 0.05), (1.0, 0.1), (2.0, 0.5), (4.0, 0.9)]
    assert pareto_front([], cost=lambda p: p, score=lambda p: p) == []


def test_budget_matching_takes_the_largest_keep_that_fits():
    model = tiny_vit()
    _, model_map = capture_and_map(model, SIZE)
    cost_model = profile(model, model_map)
    space = build_space(model_map, ["etps"])

    def cost(c):
        return cost_model.macs(c.plan(model_map))

    budget = 0.7 * cost_model.base_macs
    matched = match_budget("etps", (1, 2), space, cost, budget)
    assert matched is not None and cost(matched) <= budget
    grid = sorted(space.keep_grid)
    higher = grid[grid.index(matched.keep[0]) + 1]
    assert cost(Candidate("etps", (1, 2), (higher, higher))) > budget
    assert match_budget("etps", (3,), space, cost, 0.1 * cost_model.base_macs) is None


def test_agreement_metrics():
    base = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    same = agreement_metrics(base.clone(), base, torch.tensor([0, 2]))
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["agreement"] == 1.0
    assert same["accuracy"] == 0.5 and same["score"] == pytest.approx(0.0, abs=1e-6)
    other = agreement_metrics(torch.tensor([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0]]), base, None)
    assert other["kl"] > 0.1 and other["agreement"] == 0.5 and other["accuracy"] is None


# ------------------------------------------------------------------------------------------------
# Predictor warm-up


def test_warmed_predictor_keeps_the_tokens_the_attention_ranks_highest():
    model = tiny_vit()
    builder = CandidateBuilder(model, SIZE)
    images = torch.randn(16, *SIZE, generator=torch.Generator().manual_seed(1))
    signals = block_signals(builder, images, [1, 2], batch_size=8)
    assert signals[1].tokens.shape == (16, 64, 64) and signals[1].attention.shape == (16, 64)

    def overlap(compressed) -> float:
        predictor = list(compressed.tps.children())[0].predictor
        with torch.no_grad():
            scores = predictor.keep_score(signals[1].tokens.float())
        chosen = scores.topk(32, dim=1).indices
        wanted = signals[1].attention.topk(32, dim=1).indices
        return sum(
            len(set(a.tolist()) & set(b.tolist())) for a, b in zip(chosen, wanted, strict=True)
        ) / (16 * 32)

    fresh = builder.build("dtps", [0.5], [1, 2])
    before = overlap(fresh)
    losses = warm_predictors(fresh, signals, [1, 2], steps=150, batch=8)
    after = overlap(fresh)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert after > 0.75 and after > before + 0.15


# ------------------------------------------------------------------------------------------------
# The workflow: budgets, cache, resume


def loaded_tiny() -> LoadedModel:
    return LoadedModel(model=tiny_vit(), source=ModelSource(spec="tiny"), input_size=SIZE)


def calibration_set(count: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(count, *SIZE, generator=generator), torch.randint(0, 10, (count,))
    )


def config(out, **extra) -> SearchConfig:
    settings = dict(
        budget=Budget(max_gmacs_ratio=0.7),
        variants=["etps", "evit"],
        out=out,
        calib_images=12,
        batch_size=8,
        max_candidates=6,
        identity={"model": "tiny"},
    )
    settings.update(extra)
    return SearchConfig(**settings)


class Stop(Exception):
    pass


def test_a_stopped_search_resumes_without_scoring_again(tmp_path):
    whole = search(loaded_tiny(), calibration_set(), config(tmp_path / "whole")).data
    assert whole["strategy"] == "evolutionary" and whole["scored_now"] == 6

    def stop_after_three(scored_now: int) -> None:
        if scored_now == 3:
            raise Stop

    out = tmp_path / "stopped"
    with pytest.raises(Stop):
        search(loaded_tiny(), calibration_set(), config(out, on_scored=stop_after_three))
    lines = (out / CACHE_NAME).read_text().splitlines()
    assert len(lines) == 1 + 3  # the settings, then one line per scored candidate
    with open(out / CACHE_NAME, "a") as f:
        f.write('{"key": "etps|1|0.5", "score"')  # a line torn by a kill mid-write
    resumed = search(loaded_tiny(), calibration_set(), config(out)).data
    assert resumed["scored_now"] == 3 and resumed["from_cache"] == 3
    keys = {(r["variant"], tuple(r["locs"]), tuple(r["keep"])) for r in resumed["candidates"]}
    assert keys == {(r["variant"], tuple(r["locs"]), tuple(r["keep"])) for r in whole["candidates"]}
    assert resumed["best"]["score"] == whole["best"]["score"]
    again = search(loaded_tiny(), calibration_set(), config(out)).data
    assert again["scored_now"] == 0


def test_a_search_over_another_keep_grid_does_not_bring_back_the_first_grids_rows(tmp_path):
    first = search(
        loaded_tiny(),
        calibration_set(),
        config(tmp_path, variants=["etps"], keep_grid=(0.4, 0.6), max_candidates=20),
    ).data
    assert {k for r in first["candidates"] for k in r["keep"]} <= {0.4, 0.6}
    second = search(
        loaded_tiny(),
        calibration_set(),
        config(tmp_path, variants=["etps"], keep_grid=(0.5, 0.7), max_candidates=20),
    ).data
    # The paper's placements are seeds of every search, on the grid or not.
    seeds = {
        (r["variant"], tuple(r["locs"]), tuple(r["keep"]))
        for r in second["paper_defaults"] or []
        if r
    }
    off_grid = [
        r
        for r in second["candidates"]
        if not set(r["keep"]) <= {0.5, 0.7}
        and (r["variant"], tuple(r["locs"]), tuple(r["keep"])) not in seeds
    ]
    assert first["candidates"] and off_grid == []


def test_a_search_for_other_methods_does_not_bring_back_the_first_searchs_rows(tmp_path):
    first = search(
        loaded_tiny(), calibration_set(), config(tmp_path, variants=["etps"], max_candidates=4)
    ).data
    assert {r["variant"] for r in first["candidates"]} == {"etps"}
    second = search(
        loaded_tiny(), calibration_set(), config(tmp_path, variants=["evit"], max_candidates=4)
    ).data
    assert {r["variant"] for r in second["candidates"]} == {"evit"}
    assert second["best"]["variant"] == "evit" and second["scored_now"] > 0


def test_a_cache_from_other_settings_is_refused(tmp_path):
    search(loaded_tiny(), calibration_set(), config(tmp_path, max_candidates=2))
    with pytest.raises(SearchError, match="calib_images"):
        search(loaded_tiny(), calibration_set(), config(tmp_path, calib_images=10))


def test_a_folder_the_search_did_not_write_is_refused_and_kept(tmp_path):
    """Its plan.yaml and search.json would replace the user's files of the same names."""
    (tmp_path / "plan.yaml").write_text("my own plan\n")
    with pytest.raises(SearchError, match="exists and is not a search output"):
        search(loaded_tiny(), calibration_set(), config(tmp_path, max_candidates=2))
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]
    assert (tmp_path / "plan.yaml").read_text() == "my own plan\n"


def test_exhaustive_when_the_matched_candidates_are_few(tmp_path):
    data = search(
        loaded_tiny(), calibration_set(), config(tmp_path, variants=["etps"], max_candidates=20)
    ).data
    assert data["strategy"] == "exhaustive"
    assert data["scored"] == data["space"]["budget_matched"] <= 15
    budget = data["budget"]["macs"]
    assert all(r["macs"] <= budget for r in data["candidates"])
    assert data["best"]["score"] == max(r["score"] for r in data["candidates"])
    assert data["macs_check"]["max_relative_error"] < 0.01
    assert json.loads((tmp_path / "search.json").read_text())["best"] == data["best"]


def test_tome_is_searched_at_one_location_with_exact_analytic_macs(tmp_path):
    data = search(
        loaded_tiny(),
        calibration_set(),
        config(
            tmp_path,
            variants=["tome"],
            max_candidates=20,
            budget=Budget(max_gmacs_ratio=0.85),
        ),
    ).data
    assert data["space"]["left_out"] == {} and data["strategy"] == "exhaustive"
    rows = [r for r in data["candidates"] if r["variant"] == "tome"]
    # One per single location within the budget; the paper default (blocks 1, 2, 3 at 0.5 on
    # this 4-block model) is scored as the same plan, from block 1 at the cumulative keep.
    assert {tuple(r["locs"]) for r in rows} <= {(0,), (1,), (2,), (3,)} and len(rows) >= 2
    assert [tuple(r["locs"]) for r in data["paper_defaults"]] == [(1,)]
    assert data["macs_check"]["max_relative_error"] < 0.01
    best = data["best"]
    model = vitcompress.compress(tiny_vit(), "tome", best["keep"], best["locs"], SIZE).eval()
    assert count_macs(model, SIZE) <= data["budget"]["macs"]


def test_a_neighbour_in_tome_starts_at_the_parents_first_block():
    from vitcompress.search.space import valid
    from vitcompress.search.strategy import neighbours

    model = tiny_vit()
    _, model_map = capture_and_map(model, SIZE)
    profile_ = profile(model, model_map)
    space = build_space(model_map, ["etps", "tome"], single_location=["tome"])

    def cost(candidate):
        plan = valid(candidate, model_map)
        return None if plan is None else profile_.macs(plan)

    parent = Candidate("etps", (1, 2, 3), (0.7, 0.7, 0.7))
    children = neighbours(parent, space, ["etps", "tome"], cost, 0.85 * profile_.base_macs)
    tome = [c for c in children if c.variant == "tome"]
    assert [c.locs for c in tome] == [(1,)]


def test_an_evolutionary_search_keeps_tome_at_one_location(tmp_path):
    settings = dict(
        variants=["tome", "etps"], max_candidates=5, budget=Budget(max_gmacs_ratio=0.85)
    )
    data = search(loaded_tiny(), calibration_set(), config(tmp_path, **settings)).data
    assert data["strategy"] == "evolutionary"
    tome = [r for r in data["candidates"] if r["variant"] == "tome"]
    assert tome and all(len(r["locs"]) == 1 for r in tome)
    # An older cache's ToMe row at several locations is not taken back as a parent.
    with open(tmp_path / CACHE_NAME, "a") as f:
        row = {**tome[0], "locs": [0, 2], "keep": [0.9, 0.9], "score": 1e9}
        f.write(json.dumps({"key": "tome|0,2|0.9,0.9", **row}) + "\n")
    again = search(loaded_tiny(), calibration_set(), config(tmp_path, **settings)).data
    tome_again = [r for r in again["candidates"] if r["variant"] == "tome"]
    assert tome_again and all(len(r["locs"]) == 1 for r in tome_again)


def test_an_impossible_budget_names_the_smallest_candidate(tmp_path):
    with pytest.raises(SearchError, match=r"no candidate reaches 0.05 of the GMACs; the smallest"):
        search(
            loaded_tiny(), calibration_set(), config(tmp_path, budget=Budget(max_gmacs_ratio=0.05))
        )
    with pytest.raises(SearchError, match="a budget is required"):
        search(loaded_tiny(), calibration_set(), config(tmp_path, budget=Budget()))


def test_min_speedup_bounds_the_macs_then_takes_the_best_candidate_that_is_fast_enough(
    tmp_path, monkeypatch
):
    from vitcompress.measure.models import Measurement
    from vitcompress.search import driver as workflow

    timed: list[tuple] = []
    speeds = iter([1.1, 1.6, 1.9])  # the best-scored candidate misses 1.5x, the second makes it

    def fake_measure(models, input_size, timing):
        timed.append(tuple(models))
        return {name: Measurement(params=0, macs=0) for name in models}, {}

    def fake_speedup(model, base):
        from vitcompress.measure.paired import PairedRatio

        return PairedRatio(median=next(speeds), low=None, high=None, pairs=3)

    monkeypatch.setattr(workflow, "measure_models", fake_measure)
    monkeypatch.setattr(workflow, "speedup", fake_speedup)
    data = search(
        loaded_tiny(), calibration_set(), config(tmp_path, budget=Budget(min_speedup=1.5))
    ).data
    assert data["budget"]["macs"] == pytest.approx(data["base_macs"] / 1.5)
    ranked = sorted(
        (r for r in data["candidates"] if r["macs"] <= data["budget"]["macs"]),
        key=lambda r: -r["score"],
    )
    assert len(timed) == 2 and data["speedup"]["target"] == 1.5
    assert data["best"]["score"] == ranked[1]["score"] and data["best"]["speedup"] == 1.6
    with pytest.raises(SearchError, match=r"1/50 of the GMACs \(--min-speedup 50\)"):
        search(loaded_tiny(), calibration_set(), config(tmp_path, budget=Budget(min_speedup=50)))
