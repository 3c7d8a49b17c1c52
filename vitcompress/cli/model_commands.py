"""``inspect``, ``bench`` and ``apply``: commands on one model."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from vitcompress.cli.app import (
    cli,
    console,
    emit_json,
    finish_gates,
    fmt_throughput,
    print_environment,
)
from vitcompress.cli.options import (
    gate_options,
    load_from_options,
    model_options,
    timing_options,
)
from vitcompress.cli.plan_options import (
    VariantChoice,
    keep_cumulative_option,
    parse_keep,
    parse_locs,
    plan_file_option,
    tome_r_option,
)
from vitcompress.measure.paired import MIN_PAIRS_FOR_INTERVAL
from vitcompress.workflows.gates import NO_THROUGHPUT, Bounds, check_gates, require
from vitcompress.workflows.identity import artifact_identity, model_identity, unsaved_identity
from vitcompress.workflows.measure_models import speedup
from vitcompress.workflows.status import step


@cli.command()
@model_options
@click.option("--json", "as_json", is_flag=True, help="Print the model map as JSON.")
def inspect(model_spec, model_args, checkpoint, pretrained, input_size, as_json) -> None:
    """Print the model map: stages, blocks, attention cores, prefix tokens and grid ops."""
    from vitcompress.api import map_model

    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    model_map = map_model(loaded.model, loaded.input_size).to_json()
    if as_json:
        emit_json(model_map)
        return
    # Off a terminal (a file, a pipe, CI) nothing is cut or folded: the lines are as long as they
    # need to be. On a terminal long cells fold onto more lines instead of ending in "...".
    on_terminal = console.is_terminal
    console.print(
        f"[bold]{escape(model_spec)}[/]  input {tuple(model_map['input_size'])}  captured by "
        f"{model_map['capture']}  {prefix_text(model_map)}  grid {tuple(model_map['grid'])}",
        soft_wrap=not on_terminal,
    )
    table = Table(show_edge=False)
    for column in ("#", "path", "stage", "tokens", "dim", "heads", "attention", "grid ops"):
        table.add_column(
            column,
            justify="right" if column in ("#", "tokens", "dim", "heads") else "left",
            overflow="fold",
        )
    for block in model_map["blocks"]:
        ops = (
            ", ".join(
                f"{op['kind']} {op['path']} {op['grid'][0]}x{op['grid'][1]}"
                for op in block["grid_ops"]
            )
            or "-"
        )
        table.add_row(
            str(block["index"]),
            block["path"] or "<root>",
            str(block["stage"]),
            str(block["tokens"]),
            str(block["dim"]),
            str(block["heads"]),
            block["attention"],
            ops,
        )
    if on_terminal:
        console.print(table)
    else:
        unbounded = console.options.update_width(1_000_000)  # measure, do not clamp to COLUMNS
        width = Measurement.get(console, unbounded, table).maximum
        # console.print never draws wider than the console: a console as wide as the table.
        Console(
            file=console.file, width=max(width, console.width), color_system=console.color_system
        ).print(table)
    if model_map["leaves"]:
        console.print(
            f"kept whole by the tracer: {', '.join(model_map['leaves'])}", soft_wrap=not on_terminal
        )


def _sweep_sizes(batch_sizes: str | None, plot: str | None, timing: Any) -> list[int] | None:
    """The batch sizes of a sweep, or None for a single timing; bad combinations refused."""
    from vitcompress.workflows.batch_sweep import BatchSizesError, parse_batch_sizes

    if batch_sizes is None:
        if plot is not None:
            raise BatchSizesError("--plot draws a batch sweep: add --batch-sizes")
        return None
    if timing is None:
        raise BatchSizesError("--batch-sizes times the model: drop --no-throughput")
    return parse_batch_sizes(batch_sizes)


def prefix_text(model_map: dict[str, Any]) -> str:
    """``prefix tokens 1 (cls)``, ``prefix tokens 0``, or per stage for a hybrid whose stages
    differ (CvT: ``prefix tokens per stage 0, 0, 1 (cls)``). "cls" means the head reads the first
    prefix token of the last stage."""
    counts = [stage["prefix_tokens"] for stage in model_map["stages"]]
    cls = " (cls)" if model_map["cls_token"] else " (no cls)"
    if len(set(counts)) > 1:
        return f"prefix tokens per stage {', '.join(map(str, counts))}{cls}"
    return f"prefix tokens {counts[0]}" + (cls if counts[0] else "")


@cli.command()
@model_options
@timing_options
@gate_options(accepted=("max_gmacs",))
@click.option(
    "--batch-sizes",
    default=None,
    metavar="B,B,...",
    help="Time at each batch size (replaces --batch-size); a compressed model directory is "
    "timed against its base, and the batch from which it is faster is reported.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PNG",
    help="With --batch-sizes: write the sweep as a plot.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench(
    model_spec,
    model_args,
    checkpoint,
    pretrained,
    input_size,
    timing,
    bounds: Bounds,
    batch_sizes,
    plot,
    as_json,
) -> None:
    """Count parameters and MACs and time the model's throughput."""
    from vitcompress.workflows.measure_models import measure_models

    require(
        bounds,
        {
            "max_acc_drop": "bench measures no accuracy; use eval --base",
            "min_speedup": "bench times one model, so there is no speedup to check; use apply or "
            "eval --base",
        },
    )
    sizes = _sweep_sizes(batch_sizes, plot, timing)  # before minutes of loading
    with step(f"loading {model_spec}"):
        loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    if sizes is not None:
        from vitcompress.cli.bench_sweep import run_sweep

        measured, _ = measure_models({"model": loaded.model}, loaded.input_size, None)
        gmacs = measured["model"].to_json()["gmacs"]
        gates = check_gates(bounds, {"gmacs": gmacs})
        extra = {
            "identity": model_identity(loaded, model_spec),
            **{k: v for k, v in measured["model"].to_json().items() if k != "throughput"},
            "input_size": list(loaded.input_size),
            "gates": [g.to_json() for g in gates],
        }
        run_sweep(loaded, model_spec, sizes, timing, plot, as_json, extra)
        finish_gates(gates, as_json)
        return
    measured, environment = measure_models({"model": loaded.model}, loaded.input_size, timing)
    result = {
        "model": model_spec,
        "identity": model_identity(loaded, model_spec),
        **measured["model"].to_json(),
        "input_size": list(loaded.input_size),
        "environment": environment,
    }
    gates = check_gates(bounds, {"gmacs": result["gmacs"]})
    result["gates"] = [g.to_json() for g in gates]
    if as_json:
        emit_json(result)
        finish_gates(gates, as_json)
        return
    table = Table(show_edge=False)
    for column in ("model", "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column)
    table.add_row(
        model_spec,
        f"{result['params'] / 1e6:.2f}",
        f"{result['gmacs']:.3f}",
        fmt_throughput(result["throughput"]),
    )
    console.print(table)
    print_environment(environment)
    finish_gates(gates, as_json)


@cli.command()
@model_options
@click.option("--variant", type=VariantChoice(), default="etps", show_default=True)
@click.option(
    "--keep",
    default=None,
    help="Keep ratio per location, or a comma list with one per location (default: "
    "0.7; 0.5 for CvT-like models, as in the paper).",
)
@plan_file_option
@tome_r_option
@keep_cumulative_option
@click.option(
    "--locs",
    default=None,
    help="0-based block indices, e.g. 3,6,9 (default: "
    "1/4, 1/2, 3/4 of the depth; stage starts for pyramids; stage 3 for CvT).",
)
@click.option(
    "--policy",
    type=click.Choice(["score", "random"]),
    default="score",
    show_default=True,
    help="random: select tokens at random (robustness analysis).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Write the compressed model here (safetensors + vitcompress.json).",
)
@timing_options
@gate_options(accepted=("min_speedup", "max_gmacs"))
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def apply(
    model_spec,
    model_args,
    checkpoint,
    pretrained,
    input_size,
    variant,
    keep,
    locs,
    policy,
    out,
    timing,
    bounds: Bounds,
    as_json,
) -> None:
    """Compress a model and report params, GMACs and throughput, before and after."""
    from vitcompress.workflows.apply import apply as run_apply
    from vitcompress.workflows.apply import base_to_compress

    unavailable = {
        "max_acc_drop": "apply measures no accuracy; gate the saved model with eval --base"
    }
    if timing is None:
        unavailable["min_speedup"] = NO_THROUGHPUT
    require(bounds, unavailable)
    keep_ratios, locations = parse_keep(keep), parse_locs(locs)  # before minutes of loading
    with step(f"loading {model_spec}"):
        loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
        # An artifact's recorded base is what gets compressed and measured as the base.
        base = base_to_compress(loaded)
    with step(f"compressing {model_spec} with {variant}"):
        result = run_apply(
            base,
            variant=variant,
            keep=keep_ratios,
            locs=locations,
            policy=policy,
            out=out,
            timing=timing,
        )
    data = result.to_json()
    data["input_size"] = list(base.input_size)
    # The speed-up is the median of the round-by-round ratios (both models timed interleaved),
    # with its 95% interval; the ratio of the two medians is kept for reference.
    paired = speedup(result.compressed, result.base)
    data["speedup_ratio_of_medians"] = data["speedup"]
    data["speedup"] = None if paired is None else paired.median
    data["speedup_ci95"] = (
        None if paired is None or paired.interval is None else list(paired.interval)
    )
    data["speedup_pairs"] = 0 if paired is None else paired.pairs
    data["base"]["identity"] = model_identity(
        base, model_spec if base is loaded else base.source.spec
    )
    data["compressed"]["identity"] = (
        artifact_identity(result.out, base.input_size)
        if result.out is not None
        else unsaved_identity(data["base"]["identity"], data["plan"])
    )
    gates = check_gates(
        bounds,
        {"speedup": data["speedup"], "gmacs": data["compressed"]["gmacs"]},
        intervals={"speedup": paired.interval if paired else None},
    )
    data["gates"] = [g.to_json() for g in gates]
    if as_json:
        emit_json(data)
        finish_gates(gates, as_json)
        return
    plan = data["plan"]
    merged = [loc.get("merge_tokens") for loc in plan["locations"]]
    amount = (  # ToMe: tokens merged per block, its own setting
        f"merging r {merged}" if any(r is not None for r in merged) else f"keep {plan['keep']}"
    )
    console.print(
        f"[bold]{model_spec}[/] + {variant} at blocks {plan['locs']} {amount} (policy {policy})"
    )
    table = Table(show_edge=False)
    for column in ("", "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column)
    for name in ("base", "compressed"):
        row = data[name]
        table.add_row(
            name,
            f"{row['params'] / 1e6:.2f}",
            f"{row['gmacs']:.3f}",
            fmt_throughput(row["throughput"]),
        )
    ratio_tp = paired.text() if paired else "-"
    table.add_row(
        "ratio",
        f"{data['compressed']['params'] / data['base']['params']:.3f}",
        f"{data['macs_ratio']:.3f}",
        ratio_tp,
    )
    console.print(table)
    console.print(
        "tokens per block: "
        + " ".join(
            f"{b}->{c}" if b != c else str(b)
            for b, c in zip(data["base_tokens_per_block"], data["tokens_per_block"], strict=True)
        )
    )
    if paired is not None:
        console.print(
            f"speed-up: median of {paired.pairs} paired rounds"
            + (
                ", with its 95% interval"
                if paired.interval
                else f" (an interval needs {MIN_PAIRS_FOR_INTERVAL}; raise --runs)"
            ),
            style="dim",
            highlight=False,
        )
    print_environment(data["environment"])
    if data["out"]:
        console.print(f"saved to {data['out']}")
    finish_gates(gates, as_json)
