"""CI gates: the pure checks in ``vitcompress.workflows.gates`` and the exit codes of the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.models import FIXTURES
from tests.test_data import write_image_folder
from vitcompress.cli.main import cli
from vitcompress.workflows.gates import Bounds, GateError, check_gates, failed, require

MHA = f"{FIXTURES}:mha_vit"
SMALL = ["--model-arg", "depth=2", "--model-arg", "dim=32"]
FAST = ["--batch-size", "2", "--warmup", "0", "--runs", "1"]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


# --------------------------------------------------------------------------------------------
# Pure checks


def test_no_bounds_no_results() -> None:
    assert check_gates(Bounds(), {"speedup": 1.0, "gmacs": 2.0}) == []
    assert not Bounds()


def test_each_bound_compares_in_its_direction() -> None:
    bounds = Bounds(max_acc_drop=1.0, min_speedup=1.2, max_gmacs=3.0)
    results = check_gates(bounds, {"acc_drop": 1.0, "speedup": 1.07, "gmacs": 3.5})
    assert [(r.name, r.passed) for r in results] == [
        ("max_acc_drop", True),
        ("min_speedup", False),
        ("max_gmacs", False),
    ]
    assert [r.name for r in failed(results)] == ["min_speedup", "max_gmacs"]
    assert results[1].to_json() == {
        "name": "min_speedup",
        "bound": 1.2,
        "value": 1.07,
        "interval": None,
        "passed": False,
    }
    assert results[1].message() == "--min-speedup 1.20 but measured 1.07x"
    assert results[2].message() == "--max-gmacs 3.000 but measured 3.500 GMACs"
    assert results[0].message() == "--max-acc-drop 1.00 and measured 1.00 points"


def test_close_values_print_with_enough_decimals() -> None:
    [result] = check_gates(Bounds(min_speedup=1.2), {"speedup": 1.1996})
    assert not result.passed
    assert result.message() == "--min-speedup 1.2000 but measured 1.1996x"


def test_the_bound_prints_as_typed() -> None:
    [result] = check_gates(Bounds(max_gmacs=0.0366), {"gmacs": 0.036})
    assert result.passed
    assert result.message() == "--max-gmacs 0.0366 and measured 0.0360 GMACs"


def test_an_accuracy_drop_of_exactly_the_bound_passes() -> None:
    # 8.8 - 6.8 is 2.000000000000001 in floats: the drop of two image-count percentages is
    # rounded before it is compared.
    from types import SimpleNamespace

    from vitcompress.workflows.eval_run import EvalResult

    assert 8.8 - 6.8 > 2
    base = SimpleNamespace(
        accuracy={"top1": 8.8}, speedup=None, measured={"model": SimpleNamespace(macs=1e9)}
    )
    result = EvalResult("m", "d", "val", (3, 32, 32), {"top1": 6.8}, None, {}, base=base)
    [gate] = check_gates(Bounds(max_acc_drop=2.0), result.gate_values())
    assert gate.passed, gate.message()


def test_a_missing_value_fails_its_gate() -> None:
    [result] = check_gates(Bounds(min_speedup=1.1), {"speedup": None})
    assert not result.passed and result.value is None
    assert "not measured" in result.message()


def test_require_names_the_flag_and_the_reason() -> None:
    require(Bounds(max_gmacs=1.0), {"min_speedup": "no base"})
    with pytest.raises(GateError, match="--min-speedup: no base"):
        require(Bounds(min_speedup=1.1), {"min_speedup": "no base"})


# --------------------------------------------------------------------------------------------
# Commands


def gate_lines(result: Result) -> list[str]:
    # eval adds "note:" lines about the data config it assumed; the gates are what is checked here
    return [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith("note: ")
    ]


def test_apply_passes_and_reports_gates_in_json() -> None:
    result = run(
        "apply",
        "--model",
        MHA,
        *SMALL,
        "--keep",
        "0.5",
        *FAST,
        "--json",
        "--max-gmacs",
        "10",
        "--min-speedup",
        "1e-6",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(g["name"], g["passed"]) for g in data["gates"]] == [
        ("min_speedup", True),
        ("max_gmacs", True),
    ]
    assert data["gates"][1]["value"] == pytest.approx(data["compressed"]["gmacs"])


def test_apply_missed_bound_exits_3_after_the_report() -> None:
    result = run(
        "apply", "--model", MHA, *SMALL, "--keep", "0.5", "--no-throughput", "--max-gmacs", "0.0001"
    )
    assert result.exit_code == 3, result.output
    assert "tokens per block" in result.stdout  # the report came first
    assert "gate FAILED" in result.stdout
    [line] = gate_lines(result)
    assert line.startswith("gate failed: --max-gmacs 0.000") and line.endswith(" GMACs")


def test_apply_json_is_printed_before_failing() -> None:
    result = run(
        "apply",
        "--model",
        MHA,
        *SMALL,
        "--keep",
        "0.5",
        *FAST,
        "--json",
        "--min-speedup",
        "1000",
        "--max-gmacs",
        "0.0001",
    )
    assert result.exit_code == 3
    data = json.loads(result.stdout)
    assert [g["passed"] for g in data["gates"]] == [False, False]
    lines = gate_lines(result)
    assert len(lines) == 2 and lines[0].startswith("gate failed: --min-speedup 1000.00 but ")


@pytest.mark.parametrize(
    "args, words",
    [
        (["apply", "--no-throughput", "--min-speedup", "1.1"], "--no-throughput"),
        (["apply", "--no-throughput", "--max-acc-drop", "1"], "eval --base"),
        (["bench", "--no-throughput", "--min-speedup", "1.1"], "one model"),
        (["bench", "--no-throughput", "--max-acc-drop", "1"], "no accuracy"),
    ],
)
def test_bounds_a_command_cannot_check_are_input_errors(args: list[str], words: str) -> None:
    result = run(*args, "--model", MHA, *SMALL)
    assert result.exit_code == 2, result.output
    [line] = gate_lines(result)
    assert line.startswith("error: --") and words in line


def test_bench_max_gmacs() -> None:
    passed = run("bench", "--model", MHA, *SMALL, "--no-throughput", "--max-gmacs", "10", "--json")
    assert passed.exit_code == 0, passed.output
    assert json.loads(passed.stdout)["gates"][0]["passed"] is True
    missed = run("bench", "--model", MHA, *SMALL, "--no-throughput", "--max-gmacs", "0.0001")
    assert missed.exit_code == 3
    assert gate_lines(missed)[0].startswith("gate failed: --max-gmacs")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("data") / "imgs", per_class=2, size=32)


def test_eval_gates_need_base_but_max_gmacs_does_not(folder: Path) -> None:
    common = [
        "eval",
        "--model",
        MHA,
        *SMALL,
        "--model-arg",
        "num_classes=2",
        "--data",
        str(folder),
        "--batch-size",
        "4",
        "--no-throughput",
    ]
    result = run(*common, "--max-acc-drop", "1")
    assert result.exit_code == 2 and "--max-acc-drop: needs --base" in result.stderr
    result = run(*common, "--max-gmacs", "10", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["gates"][0]["name"] == "max_gmacs"


SEEDED = """
import torch

from tests.fixtures.inhouse import mha_vit


def seeded():
    torch.manual_seed(0)
    return mha_vit(depth=2, dim=32, num_classes=2)
"""


def test_eval_against_base(folder: Path, tmp_path: Path) -> None:
    # The same weights against themselves: no accuracy drop, so 0 passes and -1 fails.
    factory = tmp_path / "seeded.py"
    factory.write_text(SEEDED)
    spec = f"{factory}:seeded"
    common = ["eval", "--model", spec, "--data", str(folder), "--base", spec, *FAST]
    result = run(*common, "--max-acc-drop", "0", "--min-speedup", "1e-6", "--json")
    assert result.exit_code == 0, result.output
    gates = json.loads(result.stdout)["gates"]
    assert [(g["name"], g["value"], g["passed"]) for g in gates][0] == ("max_acc_drop", 0.0, True)
    missed = run(*common, "--max-acc-drop", "-1")
    assert missed.exit_code == 3, missed.output
    assert gate_lines(missed) == ["gate failed: --max-acc-drop -1.00 but measured 0.00 points"]
