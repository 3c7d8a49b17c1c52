"""``eval``: accuracy of a model, optionally against its base."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from vitcompress.cli.app import (
    cli,
    console,
    emit_json,
    finish_gates,
    fmt_throughput,
    json_option,
    print_environment,
)
from vitcompress.cli.data_options import data_options, describe, task_option
from vitcompress.cli.options import (
    base_options,
    gate_options,
    model_options,
    timing_options,
    workers_option,
)
from vitcompress.measure.models import TimingOptions
from vitcompress.training.evaluate import EvalProgress
from vitcompress.workflows.eval_run import EvalResult, eval_model
from vitcompress.workflows.gates import Bounds
from vitcompress.workflows.inputs import BaseRequest, DataRequest, ModelRequest


@cli.command(name="eval")
@model_options
@data_options("val", "Split to evaluate (train is read without augmentation).")
@task_option
@base_options
@workers_option
@click.option(
    "--val-images",
    default=None,
    type=click.IntRange(min=1),
    metavar="N",
    help="Evaluate N images spread evenly over the split (default: all).",
)
@timing_options
@gate_options
@json_option("Print the results as JSON.")
@click.pass_context
def eval_command(
    ctx: click.Context,
    model: ModelRequest,
    data: DataRequest,
    task: str,
    base: BaseRequest | None,
    workers: int,
    val_images: int | None,
    timing: TimingOptions | None,
    bounds: Bounds,
    as_json: bool,
) -> None:
    """Top-1/top-5 accuracy on a dataset; with --base, against a second model.

    Each model is fed its own data config (an artifact's record, the model's data_config or
    timm pretrained_cfg); --mean/--std/--interpolation/--crop-pct override it for both.
    With --task segmentation: mean IoU and pixel accuracy (--max-acc-drop then bounds the mIoU
    points lost).
    """
    # --batch-size and --device belong to timing_options, which folds them into `timing` (None
    # with --no-throughput); read them from the parsed parameters so evaluation always has them.
    loader = {
        "batch_size": ctx.params["batch_size"],
        "device": ctx.params["device"],
        "num_workers": workers,
    }
    # A bar per evaluated model where someone watches a terminal.
    show_bar = not as_json and sys.stdout.isatty() and sys.stderr.isatty()
    progress = _bar if show_bar else _no_bar
    result = eval_model(model, data, base, loader, timing, bounds, task, val_images, progress)
    if as_json:
        emit_json(result.to_json())
    else:
        _print_result(result)
    # After the report (a failed run has one error line only), before any gate failure.
    for note in result.notes:
        click.echo(note, err=True)
    finish_gates(result.gates, as_json)


def _bar(description: str) -> EvalProgress:
    from vitcompress.cli.progress import RichEvalProgress

    return RichEvalProgress(f"evaluating {description}")


def _no_bar(description: str) -> EvalProgress:
    return EvalProgress()


_HEADERS = {
    "top1": "top-1 (%)",
    "top5": "top-5 (%)",
    "miou": "mIoU (%)",
    "pixel_acc": "pixel acc (%)",
}


def _print_result(result: EvalResult) -> None:
    console.print(
        f"[bold]{result.spec}[/] on {result.data} ({result.split}, "
        f"{result.accuracy['images']} images, input {tuple(result.input_size)})"
    )
    console.print(f"[dim]data config: {describe(result.data_config)}[/]", highlight=False)
    base = result.base
    if base is not None and base.data_config != result.data_config:
        console.print(f"[dim]base data config: {describe(base.data_config)}[/]", highlight=False)
    table = Table(show_edge=False)
    first, second = result.metrics
    headers = [_HEADERS[first], _HEADERS[second]]
    if base is None:
        for column in headers:
            table.add_column(column, justify="right")
        table.add_row(f"{result.accuracy[first]:.2f}", f"{result.accuracy[second]:.2f}")
        console.print(table)
        return
    data = result.to_json()
    for column in ("", *headers, "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column, justify="left" if not column else "right")
    for key, label in (("base", f"base {base.spec}"), ("compressed", result.spec)):
        row = data[key]
        table.add_row(
            label,
            f"{row[first]:.2f}",
            f"{row[second]:.2f}",
            f"{row['params'] / 1e6:.2f}",
            f"{row['gmacs']:.3f}",
            fmt_throughput(row["throughput"]),
        )
    table.add_row(
        "delta", f"{data[f'delta_{first}']:+.2f}", f"{data[f'delta_{second}']:+.2f}", "", "", ""
    )
    console.print(table)
    print_environment(base.environment)
