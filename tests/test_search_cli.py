"""``vitcompress search`` end to end on a tiny ViT, its plan file through ``apply --plan`` and
``finetune --plan``, and the one-line errors (exit code 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from PIL import Image

from vitcompress.cli.main import cli

MODEL = [
    "--model",
    "vit_small_patch16_224",
    *("--model-arg", "img_size=32", "--model-arg", "patch_size=4", "--model-arg", "depth=4"),
    *("--model-arg", "embed_dim=64", "--model-arg", "num_heads=2", "--model-arg", "num_classes=2"),
]


pytestmark = pytest.mark.usefixtures("one_thread")


def image_folder(root: Path, per_class: int = 6) -> Path:
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = (torch.rand(32, 32, 3, generator=generator) * 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    return root


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def one_line_error(result, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> tuple[Path, Path, dict, str]:
    root = tmp_path_factory.mktemp("search")
    data = image_folder(root / "data")
    out = root / "out"
    result = run(
        "--progress",  # the group's option: search has no progress option of its own
        "plain",
        "search",
        *MODEL,
        "--data",
        str(data),
        "--max-gmacs-ratio",
        "0.7",
        "--variants",
        "etps,dtps",
        "--calib-images",
        "8",
        "--max-candidates",
        "4",
        "--warmup-steps",
        "5",
        "--batch-size",
        "4",
        "--out",
        str(out),
        "--json",
    )
    assert result.exit_code == 0, result.output
    return data, out, json.loads(result.stdout), result.stderr


def test_search_writes_the_front_the_plot_and_the_plan(searched):
    _, out, data, _ = searched
    assert {"variant", "locs", "keep", "macs", "score", "kl", "agreement", "accuracy"} <= set(
        data["candidates"][0]
    )
    assert len(data["candidates"]) == 4 and data["strategy"] == "evolutionary"
    assert {r["variant"] for r in data["candidates"]} == {"etps", "dtps"}
    best = data["best"]
    assert best["macs"] <= data["budget"]["macs"] == pytest.approx(0.7 * data["base_macs"])
    assert best["score"] == max(r["score"] for r in data["candidates"])
    assert data["paper_default"] is not None  # the paper's placement, matched to the budget
    assert (out / "pareto.png").stat().st_size > 1000
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    recipe = yaml.safe_load((out / "plan.yaml").read_text())
    assert recipe == {"variant": best["variant"], "locs": best["locs"], "keep": best["keep"]}


def test_progress_and_the_running_best_go_to_stderr(searched):
    *_, stderr = searched
    bars = [line for line in stderr.splitlines() if line.strip().startswith("[")]
    assert len(bars) == 4 and bars[-1].strip().startswith("[####################] 4/4  best ")
    assert "KL" in bars[-1]


def test_apply_takes_the_plan_file(searched):
    _, out, data, _ = searched
    best = data["best"]
    result = run("apply", *MODEL, "--plan", str(out / "plan.yaml"), "--no-throughput", "--json")
    assert result.exit_code == 0, result.output
    applied = json.loads(result.stdout)
    assert applied["plan"]["variant"] == best["variant"]
    assert applied["plan"]["locs"] == best["locs"] and applied["plan"]["keep"] == best["keep"]
    # The search's analytic count is the count apply measures.
    assert applied["compressed"]["macs"] == best["counted_macs"]
    assert abs(best["macs"] - best["counted_macs"]) / best["counted_macs"] < 0.01


def test_options_typed_on_the_command_line_override_the_plan_file(searched):
    _, out, data, _ = searched
    best = data["best"]
    result = run(
        "apply", *MODEL, "--plan", str(out / "plan.yaml"), "--keep", "0.5", "--no-throughput",
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert plan["keep"] == [0.5] * len(best["locs"]) and plan["locs"] == best["locs"]
    assert plan["variant"] == best["variant"]


def test_finetune_takes_the_plan_file(searched, tmp_path):
    data_dir, out, data, _ = searched
    best = data["best"]
    run_dir = tmp_path / "ft"
    result = run(
        "finetune", *MODEL, "--plan", str(out / "plan.yaml"), "--data", str(data_dir),
        "--augment", "none", "--max-steps", "1", "--batch-size", "4", "--warmup-epochs", "0",
        "--out", str(run_dir), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    assert summary["variant"] == best["variant"]
    assert summary["locs"] == best["locs"] and summary["keep"] == best["keep"]
    # A compressed model keeps its own plan: a plan file beside it is refused, not ignored.
    again = run(
        "finetune", "--model", str(run_dir), "--plan", str(out / "plan.yaml"), "--data",
        str(data_dir), "--out", str(tmp_path / "again"),
    )  # fmt: skip
    assert "keeps its own plan" in one_line_error(again)


def test_a_plan_file_with_another_key_is_one_line(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("variant: etps\nlocs: [1, 2]\nkeep: 0.5\nepochs: 3\n")
    line = one_line_error(run("apply", *MODEL, "--plan", str(plan), "--no-throughput"))
    assert "sets 'epochs'" in line
    plan.write_text("variant: nope\nlocs: [1]\nkeep: 0.5\n")
    assert "variant 'nope'" in one_line_error(run("apply", *MODEL, "--plan", str(plan)))
    plan.write_bytes(bytes(range(128, 256)))  # not text at all
    assert "cannot read" in one_line_error(run("apply", *MODEL, "--plan", str(plan)))


def test_a_plan_files_value_the_model_refuses_names_the_file(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("variant: etps\nlocs: [1, 9]\nkeep: 0.5\n")  # the model has 4 blocks
    line = one_line_error(run("apply", *MODEL, "--plan", str(plan), "--no-throughput"))
    assert "--locs 9 is out of range" in line and f"(set by --plan {plan})" in line
    typed = one_line_error(
        run("apply", *MODEL, "--plan", str(plan), "--locs", "1,7", "--no-throughput")
    )
    assert "--locs 7 is out of range" in typed and "--plan" not in typed  # typed: no file named


def test_search_without_a_budget_is_one_line(tmp_path):
    line = one_line_error(
        run("search", *MODEL, "--data", str(tmp_path), "--out", str(tmp_path / "o"))
    )
    assert "a budget is required" in line


@pytest.mark.parametrize("flag", ["--compile", "--fused-kernels"])
def test_timing_flags_without_min_speedup_are_one_line(tmp_path, flag):
    line = one_line_error(
        run(
            "search",
            *MODEL,
            "--data",
            str(tmp_path),
            "--max-gmacs-ratio",
            "0.6",
            flag,
            "--out",
            str(tmp_path / "o"),
        )  # fmt: skip
    )
    assert f"{flag} sets how --min-speedup is timed" in line
    assert not (tmp_path / "o").exists()


def test_an_impossible_budget_is_one_line(searched, tmp_path):
    data_dir, *_ = searched
    line = one_line_error(
        run(
            "search",
            *MODEL,
            "--data",
            str(data_dir),
            "--max-gmacs-ratio",
            "0.05",
            "--calib-images",
            "8",
            "--out",
            str(tmp_path / "o"),
        )  # fmt: skip
    )
    assert "no candidate reaches 0.05 of the GMACs; the smallest is" in line


@pytest.mark.parametrize("count, message", [("4", "too few"), ("20", "has 12 images")])
def test_too_few_calibration_images_is_one_line(searched, tmp_path, count, message):
    data_dir, *_ = searched
    line = one_line_error(
        run(
            "search",
            *MODEL,
            "--data",
            str(data_dir),
            "--max-gmacs-ratio",
            "0.7",
            "--calib-images",
            count,
            "--out",
            str(tmp_path / "o"),
        )  # fmt: skip
    )
    assert message in line


def test_a_checkpoint_written_again_in_place_is_not_read_from_the_cache(tmp_path):
    # The scores depend on the weights: the cache records the checkpoint's content, not its path.
    import timm
    from safetensors.torch import save_file

    data = image_folder(tmp_path / "data", per_class=4)
    checkpoint = tmp_path / "weights.safetensors"
    args = [str(a) for a in MODEL[1:]]
    model_args = dict(arg.split("=") for arg in args[2::2])

    def write_weights(seed: int) -> None:
        torch.manual_seed(seed)
        model = timm.create_model(args[0], **{k: int(v) for k, v in model_args.items()})
        save_file(model.state_dict(), str(checkpoint))

    command = [
        "search", *MODEL, "--checkpoint", str(checkpoint), "--data", str(data),
        "--max-gmacs-ratio", "0.9", "--variants", "etps", "--keep-grid", "0.5,0.7",
        "--calib-images", "8", "--batch-size", "4", "--out", str(tmp_path / "out"), "--json",
    ]  # fmt: skip
    write_weights(0)
    assert run(*command).exit_code == 0
    write_weights(1)
    refused = one_line_error(run(*command))
    assert "checkpoint_sha256" in refused


def test_a_candidate_within_the_budget_only_by_analytic_macs_is_not_chosen(tmp_path, monkeypatch):
    # With the analytic count made 10% of the base low, eTPS at keep 0.7 on PVT-v2 (64 px, two
    # classes) fits 35,000,000 MACs by it wherever it reduces, but every counted count is over
    # that (the least, at [0, 2, 4, 6], about 35.8 M): none is chosen.
    from vitcompress.search.cost import CostModel

    exact = CostModel.macs
    monkeypatch.setattr(
        CostModel, "macs", lambda self, plan: exact(self, plan) - 0.1 * self.base_macs
    )
    data = image_folder(tmp_path / "data", per_class=4)
    result = run(
        "search", "--model", "pvt_v2_b0", "--model-arg", "num_classes=2", "--input-size",
        "3,64,64", "--data", str(data), "--calib-images", "8", "--batch-size", "8",
        "--max-gmacs", "0.035", "--variants", "etps", "--keep-grid", "0.7",
        "--max-candidates", "1", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    warning, error = result.stderr.strip().splitlines()
    assert error == "error: no scored candidate fits the budget"
    counted = re.search(r"etps at \[[\d, ]+\]: ([\d,]+) counted > 35,000,000\)", warning)
    assert counted and int(counted.group(1).replace(",", "")) > 35_000_000
