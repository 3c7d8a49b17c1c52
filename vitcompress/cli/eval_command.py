"""``eval``: accuracy of a model, optionally against its base; of an ONNX file in onnxruntime,
optionally against a reference (argmax agreement)."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from vitcompress.cli.app import (
    cli,
    console,
    fmt_throughput,
    json_option,
    print_environment,
    show_result,
)
from vitcompress.cli.data_options import data_options, describe, task_option
from vitcompress.cli.options import (
    base_options,
    gate_options,
    model_options,
    timing_options,
    workers_option,
)
from vitcompress.loading import ModelLoadError
from vitcompress.measure.models import TimingOptions
from vitcompress.measure.onnx_eval import is_onnx_path
from vitcompress.training.evaluate import EvalProgress
from vitcompress.workflows.eval_onnx import OnnxEvalResult, eval_onnx
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
@click.option(
    "--reference",
    default=None,
    metavar="SPEC",
    help="With --model FILE.onnx: the model to compare predictions with, on the same images "
    "(the float32 ONNX file, or the compressed model directory it was exported from): its "
    "top-1 and the argmax agreement.",
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
    reference: str | None,
    timing: TimingOptions | None,
    bounds: Bounds,
    as_json: bool,
) -> None:
    """Top-1/top-5 accuracy on a dataset; with --base, against a second model.

    Each model is fed its own data config (an artifact's record, the model's data_config or
    timm pretrained_cfg); --mean/--std/--interpolation/--crop-pct override it for both.
    With --task segmentation: mean IoU and pixel accuracy (--max-acc-drop then bounds the mIoU
    points lost).

    --model FILE.onnx runs the file in onnxruntime (CPU) with the preprocessing it records, so
    the accuracy measured is that of what is deployed; --reference adds the agreement with
    another model.
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
    if is_onnx_path(model.spec):
        _refuse_with_onnx(ctx, model, task, base, bounds, timing)
        onnx_result = eval_onnx(model.spec, data, loader, reference, val_images, progress)
        show_result(onnx_result, _print_onnx_result, as_json)
        return
    if reference is not None:
        raise ModelLoadError(
            "--reference compares an ONNX --model's predictions; to compare two PyTorch "
            "models use --base"
        )
    result = eval_model(model, data, base, loader, timing, bounds, task, val_images, progress)
    show_result(result, _print_result, as_json)


def _refuse_with_onnx(
    ctx: click.Context,
    model: ModelRequest,
    task: str,
    base: BaseRequest | None,
    bounds: Bounds,
    timing: TimingOptions | None,
) -> None:
    """One line for an option an ONNX file has no use for: the file fixes the model, its input
    size and its weights, and runs on the CPU, untimed."""
    fixed = [
        flag
        for flag, used in (
            ("--model-arg", model.args),
            ("--checkpoint", model.checkpoint),
            ("--pretrained", model.pretrained),
            ("--input-size", model.input_size),
            ("--entry", model.entry != "forward"),
        )
        if used
    ]
    if fixed:
        raise ModelLoadError(
            f"--model {model.spec} is an ONNX file, which fixes the model, its input size and "
            f"weights: drop {', '.join(fixed)}"
        )
    if base is not None:
        raise ModelLoadError(
            "--base compares two PyTorch models; with an ONNX --model use --reference"
        )
    if task != "classification":
        raise ModelLoadError(f"--task {task}: an ONNX --model is evaluated as a classifier")
    if bounds:
        raise ModelLoadError("the CI gates take PyTorch models; with an ONNX --model drop them")
    if not str(ctx.params["device"]).startswith("cpu"):
        raise ModelLoadError("an ONNX --model runs in onnxruntime on the CPU: drop --device")
    if timing is not None and timing.given:
        raise ModelLoadError(
            f"an ONNX --model is scored, not timed (export --bench times it): drop "
            f"{', '.join(timing.given)}"
        )


def _print_onnx_result(result: OnnxEvalResult) -> None:
    facts = result.facts
    batch = "dynamic batch" if facts.batch is None else f"batch {facts.batch}"
    console.print(
        f"[bold]{result.spec}[/] (onnxruntime, {batch}, {facts.bytes / 1e6:.2f} MB) on "
        f"{result.data} ({result.split}, {result.accuracy['images']} images, input "
        f"{tuple(facts.input_size)})"
    )
    console.print(f"[dim]data config: {describe(result.data_config)}[/]", highlight=False)
    reference = result.reference
    if reference is not None and reference.data_config != result.data_config:
        console.print(
            f"[dim]reference data config: {describe(reference.data_config)}[/]", highlight=False
        )
    table = Table(show_edge=False)
    for column in ("", "top-1 (%)", "top-5 (%)", "agreement (%)"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row(
        result.spec, f"{result.accuracy['top1']:.2f}", f"{result.accuracy['top5']:.2f}", ""
    )
    if reference is not None:
        table.add_row(
            f"reference {reference.spec} ({reference.runtime})",
            f"{reference.accuracy['top1']:.2f}",
            f"{reference.accuracy['top5']:.2f}",
            f"{reference.agreement:.2f} ({reference.disagreements} differ)",
        )
    console.print(table)


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
