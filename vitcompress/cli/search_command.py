"""``search``: the placement and keep ratios that follow the base best under a budget."""

from __future__ import annotations

import contextlib

import click
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from vitcompress.cli.app import cli, console, emit_json, err_console
from vitcompress.cli.data_options import data_config_options, data_source_options
from vitcompress.cli.options import load_from_options, model_options, timing_options


def _variant_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str]:
    from vitcompress.graph.plan import VARIANTS

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
    from vitcompress.search.space import DEFAULT_KEEP_GRID

    if value is None:
        return DEFAULT_KEEP_GRID
    try:
        grid = sorted({round(float(v), 4) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"must be a comma list of numbers, got {value!r}") from None
    if not grid or not all(0 < k <= 1 for k in grid):
        raise click.BadParameter(f"keep ratios must be in (0, 1], got {value!r}")
    return tuple(grid)


@cli.command(name="search")
@model_options
@data_source_options(
    "train", "Split the calibration images are drawn from (read without augmentation)."
)
@click.option("--max-gmacs", type=float, default=None, metavar="G", help="Budget: at most G GMACs.")
@click.option(
    "--max-gmacs-ratio",
    type=float,
    default=None,
    metavar="R",
    help="Budget: at most R times the base's GMACs (0.6: 60%).",
)
@click.option(
    "--min-speedup",
    type=float,
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
    help="Keep ratios tried (default 0.3 to 0.9 in steps of 0.05).",
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
@click.option("--seed", default=0, show_default=True, type=int)
@data_config_options
@timing_options
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    help="Output folder: search.json, pareto.png, plan.yaml and the cache that resumes a "
    "stopped search.",
)
@click.option(
    "--progress",
    "show_progress",
    is_flag=True,
    help="Progress bar and running best on stderr, also off a terminal (as vitcompress "
    "--progress plain search ...).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.pass_context
def search_command(
    ctx: click.Context,
    model_spec,
    model_args,
    checkpoint,
    pretrained,
    input_size,
    data,
    data_dir,
    split,
    max_gmacs,
    max_gmacs_ratio,
    min_speedup,
    variants,
    calib_images,
    keep_grid,
    max_candidates,
    warmup_steps,
    seed,
    data_overrides,
    timing,
    out,
    show_progress,
    as_json,
) -> None:
    """Search where to reduce tokens and how much, under a GMAC or speed budget, scoring each
    candidate by how closely it follows the base on calibration images (no fine-tuning).

    Writes OUT/plan.yaml for apply --plan and finetune --plan. See docs/search.md.
    """
    from vitcompress.cli.status import ConsoleStatus
    from vitcompress.data import model_dataset
    from vitcompress.metadata import compression_info
    from vitcompress.workflows.search import Budget, SearchConfig, SearchError, search
    from vitcompress.workflows.status import reporting

    budget = Budget(max_gmacs, max_gmacs_ratio, min_speedup)
    batch_size = ctx.params["batch_size"]
    budget.check()  # before minutes of loading
    if timing is not None and min_speedup is None:
        timed_only = [
            flag
            for flag, given in (
                ("--compile", timing.compile),
                ("--fused-kernels", timing.fused_kernels),
            )
            if given
        ]
        if timed_only:
            raise SearchError(
                f"{' and '.join(timed_only)} set how --min-speedup is timed; without "
                "--min-speedup nothing is timed: add it or drop them"
            )
    if timing is not None and timing.fused_kernels:
        from vitcompress.kernels import build_fused_kernels

        build_fused_kernels()  # before minutes of scoring, not after them
    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    if compression_info(loaded.model) is not None:
        raise SearchError(f"{model_spec} is already compressed; search its base model instead")
    dataset, config = model_dataset(
        loaded.model, data, split, loaded.input_size, data_dir, data_overrides
    )
    search_config = SearchConfig(
        budget=budget,
        variants=variants,
        out=out,
        calib_images=calib_images,
        batch_size=batch_size,
        keep_grid=keep_grid,
        max_candidates=max_candidates,
        warmup_steps=warmup_steps,
        seed=seed,
        timing=timing,
        variants_named=ctx.get_parameter_source("variants")
        == click.core.ParameterSource.COMMANDLINE,
        identity={
            "model": model_spec,
            "model_args": list(model_args),
            "checkpoint": checkpoint,
            "pretrained": pretrained,
            "data": data,
            "split": split,
            "data_config": config.to_json(),
        },
    )
    shown = (
        reporting(ConsoleStatus(err_console, "plain"))
        if show_progress
        else contextlib.nullcontext()
    )
    with shown:
        result = search(loaded, dataset, search_config)
    data_out = result.data
    if as_json:
        emit_json(data_out)
        return
    _print_table(data_out)


def _print_table(data: dict) -> None:
    budget = data["budget"]
    console.print(
        f"[bold]{data['model']}[/]: base {data['base_gmacs']:.4g} GMACs, budget "
        f"{budget['gmacs']:.4g} GMACs ({budget['asked']}); {data['strategy']} search, "
        f"{data['scored']} scored ({data['from_cache']} from the cache) of "
        f"{data['space']['budget_matched']} budget-matched candidates",
        highlight=False,
    )
    table = Table(title="Pareto front (score = -KL to the base; higher is better)", show_edge=False)
    for column in ("variant", "locs", "keep", "GMACs", "ratio", "KL", "agree", "acc", ""):
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
            f"{row['agreement']:.4f}",
            "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}",
            " ".join(marks),
        )
    if console.is_terminal:
        console.print(table)
    else:  # a file or a pipe: the table as wide as it needs, nothing cut to "..."
        width = Measurement.get(console, console.options.update_width(1_000_000), table).maximum
        Console(file=console.file, width=max(width, console.width), color_system=None).print(table)
    if default is not None and not any(_same(r, default) for r in data["pareto"]):
        console.print(
            f"paper default {default['variant']} at {default['locs']} keep {default['keep']}: "
            f"{default['gmacs']:.4g} GMACs, KL {default['kl']:.4g} (not on the front)",
            highlight=False,
        )
    for name, why in data["space"]["left_out"].items():
        console.print(f"left out: {name} ({why})", highlight=False)
    check = data["macs_check"]
    console.print(
        f"analytic vs counted MACs on {len(check['sample'])} candidates: largest error "
        f"{check['max_relative_error']:.3%}",
        highlight=False,
    )
    if data.get("speedup"):
        console.print(f"speed-up measured for the chosen plan: {best['speedup']:.2f}x")
    console.print(f"chosen: {best['variant']} at {best['locs']} keep {best['keep']}")
    for name, path in data["files"].items():
        console.print(f"{name}: {path}", highlight=False)


def _same(a: dict, b: dict | None) -> bool:
    return b is not None and all(a[k] == b[k] for k in ("variant", "locs", "keep"))
