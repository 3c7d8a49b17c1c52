"""``search`` on a windowed model: one candidate per method, its keep fitted to the budget with
the MACs counted, scored on calibration images like any candidate, the learned methods'
predictors warmed window by window (left out where padded windows give a location a predictor
per group)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch.utils.data import TensorDataset

from tests.test_windowed import SIZE, SWIN, _padded_swin, swin
from tests.test_windowed_families import _build
from vitcompress import compress
from vitcompress.cli.main import cli
from vitcompress.compilation.plan import PlanError
from vitcompress.compilation.rewrite import REDUCER_PREFIX
from vitcompress.loading import LoadedModel, ModelSource
from vitcompress.measure import count_macs
from vitcompress.search.driver import Budget, SearchConfig, SearchError, search
from vitcompress.search.score import CandidateBuilder
from vitcompress.search.warmup import BlockSignals, block_signals, warm_predictors
from vitcompress.search.windowed import LEARNED_LEFT_OUT_WHY, fit_on_grid


def _config(tmp_path, ratio: float, variants: list[str], **settings) -> SearchConfig:
    return SearchConfig(
        budget=Budget(max_gmacs_ratio=ratio),
        variants=variants,
        out=tmp_path,
        calib_images=16,
        batch_size=8,
        identity={"model": "swin"},
        **{"max_candidates": 8, **settings},
    )


@pytest.fixture(scope="module")
def model():
    return swin()


def _run(model, tmp_path, ratio, variants, **settings):
    loaded = LoadedModel(model=model, source=ModelSource(spec="swin"), input_size=SIZE)
    generator = torch.Generator().manual_seed(0)
    calibration = TensorDataset(
        torch.randn(16, *SIZE, generator=generator),
        torch.randint(0, 10, (16,), generator=generator),
    )
    return search(loaded, calibration, _config(tmp_path, ratio, variants, **settings)).to_json()


def test_each_method_gets_the_largest_keep_its_counted_macs_allow(model, tmp_path):
    data = _run(model, tmp_path, 0.9, ["etps", "evit", "tome", "dtps"])
    assert data["space"]["left_out"] == {}
    rows = {row["variant"]: row for row in data["candidates"]}
    assert sorted(rows) == ["dtps", "etps", "evit", "tome"]
    assert len(rows["dtps"]["warmup_loss"]) == 4  # a predictor warmed at every windowed block
    base = count_macs(model, SIZE)
    for variant, row in rows.items():
        assert row["locs"] == [0, 1, 2, 3]  # every windowed block
        keep = row["keep"][0]
        assert row["keep"] == [keep] * 4
        counted = count_macs(compress(model, variant, keep=keep, input_size=SIZE), SIZE)
        assert row["macs"] == counted <= 0.9 * base
        above = compress(model, variant, keep=round(keep + 0.01, 2), input_size=SIZE)
        assert count_macs(above, SIZE) > 0.9 * base
    best = max(rows.values(), key=lambda row: row["score"])
    assert data["best"]["variant"] == best["variant"] and data["macs_check"]["counted"]
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert (plan["variant"], plan["keep"]) == (best["variant"], best["keep"])


def test_a_keep_grid_given_is_the_keeps_tried(model, tmp_path):
    grid = (0.5, 0.6, 0.7, 0.8, 0.9)
    data = _run(model, tmp_path, 0.9, ["etps", "tome"], keep_grid=grid)
    base = count_macs(model, SIZE)
    assert data["space"]["keep_grid"] == f"the largest of {list(grid)} within the budget"
    assert sorted(row["variant"] for row in data["candidates"]) == ["etps", "tome"]
    for row in data["candidates"]:
        keep = row["keep"][0]
        assert keep in grid  # not a keep in steps of 0.01 between them
        assert row["macs"] <= 0.9 * base
        above = [k for k in grid if k > keep]
        if above:
            model_above = compress(model, row["variant"], keep=min(above), input_size=SIZE)
            assert count_macs(model_above, SIZE) > 0.9 * base


def test_a_keep_grid_under_the_budget_everywhere_is_one_line(model, tmp_path):
    with pytest.raises(SearchError) as refused:
        _run(model, tmp_path, 0.8, ["etps"], keep_grid=(0.9, 0.95))
    message = str(refused.value)
    assert "\n" not in message
    assert "etps: 0.8 is out of reach on --keep-grid: its smallest keep the method takes " in (
        message
    )
    assert "here, 0.9, costs 0." in message


def test_max_candidates_caps_the_candidates_found(model, tmp_path):
    data = _run(model, tmp_path, 0.9, ["etps", "evit", "tome"], max_candidates=2)
    assert sorted(row["variant"] for row in data["candidates"]) == ["etps", "evit"]
    assert data["space"]["left_out"] == {
        "tome": "--max-candidates 2 reached (a windowed model's search has one candidate per "
        "method, in --variants' order)"
    }


def test_a_method_out_of_reach_takes_no_place_under_max_candidates(model, tmp_path):
    # Within 0.7 of the base's MACs, eTPS needs a keep under 0.5 here (it reduces the MLP
    # only) and dTPS takes 0.5: eTPS finds no candidate, and the one place goes to dTPS.
    grid = (0.5, 0.7)
    data = _run(model, tmp_path, 0.7, ["etps", "dtps", "evit"], keep_grid=grid, max_candidates=1)
    assert [(row["variant"], row["keep"][0]) for row in data["candidates"]] == [("dtps", 0.5)]
    assert data["space"]["out_of_reach"]["etps"].startswith(
        "0.7 is out of reach on --keep-grid: its smallest keep the method takes here, 0.5, costs "
    )
    assert list(data["space"]["left_out"]) == ["evit"]


@pytest.mark.parametrize("grid", [(), (0.7, 1.2)])
def test_a_keep_grid_that_is_empty_or_out_of_range_is_one_line(model, tmp_path, grid):
    with pytest.raises(SearchError) as refused:
        _run(model, tmp_path, 0.9, ["etps"], keep_grid=grid)
    assert str(refused.value) == f"--keep-grid must be keep ratios in (0, 1], got {list(grid)}"


def test_fit_on_grid_skips_refused_keeps_and_names_the_refusal():
    def cost(keep: float) -> float:
        if keep < 0.5:
            raise PlanError("removes too few tokens", "keep")
        return keep

    assert fit_on_grid(cost, [0.3, 0.6, 0.8, 0.9], 0.85) == 0.8
    assert fit_on_grid(cost, [0.3, 0.4, 0.6], 0.85) == 0.6
    with pytest.raises(
        PlanError, match="no keep of --keep-grid is taken .*: keep removes too few tokens"
    ):
        fit_on_grid(cost, [0.3, 0.4], 0.85)
    with pytest.raises(PlanError, match="smallest keep the method takes here, 0.9, costs 0.900"):
        fit_on_grid(cost, [0.3, 0.9, 0.95], 0.85)


def test_a_second_run_reads_its_scores_from_the_cache(model, tmp_path):
    first = _run(model, tmp_path, 0.9, ["evit"])
    again = _run(model, tmp_path, 0.9, ["evit"])
    assert (first["scored_now"], again["scored_now"], again["from_cache"]) == (1, 0, 1)
    assert again["best"]["score"] == first["best"]["score"]


def test_a_budget_no_method_reaches_is_one_line(model, tmp_path):
    with pytest.raises(SearchError) as refused:
        _run(model, tmp_path, 0.05, ["etps", "dtps"])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("no method fits the budget on this windowed model: ")
    assert "etps: 0.05 is out of reach" in message and "dtps: 0.05 is out of reach" in message


def test_a_model_of_windowed_and_plain_stages_warms_its_predictors(tmp_path):
    # Hiera at 64 pixels: locations 0, 1 (mask units: 4 windows of 16 tokens) and 2, 8 (plain
    # stages); block 2's 16 tokens an image must not be read against block 1's windows.
    hiera, size = _build("hiera")
    loaded = LoadedModel(model=hiera, source=ModelSource(spec="hiera"), input_size=size)
    calibration = TensorDataset(torch.randn(16, *size), torch.randint(0, 10, (16,)))
    data = search(loaded, calibration, _config(tmp_path, 0.95, ["dtps"])).to_json()
    (row,) = data["candidates"]
    assert row["locs"] == [0, 1, 2, 8] and len(row["warmup_loss"]) == 4


def test_an_unknown_variant_is_one_line(model, tmp_path):
    with pytest.raises(SearchError, match="--variants: 'etsp' is unknown"):
        _run(model, tmp_path, 0.9, ["etsp"])


def test_a_learned_method_is_left_out_where_padded_windows_have_a_predictor_per_group(tmp_path):
    # 48 pixels: a 12 x 12 grid in windows of 7, padded to 14 x 14; the predictor reduces each
    # group of windows alike in token count on its own.
    padded = _padded_swin()
    size = (3, 48, 48)
    loaded = LoadedModel(model=padded, source=ModelSource(spec="swin"), input_size=size)
    calibration = TensorDataset(torch.randn(16, *size), torch.randint(0, 10, (16,)))
    data = search(loaded, calibration, _config(tmp_path, 0.95, ["dtps", "etps"])).to_json()
    assert data["space"]["left_out"] == {"dtps": LEARNED_LEFT_OUT_WHY}
    assert [row["variant"] for row in data["candidates"]] == ["etps"]


def test_the_warm_up_teaches_each_window_its_best_attended_tokens(model):
    """The signals of a windowed block are a row per window: block_signals reads them so, and the
    warm-up fits each window's top tokens with every token present (each windowed block gives
    its tokens back). On random weights the attention a token gets says little that a predictor
    can learn, so the fit is checked on signals whose attention is a known function of the
    tokens, on windows it did not see."""
    builder = CandidateBuilder(model, SIZE)
    signals = block_signals(builder, torch.randn(4, *SIZE), [0, 1], 4)
    assert signals[0].tokens.shape[:2] == signals[0].attention.shape == (4 * 4, 49)
    generator = torch.Generator().manual_seed(0)
    direction = {block: torch.randn(32, generator=generator) for block in (0, 1)}

    def windows(count: int) -> dict[int, BlockSignals]:
        made = {}
        for block in (0, 1):
            tokens = torch.randn(count, 49, 32, generator=generator)
            made[block] = BlockSignals(tokens.half(), tokens @ direction[block])
        return made

    def overlap(compressed, held_out) -> list[float]:
        reducers = list(getattr(compressed, REDUCER_PREFIX).children())
        shares = []
        for block, reducer in zip((0, 1), reducers, strict=True):
            signal = held_out[block]
            with torch.no_grad():
                present = torch.ones(signal.attention.shape)
                keep_score = reducer.predictor(signal.tokens.float(), present)[..., 0]
            k = reducer.keep_tokens
            chosen = keep_score.topk(k, dim=1).indices
            best = signal.attention.topk(k, dim=1).indices
            shares.append(float((chosen.unsqueeze(2) == best.unsqueeze(1)).any(2).float().mean()))
        return shares

    train, held_out = windows(256), windows(64)
    untrained = builder.build("dtps", [0.7], [0, 1])
    warmed = builder.build("dtps", [0.7], [0, 1])
    warm_predictors(warmed, train, [0, 1], steps=200, windowed={0, 1})
    chained = builder.build("dtps", [0.7], [0, 1])  # as if block 1 saw only block 0's choice
    warm_predictors(chained, train, [0, 1], steps=200)
    before, after, without = (overlap(m, held_out) for m in (untrained, warmed, chained))
    # 34 of 49 kept: a choice at random overlaps the best 34 by about 0.69.
    assert max(before) < 0.8 and min(after) > 0.9
    assert without[1] < after[1] - 0.05


def test_the_command_line_searches_a_windowed_model(tmp_path):
    args = [f"{key}={value!r}" for key, value in {**SWIN, "num_classes": 10}.items()]
    result_args = [
        "search",
        "--model",
        "swin_tiny_patch4_window7_224",
        *[part for arg in args for part in ("--model-arg", arg)],
        "--data",
        "fashion-mnist",
        "--calib-images",
        "8",
        "--batch-size",
        "8",
        "--variants",
        "etps,tome",
        "--max-gmacs-ratio",
        "0.9",
    ]
    result = CliRunner().invoke(cli, [*result_args, "--out", str(tmp_path)])
    if "Fashion-MNIST" in result.output and result.exit_code != 0:
        pytest.skip("Fashion-MNIST is not installed here")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "MACs counted on every candidate" in text and "chosen: " in text
    saved = json.loads((tmp_path / "search.json").read_text())
    assert saved["strategy"] == "keep fitted to the budget per method"
    # --keep-grid and --max-candidates reach a windowed model's search.
    again = CliRunner().invoke(
        cli,
        [
            *result_args,
            "--keep-grid",
            "0.6,0.8",
            "--max-candidates",
            "1",
            "--out",
            str(tmp_path / "grid"),
        ],
    )
    assert again.exit_code == 0, again.output
    saved = json.loads((tmp_path / "grid" / "search.json").read_text())
    assert [(row["variant"], row["keep"][0]) for row in saved["candidates"]] == [("etps", 0.6)]
    assert list(saved["space"]["left_out"]) == ["tome"]
