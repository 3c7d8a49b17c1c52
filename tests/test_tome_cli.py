"""``--variant tome`` through the commands: apply (GMACs, throughput, CI gates, --variant-arg r=R), bench,
report, visualize (merged groups) and export, on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import vitcompress.cli.export_command  # noqa: F401 - registers export
import vitcompress.cli.report_command  # noqa: F401 - registers report and visualize
from tests.models import FIXTURES
from vitcompress.cli.main import cli

MODEL = ["--model", f"{FIXTURES}:mha_vit", "--model-arg", "depth=4", "--model-arg", "dim=32"]
FAST = ["--batch-size", "2", "--warmup", "0", "--runs", "1"]


def run(*args) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("tome")
    result = run(
        "apply", *MODEL, "--variant", "tome", "--keep", "0.5", *FAST, "--out", root / "art",
        "--json", "--max-gmacs", "10",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (root / "apply.json").write_text(result.stdout)
    return root, json.loads(result.stdout)


def test_apply_reports_gmacs_throughput_and_gates(applied) -> None:
    _, data = applied
    assert data["plan"]["variant"] == "tome"
    assert data["compressed"]["gmacs"] < data["base"]["gmacs"]
    assert data["compressed"]["throughput"] > 0 and data["base"]["throughput"] > 0
    assert [(g["name"], g["passed"]) for g in data["gates"]] == [("max_gmacs", True)]
    merged = [loc["merge_tokens"] for loc in data["plan"]["locations"]]
    assert sum(merged) > 0


def test_variant_arg_r_sets_r_and_excludes_keep() -> None:
    r3 = ("--variant", "tome", "--variant-arg", "r=3")
    result = run("apply", *MODEL, *r3, "--no-throughput", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert [loc["merge_tokens"] for loc in plan["locations"]] == [3] * len(plan["locations"])
    assert plan["variant_args"] == {"r": 3}
    shown = run("apply", *MODEL, *r3, "--no-throughput")
    assert shown.exit_code == 0 and f"merging r {[3] * len(plan['locations'])}" in shown.stdout
    both = run("apply", *MODEL, *r3, "--keep", "0.5")
    assert both.exit_code == 2 and "--keep and --variant-arg r exclude each other" in both.output
    other = run("apply", *MODEL, "--variant", "etps", "--variant-arg", "r=3", "--no-throughput")
    assert other.exit_code == 2
    assert "--variant-arg r: etps has no such setting; it takes restore" in other.output
    bad = run("apply", *MODEL, "--variant", "tome", "--variant-arg", "r3")
    assert bad.exit_code == 2 and "--variant-arg 'r3' has no '='" in bad.output


def test_bench_report_visualize_and_export_the_artifact(applied, tmp_path) -> None:
    root, _ = applied
    art = root / "art"
    bench = run("bench", "--model", art, *FAST, "--json")
    assert bench.exit_code == 0, bench.output
    (tmp_path / "bench.json").write_text(bench.stdout)
    report = run("report", root / "apply.json", tmp_path / "bench.json", "--json")
    assert report.exit_code == 0, report.output
    tome_rows = [row for row in json.loads(report.stdout)["rows"] if row["variant"] == "tome"]
    assert tome_rows and all(row["keep"].startswith("r=") for row in tome_rows)

    rows, cols = np.mgrid[0:32, 0:32]
    pixels = np.stack([cols * 7, rows * 7, (rows // 8 % 2) * 200], axis=-1).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "image.png")
    shown = run(
        "visualize", "--model", art, "--image", tmp_path / "image.png",
        "--out", tmp_path / "v.png", "--json",
    )  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert (tmp_path / "v.png").stat().st_size > 0
    locations = json.loads(shown.stdout)["locations"]
    grouped: set[int] = set()
    for loc in locations:
        # Every merged token's group holds the tokens that left the grid, here or before.
        members = {m for group in loc["hosts"].values() for m in group}
        assert set(map(int, loc["hosts"])) <= set(loc["kept"])
        assert members.isdisjoint(loc["kept"])
        grouped |= members
        assert set(loc["pruned"]) <= members
    assert grouped == set(range(64)) - set(locations[-1]["kept"])

    out = tmp_path / "model.onnx"
    exported = run(
        "export", "--model", art, "--format", "onnx", "--out", out, "--batch-size", "2", "--json"
    )
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.stdout)["max_abs_diff"] <= 1e-4
