"""``search``: the placement and keep ratios that follow the base best under a budget."""

from __future__ import annotations

import click
from rich.table import Table

from vitcompress.cli.app import cli, console, json_option, print_table, show_result
from vitcompress.cli.data_options import data_options
from vitcompress.cli.options import FiniteFloat, model_options, output_option, timing_options
from vitcompress.cli.plan_options import kept_multiple_option
from vitcompress.measure.models import TimingOptions
from vitcompress.workflows.inputs import DataRequest, ModelRequest
from vitcompress.workflows.search_run import Calibration, SearchSpace, search_model


def _variant_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str]:
    from vitcompress.compilation.plan import VARIANTS

    if value is None:
        return list(VARIANTS)
    names = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if not names or unknown:
        raise click.BadParameter(
            f"{', '.join(unknown) or 'nothing given'}: choose from {', '.join(VARIANTS)}"
        )
    return names


def _keep_grid(ctx: click.Context, param: click.Parameter, value: str | None):
    if value is None:
        return None  # the default grid; a windowed model fits each keep in steps of 0.01
    try:
        grid = sorted({round(float(v), 4) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"must be a comma list of numbers, got {value!r}") from None
    if not grid or not all(0 < k <= 1 for k in grid):
        raise click.BadParameter(f"keep ratios must be in (0, 1], got {value!r}")
    return tuple(grid)


@cli.command(name="search")
@model_options(accepts=("timm", "file", "module", "hf"))
@data_options("train", "Split the calibration images are drawn from (read without augmentation).")
@click.option(
    "--max-gmacs", type=FiniteFloat(), default=None, metavar="G", help="Budget: at most G GMACs."
)
@click.option(
    "--max-gmacs-ratio",
    type=FiniteFloat(),
    default=None,
    metavar="R",
    help="Budget: at most R times the base's GMACs (0.6: 60%).",
)
@click.option(
    "--min-speedup",
    type=FiniteFloat(),
    default=None,
    metavar="S",
    help="Budget: a median paired speed-up of at least S over the base, timed on this "
    "machine at --batch-size (candidates are searched within 1/S of the GMACs first).",
)
@click.option(
    "--variants",
    default=None,
    callback=_variant_list,
    metavar="V,V",
    help="Variants to search (default: every registered one).",
)
@click.option(
    "--calib-images",
    "--calibration-images",  # export's name for the same count
    "calib_images",
    default=512,
    show_default=True,
    type=int,
    help="Calibration images the candidates are scored on.",
)
@click.option(
    "--keep-grid",
    default=None,
    callback=_keep_grid,
    metavar="K,K",
    help="Keep ratios tried (default 0.3 to 0.9 in steps of 0.05; on a windowed model, "
    "each method's keep fitted to the budget in steps of 0.01).",
)
@click.option(
    "--max-candidates",
    default=24,
    show_default=True,
    type=int,
    help="Candidates scored at most (the search is exhaustive when the budget-matched "
    "candidates are no more).",
)
@click.option(
    "--warmup-steps",
    default=200,
    show_default=True,
    type=click.IntRange(min=0),
    help="Predictor warm-up steps per learned candidate (dtps, dynamicvit).",
)
@kept_multiple_option(
    "Round every candidate's tokens after each location (prefix tokens included) to the nearest "
    "multiple of N its method can keep, as apply --kept-multiple does (8: tensor-core tiles); "
    "costed, scored and written to plan.yaml rounded."
)
@click.option("--seed", default=0, show_default=True, type=int)
@timing_options
@output_option(
    "--out",
    folder=True,
    required=True,
    help="Output folder: search.json, pareto.png, plan.yaml and the cache that resumes a "
    "stopped search.",
)
@json_option("Print the results as JSON.")
@click.pass_context
def search_command(
    ctx: click.Context,
    model: ModelRequest,
    data: DataRequest,
    max_gmacs: float | None,
    max_gmacs_ratio: float | None,
    min_speedup: float | None,
    variants: list[str],
    calib_images: int,
    keep_grid: tuple[float, ...] | None,
    max_candidates: int,
    warmup_steps: int,
    kept_multiple: int | None,
    seed: int,
    timing: TimingOptions | None,
    out: str,
    as_json: bool,
) -> None:
    """Search where to reduce tokens and how much, under a GMAC or speed budget, scoring each
    candidate by how closely it follows the base on calibration images (no fine-tuning).

    Writes OUT/plan.yaml for apply --plan and finetune --plan. Its progress and running best
    show on stderr (vitcompress --progress plain search ... off a terminal). See docs/search.md.
    """
    from vitcompress.search.driver import Budget

    named = ctx.get_parameter_source("variants") == click.core.ParameterSource.COMMANDLINE
    space = SearchSpace(variants, keep_grid, max_candidates, named, kept_multiple)
    calibration = Calibration(calib_images, ctx.params["batch_size"], warmup_steps, seed)
    budget = Budget(max_gmacs, max_gmacs_ratio, min_speedup)
    result = search_model(model, data, budget, space, calibration, timing, out)
    show_result(result, lambda shown: _print_table(shown.to_json()), as_json)


def _print_table(data: dict) -> None:
    budget = data["budget"]
    console.print(
        f"[bold]{data['model']}[/]: base {data['base_gmacs']:.4g} GMACs, budget "
        f"{budget['gmacs']:.4g} GMACs ({budget['asked']}); {data['strategy']} search, "
        f"{data['scored']} scored ({data['from_cache']} from the cache) of "
        f"{data['space']['budget_matched']} budget-matched candidates",
        highlight=False,
    )
    table = Table(
        title="Pareto front (score = -KL to the base; higher is better)",
        caption="agree: top-1 the same as the base's; top-1: accuracy on the labels; both in % of "
        "the calibration images, before any fine-tuning",
        show_edge=False,
    )
    for column in SEARCH_COLUMNS:
        table.add_column(column)
    best = data["best"]
    default = data.get("paper_default")
    for row in data["pareto"]:
        marks = []
        if _same(row, best):
            marks.append("[green]chosen[/]")
        if default is not None and _same(row, default):
            marks.append("paper default")
        table.add_row(
            row["variant"],
            ",".join(map(str, row["locs"])),
            ",".join(f"{k:g}" for k in row["keep"]),
            f"{row['gmacs']:.4g}",
            f"{row['macs_ratio']:.3f}",
            f"{row['kl']:.4g}",
            _percent(row["agreement"]),
            _percent(row["accuracy"]),
            " ".join(marks),
        )
    print_table(table)
    if default is not None and not any(_same(r, default) for r in data["pareto"]):
        console.print(
            f"paper default {default['variant']} at {default['locs']} keep {default['keep']}: "
            f"{default['gmacs']:.4g} GMACs, KL {default['kl']:.4g} (not on the front)",
            highlight=False,
        )
    for name, why in data["space"]["left_out"].items():
        console.print(f"left out: {name} ({why})", highlight=False)
    for name, why in data["space"].get("out_of_reach", {}).items():
        console.print(f"out of reach: {name} ({why})", highlight=False)
    check = data["macs_check"]
    if check.get("counted"):
        console.print(
            "MACs counted on every candidate (windowed attention has no analytic count)",
            highlight=False,
        )
    else:
        console.print(
            f"analytic vs counted MACs on {len(check['sample'])} candidates: largest error "
            f"{check['max_relative_error']:.3%}",
            highlight=False,
        )
    if data.get("speedup"):
        console.print(f"speed-up measured for the chosen plan: {best['speedup']:.2f}x")
    console.print(f"chosen: {best['variant']} at {best['locs']} keep {best['keep']}")
    for name, path in data["files"].items():
        console.print(f"{FILE_LABELS.get(name, name)}: {path}", highlight=False)


SEARCH_COLUMNS = (
    "variant",
    "locs",
    "keep",
    "GMACs",
    "ratio",
    "KL",
    "agree (%)",
    "top-1 (%)",
    "note",
)
# search.json's "files" keys, in the words the other commands use (apply --plan FILE).
FILE_LABELS = {"recipe": "plan"}


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.2f}"


def _same(a: dict, b: dict | None) -> bool:
    return b is not None and all(a[k] == b[k] for k in ("variant", "locs", "keep"))
