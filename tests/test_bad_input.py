"""Bad input through the CLI: exit code 2 (130 for Ctrl-C, 1 for a bug), one ``error:`` line on
stderr, no traceback unless ``--debug``, and no work lost (an artifact on disk stays loadable)."""

from __future__ import annotations

import errno
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from tests.models import FIXTURES
from tests.test_data import write_image_folder
from vitcompress.cli.main import cli

# The first-check subset (pytest -m quick, README): the CLI, bad input and measurement.
pytestmark = pytest.mark.quick

MHA = f"{FIXTURES}:mha_vit"
SMALL = ["--model-arg", "depth=2", "--model-arg", "dim=32"]
CNN_SOURCE = """
from torch import nn


def small_cnn(num_classes=10):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, num_classes))
"""


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def assert_one_error(result: Result, code: int, *words: str) -> str:
    """Exactly one non-empty stderr line, starting ``error:`` and naming ``words``."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art") / "mha_etps"
    result = run(
        "apply",
        "--model",
        MHA,
        *SMALL,
        "--keep",
        "0.5",
        "--locs",
        "1",
        "--no-throughput",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    return out


def test_unknown_model_suggests_close_names() -> None:
    assert_one_error(
        run("bench", "--model", "deit_smal", "--no-throughput"),
        2,
        "unknown model",
        "deit_small_patch16_224",
    )


@pytest.mark.parametrize(
    "keep, words",
    [
        ("1.5", ["--keep", "(0, 1]"]),
        ("0", ["--keep", "(0, 1]"]),
        ("-0.2", ["--keep", "(0, 1]"]),
        ("abc", ["--keep", "number"]),
    ],
)
def test_keep_outside_0_1_or_not_a_number(keep: str, words: list[str]) -> None:
    assert_one_error(
        run("apply", "--model", MHA, *SMALL, "--keep", keep, "--no-throughput"), 2, *words
    )


@pytest.mark.parametrize(
    "locs, word",
    [
        ("5", "out of range"),
        ("1,0", "strictly increasing"),
        ("1,1", "strictly increasing"),
    ],
)
def test_bad_locs(locs: str, word: str) -> None:
    assert_one_error(
        run("apply", "--model", MHA, *SMALL, "--locs", locs, "--no-throughput"), 2, "--locs", word
    )


def test_a_model_without_attention(tmp_path: Path) -> None:
    path = tmp_path / "cnn.py"
    path.write_text(CNN_SOURCE)
    assert_one_error(
        run("apply", "--model", f"{path}:small_cnn", "--input-size", "3,32,32", "--no-throughput"),
        2,
        "attention",
    )


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_truncated_checkpoint(tmp_path: Path, suffix: str) -> None:
    from safetensors.torch import save_file

    from tests.fixtures.inhouse import mha_vit

    state = mha_vit(depth=2, dim=32).state_dict()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pt":
        torch.save(state, path)
    else:
        save_file(state, str(path))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_one_error(
        run("bench", "--model", MHA, *SMALL, "--checkpoint", str(path), "--no-throughput"),
        2,
        str(path),
        "truncated",
    )


def test_corrupt_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "garbage.pth"
    path.write_bytes(b"this is not a checkpoint at all" * 10)
    assert_one_error(
        run("inspect", "--model", MHA, *SMALL, "--checkpoint", str(path)), 2, "corrupt"
    )


def test_checkpoint_for_another_model(tmp_path: Path) -> None:
    from tests.fixtures.inhouse import einsum_vit

    path = tmp_path / "einsum.pt"
    torch.save(einsum_vit(depth=2, dim=32).state_dict(), path)
    assert_one_error(
        run("bench", "--model", MHA, *SMALL, "--checkpoint", str(path), "--no-throughput"),
        2,
        "does not fit",
    )


class _Payload:
    """Unpickling this would create ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (Path.touch, (self.marker,))


def test_a_pickle_payload_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.zeros(1), "payload": _Payload(marker)}, path)
    assert_one_error(
        run("bench", "--model", MHA, *SMALL, "--checkpoint", str(path), "--no-throughput"),
        2,
        "pickled Python objects",
        "arbitrary code",
    )
    assert not marker.exists()


def test_missing_data_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-data"
    assert_one_error(
        run("eval", "--model", MHA, *SMALL, "--data", str(missing), "--no-throughput"),
        2,
        str(missing),
        "does not exist",
    )


@pytest.mark.parametrize("workers", ["0", "1"])
def test_unreadable_image(tmp_path: Path, workers: str) -> None:
    root = write_image_folder(tmp_path / "imgs", per_class=2, size=32)
    bad = root / "val" / "cat" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"broken" * 20)
    assert_one_error(
        run(
            "eval",
            "--model",
            MHA,
            *SMALL,
            "--model-arg",
            "num_classes=2",
            "--data",
            str(root),
            "--batch-size",
            "4",
            "--workers",
            workers,
            "--no-throughput",
        ),
        2,
        "cannot read image",
        str(bad),
    )


def _assert_artifact_intact(out: Path, before: dict[str, bytes]) -> None:
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    bench = run("bench", "--model", str(out), "--no-throughput", "--json")
    assert bench.exit_code == 0, bench.output
    assert json.loads(bench.output)["macs"] > 0


@pytest.mark.parametrize("target", ["safetensors.torch.save_model", "os.replace"])
def test_full_disk_keeps_the_previous_artifact(
    artifact: Path, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {p.name: p.read_bytes() for p in artifact.iterdir()}

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(target, no_space)
    result = run(
        "apply",
        "--model",
        MHA,
        *SMALL,
        "--keep",
        "0.7",
        "--locs",
        "0",
        "--no-throughput",
        "--out",
        str(artifact),
    )
    monkeypatch.undo()
    assert_one_error(result, 2, str(artifact), "No space left on device")
    _assert_artifact_intact(artifact, before)


def test_apply_into_a_folder_holding_more_than_a_model_is_refused_before_any_work(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fine-tune's output is an artifact plus its checkpoints and metrics: replacing the folder
    # whole would delete them.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for entry in artifact.iterdir():
        (run_dir / entry.name).write_bytes(entry.read_bytes())
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-00000001.pt").write_bytes(b"state")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    loads = []
    monkeypatch.setattr("vitcompress.workflows.inputs.ModelRequest.load", loads.append)
    result = run(
        "apply", "--model", MHA, *SMALL, "--keep", "0.7", "--no-throughput", "--out", str(run_dir)
    )
    assert_one_error(
        result, 2, str(run_dir), "holds more than a compressed model", "checkpoints, metrics.jsonl"
    )
    assert not loads  # refused before loading
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    assert (run_dir / "checkpoints" / "step-00000001.pt").read_bytes() == b"state"


@pytest.mark.parametrize(
    "args, words",
    [
        (["bench", "--no-throughput", "--compile", "--runs", "3"],
         ["--runs, --compile: they set how models are timed", "drop them"]),
        (["apply", "--no-throughput", "--dtype", "bfloat16"], ["--dtype: it sets how models"]),
        (["bench", "--batch-sizes", "1,2", "--batch-size", "4"],
         ["--batch-sizes replaces --batch-size"]),
        (["bench", "--no-throughput", "--max-gmacs", "nan"], ["'nan' is not a finite number"]),
        (["bench", "--no-throughput", "--max-gmacs", "inf"], ["'inf' is not a finite number"]),
        (["search", "--data", "x", "--max-gmacs", "inf", "--out", "o"],
         ["'inf' is not a finite number"]),
        (["search", "--data", "x", "--max-gmacs", "1", "--dtype", "float16", "--out", "o"],
         ["--dtype sets how --min-speedup is timed"]),
        (["search", "--data", "x", "--min-speedup", "1.1", "--no-throughput", "--out", "o"],
         ["--min-speedup is measured by timing candidates"]),
        (["export", "--format", "onnx", "--out", "m.onnx", "--runs", "3"],
         ["--runs: only --bench times anything"]),
    ],
)  # fmt: skip
def test_options_that_would_be_ignored_are_refused_before_any_work(
    args: list[str], words: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = []
    monkeypatch.setattr("vitcompress.workflows.inputs.ModelRequest.load", loads.append)
    command, *rest = args
    assert_one_error(run(command, "--model", MHA, *SMALL, *rest), 2, *words)
    assert not loads


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("vitcompress.workflows.inputs.load_model", interrupt)
    assert_one_error(run("bench", "--model", MHA, "--no-throughput"), 130, "interrupted")


def test_an_unexpected_exception_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something inside broke\nsecond line")

    monkeypatch.setattr("vitcompress.workflows.inputs.load_model", bug)
    assert_one_error(
        run("bench", "--model", MHA, "--no-throughput"),
        1,
        "RuntimeError: something inside broke",
        "--debug",
    )
    debug = run("--debug", "bench", "--model", MHA, "--no-throughput")
    assert debug.exit_code == 1
    assert "Traceback" in debug.stderr and "second line" in debug.stderr


def test_debug_shows_the_traceback_of_an_input_error() -> None:
    result = run("--debug", "bench", "--model", "deit_smal", "--no-throughput")
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "error: unknown model" in result.stderr


# --------------------------------------------------------------------------------------------------
# Usage errors: click's own (an unknown choice or option, a missing value, an unknown command) are
# one line like every other bad input, for every command, exit code 2.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["apply", "--model", MHA, "--variant", "foo"], ["'--variant'", "'foo'", "etps"]),
        (["bench", "--model", MHA, "--dtype", "float64"], ["'--dtype'", "'float64'"]),
        (["apply", "--bogus"], ["No such option '--bogus'"]),
        (["apply", "--keep"], ["'--keep' requires an argument"]),
        (["search", "--model", MHA, "--bogus"], ["--bogus"]),
        (["export", "--model", MHA, "--format", "tflite", "--out", "m"], ["'--format'", "onnx"]),
        (["--progress", "loud", "bench"], ["'--progress'", "'loud'"]),
        (["benchh"], ["No such command 'benchh'"]),
        (["export", "--model", MHA, "--format", "onnx"], ["Missing option '--out'"]),
        (["search", "--model", MHA, "--data", "x", "--max-gmacs", "1"], ["Missing option '--out'"]),
    ],
)
def test_a_usage_error_is_one_line_with_exit_2(args: list[str], words: list[str]) -> None:
    line = assert_one_error(run(*args), 2, *words)
    assert "Usage:" not in line
    # The hint names the command whose options were wrong (the group's own for its options).
    command = args[0] if not args[0].startswith("-") and args[0] != "benchh" else None
    # (CliRunner names the program "cli"; the console script, "vitcompress".)
    assert re.search(rf"Try '\w+{' ' + command if command else ''} --help'\.$", line), line


def test_export_without_onnx_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes `import onnx` fail as it does where the package is not installed.
    monkeypatch.setitem(sys.modules, "onnx", None)
    result = run("export", "--model", MHA, *SMALL, "--format", "onnx", "--out", f"{tmp_path}/m")
    line = assert_one_error(result, 2, "onnx", 'pip install -e ".[export]"')
    assert "onnxruntime" not in line  # installed here: only what is missing is named
    assert not list(tmp_path.iterdir())  # refused before any export work


def test_the_bare_command_still_shows_its_help() -> None:
    # No arguments at all is a request for help, not a usage error to shorten.
    result = run()
    assert "Usage:" in result.output and "Commands:" in result.output
    assert "error:" not in result.output
