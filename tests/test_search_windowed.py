"""``search`` on a windowed model: one candidate per method, its keep fitted to the budget with
the MACs counted, scored on calibration images like any candidate; the learned methods left
out (their warm-up reads plain blocks)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch.utils.data import TensorDataset

from tests.test_windowed import SIZE, SWIN, swin
from vitcompress import compress
from vitcompress.cli.main import cli
from vitcompress.loading import LoadedModel, ModelSource
from vitcompress.measure import count_macs
from vitcompress.search.driver import Budget, SearchConfig, SearchError, search
from vitcompress.search.windowed import LEARNED_LEFT_OUT_WHY


def _config(tmp_path, ratio: float, variants: list[str]) -> SearchConfig:
    return SearchConfig(
        budget=Budget(max_gmacs_ratio=ratio),
        variants=variants,
        out=tmp_path,
        calib_images=16,
        batch_size=8,
        max_candidates=8,
        identity={"model": "swin"},
    )


@pytest.fixture(scope="module")
def model():
    return swin()


def _run(model, tmp_path, ratio, variants):
    loaded = LoadedModel(model=model, source=ModelSource(spec="swin"), input_size=SIZE)
    generator = torch.Generator().manual_seed(0)
    calibration = TensorDataset(
        torch.randn(16, *SIZE, generator=generator),
        torch.randint(0, 10, (16,), generator=generator),
    )
    return search(loaded, calibration, _config(tmp_path, ratio, variants)).to_json()


def test_each_method_gets_the_largest_keep_its_counted_macs_allow(model, tmp_path):
    data = _run(model, tmp_path, 0.9, ["etps", "evit", "tome", "dtps"])
    assert data["space"]["left_out"] == {"dtps": LEARNED_LEFT_OUT_WHY}
    rows = {row["variant"]: row for row in data["candidates"]}
    assert sorted(rows) == ["etps", "evit", "tome"]
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


def test_a_second_run_reads_its_scores_from_the_cache(model, tmp_path):
    first = _run(model, tmp_path, 0.9, ["evit"])
    again = _run(model, tmp_path, 0.9, ["evit"])
    assert (first["scored_now"], again["scored_now"], again["from_cache"]) == (1, 0, 1)
    assert again["best"]["score"] == first["best"]["score"]


def test_a_budget_no_method_reaches_is_one_line(model, tmp_path):
    with pytest.raises(SearchError) as refused:
        _run(model, tmp_path, 0.3, ["etps", "dtps"])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("no method fits the budget on this windowed model: ")
    assert "dtps: " + LEARNED_LEFT_OUT_WHY in message and "etps: 0.3 is out of reach" in message


def test_the_command_line_searches_a_windowed_model(tmp_path):
    args = [f"{key}={value!r}" for key, value in {**SWIN, "num_classes": 10}.items()]
    result = CliRunner().invoke(
        cli,
        [
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
            "--out",
            str(tmp_path),
        ],
    )
    if "Fashion-MNIST" in result.output and result.exit_code != 0:
        pytest.skip("Fashion-MNIST is not installed here")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "MACs counted on every candidate" in text
    saved = json.loads((tmp_path / "search.json").read_text())
    assert saved["strategy"] == "keep fitted to the budget per method"
