"""``--keep-for-gmacs-ratio`` / ``keep_for_gmacs_ratio=``: the largest keep whose compressed model
costs at most a share of the base's MACs, checked against the counts of the keeps around it."""

from __future__ import annotations

import json
import math

import click
import pytest
import torch
from click.testing import CliRunner

from tests.models import FIXTURES
from tests.test_windowed import SIZE, swin
from vitcompress import compress
from vitcompress.cli.main import cli
from vitcompress.cli.plan_options import (
    keep_cumulative_option,
    keep_for_gmacs_option,
    variant_args_option,
)
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import PlanError
from vitcompress.measure import count_macs
from vitcompress.measure.keep_fit import GmacsRatio, compress_within_gmacs, fit_keep

MHA = f"{FIXTURES}:mha_vit"  # 8 x 8 patch tokens and a cls token, 4 blocks


def _staircase(keep: float) -> float:
    """A cost that grows with keep in steps, as per-window token counts make it: 0.4 of the
    work fixed, the rest in 49-token windows keeping floor(49 * keep)."""
    return 0.4 + 0.6 * math.floor(49 * keep) / 49


@pytest.mark.parametrize("budget", [0.45, 0.6, 0.7375, _staircase(0.5), 0.85, 0.999])
def test_the_fit_is_the_largest_keep_of_the_grid_within_the_budget(budget):
    tried: list[float] = []

    def cost(keep: float) -> float:
        tried.append(keep)
        return _staircase(keep)

    fit = fit_keep(cost, GmacsRatio(budget))
    within = [i / 100 for i in range(1, 101) if _staircase(i / 100) <= budget]
    assert fit.keep == max(within)
    assert fit.cost == _staircase(fit.keep) <= budget
    assert fit.next_cost == _staircase(round(fit.keep + 0.01, 2)) > budget
    # Keep 1, tenths down to the budget, then halving the tenth above it.
    assert fit.tries == len(set(tried)) <= 15


def test_a_budget_the_whole_model_meets_keeps_everything():
    fit = fit_keep(_staircase, GmacsRatio(1.0))
    assert (fit.keep, fit.next_cost, fit.tries) == (1.0, None, 1)


def test_a_budget_out_of_reach_is_one_line_naming_the_smallest_cost():
    with pytest.raises(
        PlanError,
        match=r"0.3 is out of reach: the smallest keep the method takes "
        r"here, 0.01, costs 0.400",
    ):
        fit_keep(_staircase, GmacsRatio(0.3))


def test_keeps_refused_by_raising_are_stepped_over_and_named_where_none_is_taken():
    """A cost may raise the method's refusal instead of returning ``None``: stepped over alike;
    where no keep is taken, the line names the refusal most keeps met."""

    def low_keeps_only(keep: float) -> float:
        if keep >= 0.5:
            raise PlanError("removes no token here", "keep")
        return _staircase(keep)

    fit = fit_keep(low_keeps_only, GmacsRatio(0.85))
    assert fit.keep == 0.49 and fit.next_cost is None

    def never(keep: float) -> float:
        raise PlanError("pooled keys" if keep < 1 else "removes no token")

    with pytest.raises(PlanError) as refused:
        fit_keep(never, GmacsRatio(0.85))
    line = str(refused.value)
    assert line.startswith("keep_for_gmacs_ratio no keep tried is taken by this method here; ")
    tries = int(line.split(" of the ")[1].split(" ")[0])
    assert line.endswith(f"; {tries - 1} of the {tries} keeps tried were refused: pooled keys")


def _taken_between(low: float, high: float):
    """A method that refuses keeps below ``low`` (ToMe cannot merge that many) and from ``high``
    up to 1 (they remove no token), keep 1 itself taken; the staircase cost where it takes one."""

    def cost(keep: float) -> float | None:
        if keep == 1.0:
            return _staircase(1.0)
        return _staircase(keep) if low <= keep < high else None

    return cost


@pytest.mark.parametrize("low, high", [(0.5, 0.97), (0.43, 1.0), (0.01, 0.92), (0.55, 0.61)])
@pytest.mark.parametrize("budget", [0.7, 0.75, 0.9, 0.99])
def test_keeps_the_method_refuses_are_stepped_over(low, high, budget):
    cost = _taken_between(low, high)
    grid = [i / 100 for i in range(1, 101)]
    within = [k for k in grid if (c := cost(k)) is not None and c <= budget]
    if not within:
        with pytest.raises(PlanError, match=f"the smallest keep the method takes here, {low:g}"):
            fit_keep(cost, GmacsRatio(budget))
        return
    fit = fit_keep(cost, GmacsRatio(budget))
    assert fit.keep == max(within)
    above = cost(round(fit.keep + 0.01, 2)) if fit.keep < 1 else None
    assert fit.next_cost == (above if above is not None and fit.keep < 1 else None)
    assert above is None or above > budget


@pytest.mark.parametrize("ratio", [0, -0.5, math.nan, math.inf, True, "0.8"])
def test_a_budget_must_be_a_finite_positive_number(ratio):
    with pytest.raises(PlanError, match="must be a"):
        GmacsRatio(ratio)


@pytest.mark.parametrize("step", [0.03, 0.3, 0, -0.01])
def test_the_grid_step_must_divide_one(step):
    with pytest.raises(PlanError, match="its step must divide 1"):
        GmacsRatio(0.8, step=step)


@pytest.fixture(scope="module")
def windowed() -> torch.nn.Module:
    return swin()


@pytest.mark.parametrize("variant", ["etps", "dtps", "tome"])
def test_the_keep_found_on_a_swin_is_counted_within_and_the_next_over(windowed, variant):
    # The 56-pixel Swin of test_windowed: every windowed block a location, its windows of 49.
    budget = 0.9
    model = compress_within_gmacs(windowed, variant, budget, input_size=SIZE)
    fit = model.vitcompress_keep_fit
    base = count_macs(windowed, SIZE)
    assert compression_info(model).plan.keep == [fit["keep"]] * 4
    cost = count_macs(model, SIZE) / base
    assert cost == pytest.approx(fit["cost"]) and cost <= budget
    above = compress(windowed, variant, keep=round(fit["keep"] + 0.01, 2), input_size=SIZE)
    next_cost = count_macs(above, SIZE) / base
    assert next_cost == pytest.approx(fit["next_cost"]) and next_cost > budget


def test_the_api_refuses_a_budget_beside_tomes_r(windowed):
    with pytest.raises(PlanError, match="keep_for_gmacs_ratio and tome's r exclude each other"):
        compress_within_gmacs(windowed, "tome", 0.8, input_size=SIZE, variant_args={"r": 4})


def apply(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, ["apply", "--model", MHA, *args, "--no-throughput", "--json"])


def test_apply_reports_the_keep_it_found_and_its_gmacs():
    result = apply("--variant", "etps", "--keep-for-gmacs-ratio", "0.8")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    fit = data["keep_fit"]
    assert data["plan"]["keep"] == [fit["keep"]] * 3
    assert data["macs_ratio"] == pytest.approx(fit["cost"]) and fit["cost"] <= 0.8
    assert fit["next_cost"] > 0.8
    plain = json.loads(apply("--variant", "etps", "--keep", str(fit["keep"])).output)
    assert plain["compressed"]["macs"] == data["compressed"]["macs"] and plain["keep_fit"] is None


@pytest.mark.parametrize(
    "args",
    [
        # ToMe refuses keeps under 0.5 where it merges in every block of a stage.
        ["--variant", "tome", "--keep-for-gmacs-ratio", "0.8"],
        # A budget near keep 1's cost: keeps near 1 that remove no token are refused.
        ["--variant", "etps", "--keep-for-gmacs-ratio", "0.999"],
        ["--variant", "evit", "--keep-for-gmacs-ratio", "0.995"],
    ],
)
def test_keeps_a_method_refuses_do_not_stop_the_search(args):
    result = apply(*args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    budget = float(args[-1])
    assert data["macs_ratio"] == pytest.approx(data["keep_fit"]["cost"])
    assert data["macs_ratio"] <= budget


def test_apply_prints_how_it_found_the_keep():
    result = CliRunner().invoke(
        cli, ["apply", "--model", MHA, "--keep-for-gmacs-ratio", "0.8", "--no-throughput"]
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    fit = json.loads(apply("--keep-for-gmacs-ratio", "0.8").output)["keep_fit"]
    assert (
        f"keep {fit['keep']:g}: the largest (in steps of 0.01) within 0.8 of the base's GMACs "
        f"({fit['cost']:.4f}; {fit['keep'] + 0.01:g} costs {fit['next_cost']:.4f}), "
        f"{fit['tries']} keeps tried"
    ) in text


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--keep", "0.7", "--keep-for-gmacs-ratio", "0.8"],
            "--keep-for-gmacs-ratio excludes --keep and --keep-cumulative",
        ),
        (["--keep-for-gmacs-ratio", "most"], "--keep-for-gmacs-ratio must be a number"),
        (["--keep-for-gmacs-ratio", "0"], "--keep-for-gmacs-ratio must be a finite number above 0"),
        (["--keep-for-gmacs-ratio", "0.05"], "--keep-for-gmacs-ratio 0.05 is out of reach"),
        (
            ["--variant", "tome", "--variant-arg", "r=4", "--keep-for-gmacs-ratio", "0.8"],
            "--keep-for-gmacs-ratio and --variant-arg r exclude each other",
        ),
    ],
)
def test_bad_budgets_are_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(cli, ["apply", "--model", MHA, *args, "--no-throughput"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0]


def test_a_plan_file_may_give_the_budget(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("variant: etps\nkeep-for-gmacs-ratio: 0.8\n")
    data = json.loads(apply("--plan", str(plan)).output)
    assert data["keep_fit"]["gmacs_ratio"] == 0.8
    # A keep typed on the command line replaces the file's budget.
    typed = json.loads(apply("--plan", str(plan), "--keep", "0.5").output)
    assert typed["keep_fit"] is None and typed["plan"]["keep"] == [0.5] * 3


@click.command()
@click.option("--keep", default=None)
@keep_cumulative_option
@keep_for_gmacs_option
def _show_keep(keep) -> None:
    click.echo(repr(keep))


@pytest.mark.parametrize(
    "args, recipe, shown",
    [
        (["--keep", "0.5"], {"keep_for_gmacs_ratio": "0.8"}, "'0.5'"),
        (["--keep-for-gmacs-ratio", "0.8"], {"keep": "0.5"}, "GmacsRatio(ratio=0.8, step=0.01)"),
        (
            ["--keep-for-gmacs-ratio", "0.8"],
            {"keep_cumulative": "0.7,0.49"},
            "GmacsRatio(ratio=0.8, step=0.01)",
        ),
    ],
)
def test_the_command_line_wins_over_a_recipe(args, recipe, shown):
    result = CliRunner().invoke(_show_keep, args, default_map=recipe)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == shown


@click.command()
@click.option("--variant", default="tome")
@click.option("--keep", default=None)
@variant_args_option
@keep_cumulative_option
@keep_for_gmacs_option
def _show_plan(variant, keep) -> None:
    click.echo(f"{variant.keep_setting} {keep!r}")


@pytest.mark.parametrize(
    "args, recipe, shown",
    [
        (["--variant-arg", "r=4"], {"keep_for_gmacs_ratio": "0.8"}, "r None"),
        (
            ["--keep-for-gmacs-ratio", "0.8"],
            {"variant_args": ("r=4",)},
            "None GmacsRatio(ratio=0.8, step=0.01)",
        ),
    ],
)
def test_a_typed_r_or_budget_wins_over_the_other_in_a_recipe(args, recipe, shown):
    result = CliRunner().invoke(_show_plan, args, default_map=recipe)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == shown
