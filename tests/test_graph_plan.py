"""The plan as part of the graph layer: typed parameters, errors that name them, the command
line's translation into its option names, and no import from the layers above the graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

import vitcompress
from tests.fixtures import inhouse
from tests.models import FIXTURES
from vitcompress import map_model
from vitcompress.cli.main import cli
from vitcompress.cli.plan_options import parse_keep, parse_locs, plan_error_line
from vitcompress.compilation.plan import Plan, PlanError, make_plan, resolve_variant
from vitcompress.variants import get_variant

PACKAGE = Path(vitcompress.__file__).parent
GRAPH = PACKAGE / "graph"
# The graph layer builds on method and modules only; these sit above it.
ABOVE_GRAPH = (
    "vitcompress.cli",
    "vitcompress.workflows",
    "vitcompress.plan",
    "vitcompress.api",
    "vitcompress.training",
    "vitcompress.artifacts.artifact",
    "vitcompress.compilation.compression",
)
MHA = f"{FIXTURES}:mha_vit"
SMALL = ["--model-arg", "depth=2", "--model-arg", "dim=32"]


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, lazy imports inside functions included, relative ones
    resolved against the graph package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = ["vitcompress", "graph"][: 3 - node.level]
                base = ".".join(package + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return found


def test_the_graph_layer_imports_nothing_above_it() -> None:
    assert not (PACKAGE / "plan.py").exists()  # the plan lives in the graph layer alone
    offending = {
        f"{path.name}: {name}"
        for path in GRAPH.glob("*.py")
        for name in _imported_modules(path)
        if any(name == above or name.startswith(above + ".") for above in ABOVE_GRAPH)
    }
    assert offending == set()


def test_the_import_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "def f():\n    from vitcompress.cli import app\nfrom ..workflows import apply\n"
    )
    names = _imported_modules(source)
    assert "vitcompress.cli" in names and "vitcompress.workflows.apply" in names


SIZE = (3, 32, 32)


@pytest.fixture(scope="module")
def model_map():
    return map_model(inhouse.mha_vit(dim=32), SIZE)  # 4 blocks


@pytest.mark.parametrize(
    "keep, locs, parameter, detail",
    [
        ([1.5], [1], "keep", "must be in (0, 1], got 1.5"),
        ([], [1], "keep", "must not be empty"),
        ([0.5, 0.5], [1], "keep", "has 2 values for 1 locations"),
        (0.5, [1], "keep", "must be a list of keep ratios, got 0.5"),
        (["0.5"], [1], "keep", "must be numbers, got '0.5'"),
        ([0.5], [4], "locs", "4 is out of range: the model has 4 blocks (0..3)"),
        ([0.5], [], "locs", "must not be empty"),
        ([0.5], [2, 1], "locs", "must be strictly increasing without duplicates, got [2, 1]"),
        ([0.5], "1,2", "locs", "must be a list of block indices or None, got '1,2'"),
    ],
)
def test_plan_errors_name_the_parameter(model_map, keep, locs, parameter, detail) -> None:
    with pytest.raises(PlanError) as raised:
        make_plan(model_map, get_variant("etps"), keep, locs)
    error = raised.value
    assert (error.parameter, error.detail) == (parameter, detail)
    assert str(error) == f"{parameter} {detail}" and "--" not in str(error)
    assert plan_error_line(error) == f"--{parameter} {detail}"


def test_unknown_variant_and_policy_name_their_parameter(model_map) -> None:
    with pytest.raises(PlanError, match=r"^variant 'tps' is unknown; choose from dtps"):
        resolve_variant("tps")
    with pytest.raises(PlanError, match=r"^policy 'best' is unknown"):
        make_plan(model_map, get_variant("etps"), [0.5], policy="best")


def test_one_keep_ratio_applies_to_every_location(model_map) -> None:
    plan = make_plan(model_map, get_variant("dtps"), [0.5], [1, 2])
    assert plan.keep == [0.5, 0.5] and plan.locs == [1, 2]
    assert [loc.cumulative_keep for loc in plan.locations] == [0.5, 0.25]
    assert Plan.from_json(plan.to_json()) == plan


def test_the_api_takes_one_ratio_or_a_list() -> None:
    one = vitcompress.compress(
        inhouse.mha_vit(dim=32), "etps", keep=0.5, locs=[1, 2], input_size=SIZE
    )
    listed = vitcompress.compress(
        inhouse.mha_vit(dim=32), "etps", keep=[0.5, 0.5], locs=(1, 2), input_size=SIZE
    )
    assert one.vitcompress_plan == listed.vitcompress_plan
    assert one.vitcompress_plan["keep"] == [0.5, 0.5]


def test_command_line_text_is_parsed_into_lists() -> None:
    assert parse_keep(None) is None and parse_locs(None) is None
    assert parse_keep("0.7") == [0.7] and parse_keep("0.7, 0.5") == [0.7, 0.5]
    assert parse_keep(0.5) == [0.5]  # a recipe's YAML number
    assert parse_locs("3,6,9") == [3, 6, 9]
    with pytest.raises(PlanError) as raised:
        parse_locs("1;2")
    assert plan_error_line(raised.value) == "--locs must be a comma list of integers, got '1;2'"
    with pytest.raises(PlanError) as raised:
        parse_keep("most")
    assert plan_error_line(raised.value).startswith("--keep must be a number")


def test_a_plan_refusal_without_a_parameter_is_told_as_it_is() -> None:
    error = PlanError("block 2 applies the position table t after the token reduction")
    assert error.parameter is None and plan_error_line(error) == str(error)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--locs", "7"], "error: --locs 7 is out of range: the model has 2 blocks (0..1)"),
        (["--keep", "0.5,0.5,0.5"], "error: --keep has 3 values for 1 locations"),
        (["--keep", ""], "error: --keep must not be empty"),
    ],
)
def test_the_command_line_names_its_options(args: list[str], line: str) -> None:
    result = CliRunner().invoke(cli, ["apply", "--model", MHA, *SMALL, "--no-throughput", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [line]
