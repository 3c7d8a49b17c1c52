"""``bench --batch-sizes``: per-size timing of a compressed model against its base, the crossover
batch, the table, ``--json`` and ``--plot``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import vitcompress
from tests.models import SMALL, timm_small
from vitcompress.cli.main import cli
from vitcompress.measure import PairedRatio
from vitcompress.workflows.batch_sweep import (
    BatchSizesError,
    BatchSweep,
    SweepPoint,
    parse_batch_sizes,
)

FAST = ["--warmup", "0", "--runs", "2", "--bench-seconds", "30"]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = vitcompress.compress(
        timm_small("vit_small_patch16_224", depth=2), "etps", keep=0.5, locs=[0]
    )
    return vitcompress.save(model, tmp_path_factory.mktemp("sweep") / "art")


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("32, 1,8") == [1, 8, 32]
    for bad in ("", "1,x", "0,4", "-2", "4,4"):
        with pytest.raises(BatchSizesError):
            parse_batch_sizes(bad)


def sweep_of(ratios: list[float]) -> BatchSweep:
    sizes = [1, 8, 32, 128, 256][: len(ratios)]
    points = [
        SweepPoint(
            batch_size=size,
            throughput={"base": 100.0, "compressed": 100.0 * ratio},
            samples={},
            speedup={"compressed": PairedRatio(median=ratio, low=None, high=None, pairs=3)},
        )
        for size, ratio in zip(sizes, ratios, strict=True)
    ]
    return BatchSweep(points=points, reference="base", environment={})


@pytest.mark.parametrize(
    "ratios, crossover",
    [
        ([0.6, 0.9, 1.1, 1.3], 32),  # slower at small batches, faster from 32 on
        ([1.2, 1.3, 1.4], 1),  # faster everywhere
        ([0.7, 0.8, 0.95], None),  # never faster
        ([0.8, 1.1, 0.9, 1.2], 128),  # faster at 8 but not at 32: the advantage settles at 128
        ([1.2, 1.1, 1.0], None),  # equal at the largest size is not faster
    ],
)
def test_crossover_is_where_the_speed_up_stays_above_one(
    ratios: list[float], crossover: int | None
) -> None:
    sweep = sweep_of(ratios)
    assert sweep.crossover("compressed") == crossover
    assert sweep.to_json()["crossover_batch"] == {"compressed": crossover}


def test_the_crossover_s_batches_whose_interval_includes_1_are_named() -> None:
    # The crossover is read off the medians; where the interval includes 1 it is not shown.
    intervals = [(0.5, 0.7), (0.9, 1.3), (1.05, 1.2), (1.1, 1.4)]
    sweep = sweep_of([0.6, 1.1, 1.1, 1.2])
    for point, (low, high) in zip(sweep.points, intervals, strict=True):
        point.speedup["compressed"] = PairedRatio(
            median=point.speedup["compressed"].median, low=low, high=high, pairs=20
        )
    assert sweep.crossover("compressed") == 8
    assert sweep.unconfirmed("compressed") == [8]
    assert sweep_of([1.2, 1.3]).unconfirmed("compressed") == [1, 8]  # no interval at all
    assert sweep_of([0.8, 0.9]).unconfirmed("compressed") == []  # no crossover to confirm


def test_too_few_pairs_for_an_interval_are_undecided_in_the_json_as_in_the_table() -> None:
    [point] = sweep_of([1.3]).to_json()["points"]
    assert point["verdict"] == {"compressed": "undecided"}


def test_sweep_of_an_artifact_against_its_base(artifact: Path, tmp_path: Path) -> None:
    plot = tmp_path / "plots" / "sweep.png"
    result = run(
        "bench", "--model", str(artifact), "--batch-sizes", "4,1", *FAST, "--plot", str(plot),
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["batch_sizes"] == [1, 4] and data["reference"] == "base"
    for point, size in zip(data["points"], [1, 4], strict=True):
        assert point["batch_size"] == size
        assert set(point["throughput"]) == {"base", "compressed"}
        assert all(len(samples) == 2 for samples in point["samples"].values())
        ratio = point["speedup"]["compressed"]["median"]
        # The speed-up is paired round by round: the median of per-round ratios.
        rounds = [
            c / b
            for c, b in zip(point["samples"]["compressed"], point["samples"]["base"], strict=True)
        ]
        assert ratio == pytest.approx(sorted(rounds)[0] / 2 + sorted(rounds)[1] / 2)
    assert set(data["crossover_batch"]) == {"compressed"}
    assert data["gmacs"] > 0 and data["environment"]["batch_sizes"] == [1, 4]
    # The base was made from random weights: its architecture is timed, and stderr says so.
    assert "random weights" in result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and data["plot"] == str(plot)


def test_sweep_table_of_a_plain_model() -> None:
    args = [f"--model-arg={key}={value}" for key, value in SMALL.items()]
    result = run("bench", "--model", "vit_small_patch16_224", *args, "--batch-sizes", "1,2", *FAST)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.split()[:1] == ["1"] for line in lines)
    assert any(line.split()[:1] == ["2"] for line in lines)
    assert "speed-up" not in result.stdout and "pass a compressed model directory" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-sizes", "1,zero"], "is not a comma list of positive integers"),
        (["--plot", "x.png"], "--plot draws a batch sweep: add --batch-sizes"),
        (["--batch-sizes", "1,2", "--no-throughput"], "drop --no-throughput"),
    ],
)
def test_bad_sweep_options_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = run("bench", "--model", "no_such_model_is_loaded", *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
