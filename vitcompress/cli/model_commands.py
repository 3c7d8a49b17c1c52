"""``inspect``, ``bench`` and ``apply``: commands on one model."""

from __future__ import annotations

from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from vitcompress.cli.app import (
    cli,
    console,
    emit_json,
    fmt_throughput,
    json_option,
    print_environment,
    print_table,
    show_result,
)
from vitcompress.cli.options import gate_options, model_options, output_option, timing_options
from vitcompress.cli.outputs import PLOT_SUFFIXES
from vitcompress.cli.plan_options import plan_options
from vitcompress.measure.keep_fit import KeepFit
from vitcompress.measure.models import TimingOptions
from vitcompress.measure.paired import rounds_text
from vitcompress.workflows.apply import ApplyReport, apply_model
from vitcompress.workflows.bench import BenchResult, SweepResult, bench_model, inspect_model
from vitcompress.workflows.gates import Bounds
from vitcompress.workflows.inputs import ModelRequest, PlanRequest


@cli.command()
@model_options
@json_option("Print the model map as JSON.")
def inspect(model: ModelRequest, as_json: bool) -> None:
    """Print the model map: stages, blocks, attention cores, prefix tokens and grid ops."""
    model_map = inspect_model(model).to_json()
    if as_json:
        emit_json(model_map)
        return
    # Off a terminal (a file, a pipe, CI) nothing is cut or folded: the lines are as long as they
    # need to be. On a terminal long cells fold onto more lines instead of ending in "...".
    on_terminal = console.is_terminal
    console.print(
        f"[bold]{escape(model.spec)}[/]  input {tuple(model_map['input_size'])}  captured by "
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
                f"{op['kind']} {op['path']} {'x'.join(map(str, op['grid']))}"
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
    print_table(table)
    readers = [
        f"{reader['what']} at {reader['path']} (after block {block['index']})"
        for block in model_map["blocks"]
        for reader in block["readers"]
    ]
    branches = [
        f"{path} (after block {block['index']})"
        for block in model_map["blocks"]
        for path in block.get("per_token_after", [])
    ]
    for title, items in (
        ("read by position (a compressed model restores its tokens there)", readers),
        (
            "per-token branches a location's choice reduces too (carry_branches, on by default)",
            branches,
        ),
        ("left whole (no method reduces them)", model_map.get("left_whole", [])),
    ):
        if items:
            console.print(
                f"{title}: " + "; ".join(items), soft_wrap=not on_terminal, highlight=False
            )
    if model_map["leaves"]:
        console.print(
            f"kept whole by the tracer: {', '.join(model_map['leaves'])}", soft_wrap=not on_terminal
        )


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
@output_option(
    "--plot",
    folder=False,
    metavar="PNG",
    help="With --batch-sizes: write the sweep as a plot.",
    suffixes=PLOT_SUFFIXES,
)
@json_option("Print the results as JSON.")
def bench(
    model: ModelRequest,
    timing: TimingOptions | None,
    bounds: Bounds,
    batch_sizes: str | None,
    plot: str | None,
    as_json: bool,
) -> None:
    """Count parameters and MACs and time the model's throughput."""
    from vitcompress.workflows.batch_sweep import parse_batch_sizes

    ctx = click.get_current_context()
    if batch_sizes is not None and ctx.get_parameter_source("batch_size") not in (
        None,
        click.core.ParameterSource.DEFAULT,
    ):
        raise click.UsageError("--batch-sizes replaces --batch-size: give one of them.")
    sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else None
    result = bench_model(model, timing, bounds, sizes, plot)
    show_result(result, _print_bench, as_json)


def _print_bench(result: BenchResult | SweepResult) -> None:
    if isinstance(result, SweepResult):
        from vitcompress.cli.bench_sweep import print_sweep

        print_sweep(result)
        return
    table = Table(show_edge=False)
    for column in ("model", "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column)
    measured = result.measurement
    table.add_row(
        result.spec,
        f"{measured.params / 1e6:.2f}",
        f"{measured.macs / 1e9:.3f}",
        fmt_throughput(measured.throughput),
    )
    console.print(table)
    print_environment(result.environment)


@cli.command()
@model_options
@plan_options
@output_option(
    "--out",
    folder=True,
    replaced=True,
    help="Write the compressed model here (safetensors + vitcompress.json).",
)
@timing_options
@gate_options(accepted=("min_speedup", "max_gmacs"))
@json_option("Print the results as JSON.")
def apply(
    model: ModelRequest,
    plan: PlanRequest,
    out: str | None,
    timing: TimingOptions | None,
    bounds: Bounds,
    as_json: bool,
) -> None:
    """Compress a model and report params, GMACs and throughput, before and after."""
    show_result(apply_model(model, plan, out, timing, bounds), _print_apply, as_json)


def _print_apply(report: ApplyReport) -> None:
    data = report.to_json()
    plan = data["plan"]
    merged = [loc.get("merge_tokens") for loc in plan["locations"]]
    amount = (  # ToMe: tokens merged per block, its own setting
        f"merging r {merged}" if any(r is not None for r in merged) else f"keep {plan['keep']}"
    )
    console.print(
        f"[bold]{report.spec}[/] + {plan['variant']} at blocks {plan['locs']} {amount} "
        f"(policy {plan['policy']})"
    )
    if data["keep_fit"]:
        console.print(keep_fit_text(data["keep_fit"]), highlight=False)
    if plan.get("kept_multiple"):
        console.print(kept_multiple_text(plan), highlight=False)
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
    paired = report.paired
    table.add_row(
        "ratio",
        f"{data['compressed']['params'] / data['base']['params']:.3f}",
        f"{data['macs_ratio']:.3f}",
        _ratio_of_medians_text(data),
    )
    console.print(table)
    console.print(
        "tokens per block: "
        + tokens_text(
            data["base_tokens_per_block"],
            data["tokens_per_block"],
            data.get("tokens_leaving_block"),
            data.get("stage_per_block"),
        ),
        highlight=False,
    )
    if paired is not None:
        console.print(
            f"throughput: each model's median over {rounds_text(paired.pairs)}; the ratio row "
            "divides those medians",
            style="dim",
            highlight=False,
        )
        console.print(paired.summary(data["speedup_ratio_of_medians"]), highlight=False)
    if data.get("window_tokens"):
        console.print(window_text(data["window_tokens"]), highlight=False)
        whole = whole_attention_text(data["window_tokens"])
        if whole:
            console.print(whole, highlight=False)
    if data["restored"]:
        console.print(restored_text(data["restored"]), highlight=False)
    print_environment(data["environment"])
    if data["out"]:
        console.print(f"saved to {data['out']}")


def _ratio_of_medians_text(data: dict[str, Any]) -> str:
    """The compressed model's median img/s over the base's, the rates printed above it; ``-``
    when they were not timed."""
    ratio = data["speedup_ratio_of_medians"]
    return "-" if ratio is None else f"{ratio:.2f}x"


def kept_multiple_text(plan: dict[str, Any]) -> str:
    """``tokens after each location rounded to multiples of 8 (prefix tokens included): block 3
    44→47, block 9 21→23``: what ``--kept-multiple`` changed, in patch tokens after a location
    (a windowed block's: in each window)."""
    rounded = plan.get("rounded_from") or {}
    head = (
        f"tokens after each location rounded to multiples of {plan['kept_multiple']} "
        "(prefix tokens included)"
    )
    if not rounded:
        return head + ": every count was one already, or none could be rounded"
    changes = [
        f"block {block} {before}→{after}"
        for block, (before, after) in sorted(rounded.items(), key=lambda item: int(item[0]))
    ]
    return head + ": " + ", ".join(changes)


def keep_fit_text(fit: dict[str, Any]) -> str:
    """``keep 0.62: the largest (in steps of 0.01) within 0.85 of the base's GMACs (0.8480; 0.63
    costs 0.8502), 8 keeps tried``: how ``--keep-for-gmacs-ratio`` found the keep."""
    return KeepFit(**fit).text()


def window_text(window_tokens: list[dict[str, Any]]) -> str:
    """``within windows: blocks 0, 1: 64 x 49→35; blocks 2, 3: 16 x 49→35``: each windowed
    block's windows per image and the tokens its MLP (and a predictor's attention) keeps of each
    window's, blocks alike grouped; every block gives all its tokens back before its output. A
    location whose choice later blocks carry says so: ``block 2: 1 x 196→138 (blocks 3-7 carry
    block 2's choice)``, and so do the per-token branches after them that take it
    (``stages.0.blocks.0.1 takes block 0's choice``)."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    carried: dict[int, list[int]] = {}
    branches: dict[int, list[str]] = {}
    for entry in window_tokens:
        key = (entry["windows"], entry["tokens"], entry["kept"])
        groups.setdefault(key, []).append(entry["block"])
        carried[entry["block"]] = entry.get("carried", [])
        branches[entry["block"]] = entry.get("carried_branches", [])
    parts = []
    for (windows, tokens, kept), blocks in groups.items():
        # A run's carried blocks are consecutive: "blocks 3-7".
        carrying = [
            (f"blocks {by[0]}-{by[-1]} carry" if len(by) > 1 else f"block {by[0]} carries")
            + f" block {block}'s choice"
            for block in blocks
            if (by := carried[block])
        ] + [
            f"{', '.join(paths)} take{'s' if len(paths) == 1 else ''} block {block}'s choice"
            for block in blocks
            if (paths := branches[block])
        ]
        parts.append(
            f"block{'s' if len(blocks) > 1 else ''} {', '.join(map(str, blocks))}: "
            f"{windows} x {tokens}→{kept}" + (f" ({', '.join(carrying)})" if carrying else "")
        )
    return "within windows: " + "; ".join(parts)


def whole_attention_text(window_tokens: list[dict[str, Any]]) -> str:
    """``attention run on every token (the choice made on the MLP's input) at blocks 0, 1: its
    windows are padded ...``: where a predictor cannot reduce a window's attention, grouped by
    why; empty where there is none."""
    reasons: dict[str, list[int]] = {}
    for entry in window_tokens:
        if entry.get("attention_whole"):
            reasons.setdefault(entry["attention_whole"], []).append(entry["block"])
    return "; ".join(
        f"attention run on every token (the choice made on the MLP's input) at "
        f"block{'s' if len(blocks) > 1 else ''} {', '.join(map(str, blocks))}: {reason}"
        for reason, blocks in reasons.items()
    )


def restored_text(restored: list[dict[str, str]]) -> str:
    """``tokens restored (rule delta) for: the model's output (65, 64) at output``."""
    rules = sorted({point["rule"] for point in restored})
    places = "; ".join(dict.fromkeys(point["for"] for point in restored))
    return f"tokens restored (rule {', '.join(rules)}) for: {places}"


def tokens_text(
    base: list[int],
    compressed: list[int],
    leaving: list[int | None] | None = None,
    stages: list[int] | None = None,
) -> str:
    """The tokens of each block of the compressed model, ``before→after`` at each block where a
    reduction happens, before it or inside it: ``197 197 197→139 139 139→97`` (locations 2, 4).
    ``before`` is what the block before handed on, or, at the first block of a stage (``stages``;
    without them, where the base's count changes), the base's count: the tokens are restored
    between stages. ``after`` is what the block hands on (``leaving``), else, where that is
    unknown, what it takes in."""
    parts = []
    for i, (tokens, base_tokens) in enumerate(zip(compressed, base, strict=True)):
        if stages is not None:
            new_stage = i == 0 or stages[i] != stages[i - 1]
        else:
            new_stage = i == 0 or base_tokens != base[i - 1]
        handed = leaving[i - 1] if leaving is not None and i > 0 else None
        before = base_tokens if new_stage else (handed if handed is not None else compressed[i - 1])
        after = leaving[i] if leaving is not None and leaving[i] is not None else tokens
        parts.append(f"{before}→{after}" if after != before else str(after))
    return " ".join(parts)
