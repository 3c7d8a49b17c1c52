"""Bad input through the CLI, beyond tests/test_bad_input.py: a missing --data, an output that is
one of the command's inputs, names the file system refuses, an empty or NaN value, an allocation
too large for the machine, fine-tuning settings and run folders. Each is one ``error:`` line,
exit 2, before any work, and nothing the user had is changed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from tests.models import FIXTURES
from tests.test_bad_input import assert_one_error
from vitcompress.cli.main import cli
from vitcompress.cli.plan_options import parse_keep, parse_keep_cumulative, parse_locs
from vitcompress.compilation.plan import PlanError

# The first-check subset (pytest -m quick, README), as tests/test_bad_input.py.
pytestmark = pytest.mark.quick

MHA = f"{FIXTURES}:mha_vit"
SMALL = ["--model-arg", "depth=2", "--model-arg", "dim=32"]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every model load the command makes (none, for a refusal before any work)."""
    calls: list = []

    def load(request: object) -> None:
        calls.append(request)
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("vitcompress.workflows.inputs.ModelRequest.load", load)
    return calls


@pytest.mark.parametrize(
    "args",
    [
        ["eval", "--no-throughput"],
        ["eval", "--data-dir", "somewhere", "--no-throughput"],
        ["search", "--max-gmacs", "1", "--no-throughput", "--out", "s"],
    ],
)
def test_a_command_that_reads_images_without_data(args: list[str], loads: list) -> None:
    command, *rest = args
    assert_one_error(run(command, "--model", MHA, *SMALL, *rest), 2, "Missing option '--data'")
    assert not loads


def test_an_output_name_longer_than_the_file_system_takes(tmp_path: Path, loads: list) -> None:
    for out in (tmp_path / ("a" * 300), tmp_path / "new" / ("b" * 300)):
        result = run("apply", "--model", MHA, *SMALL, "--no-throughput", "--out", str(out))
        assert_one_error(result, 2, "--out", "File name too long")
    assert not loads
    assert not list(tmp_path.iterdir())


def test_apply_cannot_replace_an_artifact_in_a_folder_it_cannot_write(
    tmp_path: Path, loads: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An artifact is written beside the folder it replaces and renamed into place: the folder
    # above must be writable, and that is known before the work, not after it.
    parent = tmp_path / "shared"
    out = parent / "model"
    out.mkdir(parents=True)
    (out / "vitcompress.json").write_text("{}")
    access = os.access

    def no_write_in_parent(path: object, mode: int, **kwargs: object) -> bool:
        if Path(path).resolve() == parent.resolve() and mode & os.W_OK:
            return False
        return access(path, mode, **kwargs)

    monkeypatch.setattr("os.access", no_write_in_parent)
    result = run("apply", "--model", MHA, *SMALL, "--no-throughput", "--out", str(out))
    assert_one_error(result, 2, f"--out {out}", "cannot replace it", "not writable")
    assert not loads
    assert (out / "vitcompress.json").read_text() == "{}"


@pytest.mark.parametrize(
    "args, words",
    [
        (["apply", "--input-size", "", "--no-throughput"], ["input size ''"]),
        (["apply", "--keep", "0.7,,0.5", "--locs", "0,1", "--no-throughput"], ["--keep", "0.7,,0.5"]),
        (["apply", "--keep", "0.5", "--locs", "1,", "--no-throughput"], ["--locs", "'1,'"]),
        (["apply", "--variant", "dtps", "--keep-cumulative", "0.7,,0.5", "--no-throughput"],
         ["--keep-cumulative"]),
        (["bench", "--bench-seconds", "nan"], ["--bench-seconds", "'nan' is not a finite number"]),
        (["bench", "--bench-seconds", "inf"], ["--bench-seconds", "'inf' is not a finite number"]),
    ],
)  # fmt: skip
def test_an_empty_item_or_a_value_that_is_no_number(
    args: list[str], words: list[str], loads: list
) -> None:
    command, *rest = args
    assert_one_error(run(command, "--model", MHA, *SMALL, *rest), 2, *words)
    assert not loads


def test_comma_lists_refuse_an_empty_item_and_take_blanks_around_items() -> None:
    for parse in (parse_keep, parse_locs, parse_keep_cumulative):
        with pytest.raises(PlanError):
            parse("1,,1")
        with pytest.raises(PlanError):
            parse("1,")
    assert parse_keep(" 0.7 , 0.5 ") == [0.7, 0.5] and parse_locs(" 3, 6 ") == [3, 6]
    assert parse_keep("") == [] and parse_locs("") == []  # "must not be empty", from the plan


# --------------------------------------------------------------------------------------------------
# An output that is one of the command's inputs
# --------------------------------------------------------------------------------------------------


def _inputs(tmp_path: Path) -> dict[str, Path]:
    image = tmp_path / "image.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n the user's image")
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"the user's weights")
    source = tmp_path / "net.py"
    source.write_text("def net():\n    raise AssertionError('never built')\n")
    run_json = tmp_path / "run.json"
    run_json.write_text('{"command": "bench"}')
    artifact = tmp_path / "compressed"
    artifact.mkdir()
    (artifact / "vitcompress.json").write_text("{}")
    (artifact / "model.safetensors").write_bytes(b"the compressed weights")
    return {"image": image, "weights": weights, "source": source, "run": run_json, "art": artifact}


@pytest.mark.parametrize(
    "case",
    [
        "visualize --out is --image",
        "report --out-md is a run",
        "report --out-png is a run",
        "export --out is --checkpoint",
        "export --out is the factory file",
        "export --out is a file of the compressed --model",
        "bench --plot is --checkpoint",
    ],
)
def test_an_output_that_the_command_reads_is_refused(
    tmp_path: Path, case: str, loads: list
) -> None:
    paths = _inputs(tmp_path)
    image, weights, source, run_json, art = (
        paths[k] for k in ("image", "weights", "source", "run", "art")
    )
    weights_of_art = art / "model.safetensors"
    args, replaced = {
        "visualize --out is --image": (
            ["visualize", "--model", str(art), "--image", str(image), "--out", str(image)], image),
        "report --out-md is a run": (["report", str(run_json), "--out-md", str(run_json)], run_json),
        "report --out-png is a run": (["report", str(run_json), "--out-png", str(run_json)], run_json),
        "export --out is --checkpoint": (
            ["export", "--model", MHA, *SMALL, "--checkpoint", str(weights), "--format",
             "torchscript", "--out", str(weights)], weights),
        "export --out is the factory file": (
            ["export", "--model", f"{source}:net", "--format", "onnx", "--out", str(source)], source),
        "export --out is a file of the compressed --model": (
            ["export", "--model", str(art), "--format", "onnx", "--out", str(weights_of_art)],
            weights_of_art),
        "bench --plot is --checkpoint": (
            ["bench", "--model", MHA, *SMALL, "--checkpoint", str(weights), "--batch-sizes", "1,2",
             "--plot", str(weights)], weights),
    }[case]  # fmt: skip
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    result = run(*args)
    assert_one_error(result, 2, "would replace", str(replaced.name), "which the command reads")
    assert not loads
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before


def test_only_the_files_a_model_directory_is_made_of_count_as_its_inputs(tmp_path: Path) -> None:
    from vitcompress.cli.outputs import _replaces

    art = _inputs(tmp_path)["art"]
    data = tmp_path / "data"
    data.mkdir()
    files = ["model.safetensors", "vitcompress.json", "ema/model.safetensors", "checkpoints/s.pt",
             "old.onnx", "table.md"]  # fmt: skip
    for name in files:
        (art / name).parent.mkdir(exist_ok=True)
        (art / name).write_bytes(b"x")
    (data / "model.safetensors").write_bytes(b"x")  # not a model directory: an ordinary output
    assert [_replaces(art / name, art) for name in files] == [True, True, True, True, False, False]
    assert not _replaces(data / "model.safetensors", data)
    assert _replaces(data / "model.safetensors", data / "model.safetensors")


def test_an_output_that_is_not_an_input_is_still_replaced(tmp_path: Path) -> None:
    bench = run("bench", "--model", MHA, *SMALL, "--no-throughput", "--json")
    assert bench.exit_code == 0, bench.output
    run_json = tmp_path / "bench.json"
    run_json.write_text(bench.output)
    table = tmp_path / "table.md"
    table.write_text("an older table")
    result = run("report", str(run_json), "--out-md", str(table))
    assert result.exit_code == 0, result.output
    assert table.read_text().startswith("| name") and json.loads(run_json.read_text())


# --------------------------------------------------------------------------------------------------
# An allocation the machine cannot make
# --------------------------------------------------------------------------------------------------


def test_a_batch_too_large_for_the_machine_is_one_line_exit_2() -> None:
    # 10**12 images of 3x32x32 floats: more than any address space, so the allocation fails at
    # once, as torch's own error, which the command turns into its one line.
    result = run("bench", "--model", MHA, *SMALL, "--batch-size", str(10**12), "--runs", "1",
                 "--warmup", "0")  # fmt: skip
    assert_one_error(result, 2, "out of memory", "PiB", "lower --batch-size")


def test_a_gpu_out_of_memory_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB"
            "\nof which 1 GiB is free."
        )

    monkeypatch.setattr("vitcompress.workflows.inputs.load_model", out_of_memory)
    assert_one_error(
        run("bench", "--model", MHA, "--no-throughput"),
        2,
        "out of memory: the work tried to allocate 20.00 GiB at once",
    )


# --------------------------------------------------------------------------------------------------
# finetune: its settings and its run folder, refused before anything loads
# --------------------------------------------------------------------------------------------------

FINETUNE = ["finetune", "--model", MHA, *SMALL, "--data", "fashion-mnist", "--max-steps", "1"]


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("--lr", "nan", ["'--lr'", "'nan' is not a finite number"]),
        ("--lr", "inf", ["'--lr'", "'inf' is not a finite number"]),
        ("--lr", "-1", ["'--lr'", "not in the range x>0"]),
        ("--lr", "0", ["'--lr'", "not in the range x>0"]),
        ("--weight-decay", "nan", ["'--weight-decay'", "not a finite number"]),
        ("--warmup-epochs", "nan", ["'--warmup-epochs'", "not a finite number"]),
        ("--ema-decay", "nan", ["'--ema-decay'", "not a finite number"]),
        ("--ratio-weight", "nan", ["'--ratio-weight'", "not a finite number"]),
        ("--distill-weight", "-1", ["'--distill-weight'", "not in the range x>=0"]),
        ("--token-distill-weight", "inf", ["'--token-distill-weight'", "not a finite number"]),
    ],
)
def test_finetune_refuses_a_setting_that_is_no_finite_number_in_its_range(
    option: str, value: str, words: list[str], tmp_path: Path, loads: list
) -> None:
    out = tmp_path / "run"
    assert_one_error(run(*FINETUNE, option, value, "--out", str(out)), 2, *words)
    assert not loads and not out.exists()


def test_finetune_checks_a_recipe_s_settings_as_typed_ones(tmp_path: Path, loads: list) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: .nan\n")
    out = tmp_path / "run"
    result = run("finetune", "--recipe", str(recipe), *FINETUNE[1:], "--out", str(out))
    assert_one_error(result, 2, "'--lr'", "not a finite number")
    recipe.write_bytes(b"\xff\xfe\x00lr: 1")
    result = run("finetune", "--recipe", str(recipe), *FINETUNE[1:], "--out", str(out))
    assert_one_error(result, 2, "--recipe", "cannot read", "decode")
    assert not loads and not out.exists()


@pytest.mark.parametrize("case", ["another folder", "resume without checkpoints", "a finished run"])
def test_finetune_refuses_its_out_folder_before_loading_anything(
    tmp_path: Path, case: str, loads: list
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    extra: list[str] = []
    if case == "another folder":
        (out / "notes.txt").write_text("mine")
        words = ["not a fine-tuning output"]
    elif case == "resume without checkpoints":
        extra, words = ["--resume"], ["--resume: no checkpoint"]
    else:
        (out / "checkpoints").mkdir()
        (out / "checkpoints" / "step-00000001.pt").write_bytes(b"state")
        words = ["already holds checkpoints", "--resume"]
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert_one_error(run(*FINETUNE, *extra, "--out", str(out)), 2, *words)
    assert not loads
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


# --------------------------------------------------------------------------------------------------
# export: an option the export would not use
# --------------------------------------------------------------------------------------------------


def test_export_refuses_a_batch_size_a_dynamic_batch_graph_never_runs(
    tmp_path: Path, loads: list
) -> None:
    out = tmp_path / "m.onnx"
    args = ["export", "--model", MHA, *SMALL, "--format", "onnx", "--out", str(out)]
    result = run(*args, "--dynamic-batch", "--batch-size", "4")
    assert_one_error(result, 2, "--batch-size", "--dynamic-batch", "--bench or --compile")
    assert not loads and not out.exists()
    # --bench times the graph at --batch-size: the command goes on to load the model.
    result = run(*args, "--dynamic-batch", "--batch-size", "4", "--bench")
    assert result.exit_code == 1 and "the model was loaded" in result.stderr
    assert len(loads) == 1
