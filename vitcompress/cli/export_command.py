"""``export``: write a model's inference path as ONNX, TorchScript or an ExportedProgram."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from vitcompress.cli.app import cli, console, emit_json, fmt_throughput, print_environment
from vitcompress.cli.options import load_from_options, model_options
from vitcompress.loading import LoadedModel, ModelLoadError
from vitcompress.workflows.export import DEFAULT_OPSET, FORMATS
from vitcompress.workflows.measure_models import DEFAULT_BENCH_SECONDS, base_for_timing
from vitcompress.workflows.status import step, warn


@cli.command()
@model_options
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    required=True,
    help="onnx (checked with onnxruntime), torchscript (torch.jit.trace) or "
    "exported-program (torch.export, .pt2).",
)
@click.option(
    "--out",
    type=click.Path(),
    required=True,
    metavar="FILE",
    help="File to write; missing folders are created.",
)
@click.option(
    "--batch-size",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="The exported graph's batch size (fixed: every shape is a constant, unless "
    "--dynamic-batch); with --bench, the batch timed.",
)
@click.option(
    "--opset",
    default=DEFAULT_OPSET,
    show_default=True,
    type=click.IntRange(min=11),
    help="ONNX opset.",
)
@click.option(
    "--dynamic-batch",
    is_flag=True,
    help="Make the batch dimension symbolic (ONNX dynamic_axes, a torch.export Dim); token "
    "counts stay constants. Checked at batch sizes 1 and 3.",
)
@click.option("--no-check", is_flag=True, help="Do not compare the written file with PyTorch.")
@click.option(
    "--bench",
    is_flag=True,
    help="ONNX of a compressed model: also export its base next to FILE (NAME.base.onnx) and time "
    "both in onnxruntime and in eager PyTorch, interleaved, at --batch-size.",
)
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--runs",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="--bench: timed rounds (one batch of every runner per round) at most.",
)
@click.option(
    "--bench-seconds",
    default=DEFAULT_BENCH_SECONDS,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    metavar="S",
    help="--bench: time budget of warm-up and timed rounds.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def export(
    ctx: click.Context,
    model_spec,
    model_args,
    checkpoint,
    pretrained,
    input_size,
    fmt,
    out,
    batch_size,
    opset,
    dynamic_batch,
    no_check,
    bench,
    warmup,
    runs,
    bench_seconds,
    as_json,
) -> None:
    """Export the model's inference path (eval: tokens dropped, constant shapes) and check it."""
    from vitcompress.workflows.export import ExportError, export_model

    if bench and fmt != "onnx":
        raise ExportError("--bench times ONNX files in onnxruntime: use --format onnx")
    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    base = _base_to_bench(loaded) if bench else None  # refused before minutes of exporting
    # ExportError is one of the group's user errors: one line, exit code 2.
    result = export_model(
        loaded.model,
        loaded.input_size,
        fmt,
        out,
        batch_size=batch_size,
        opset=opset,
        check=not no_check,
        dynamic_batch=dynamic_batch,
    )
    result["model"] = model_spec
    if base is not None:
        result["bench"] = _bench(
            loaded,
            base,
            Path(out),
            batch_size,
            opset,
            dynamic_batch,
            warmup,
            runs,
            bench_seconds,
            check=not no_check,
        )
    if as_json:
        emit_json(result)
        return
    checked = (
        f"max |diff| {result['max_abs_diff']:.2e} <= {result['atol']:g}"
        if result["checked"]
        else "not checked"
    )
    if result["checked"] and dynamic_batch:
        checked += f" at batch sizes {', '.join(map(str, result['checked_batch_sizes']))}"
    console.print(
        f"[bold]{fmt}[/] {result['out']}  input {tuple(result['input_shape'])} "
        f"({result['batch']} batch)  {result['bytes'] / 1e6:.1f} MB  {checked}"
    )
    if "bench" in result:
        _print_bench(result["bench"])


def _base_to_bench(loaded: LoadedModel) -> LoadedModel:
    base = base_for_timing(loaded)
    if base is None:
        raise ModelLoadError(
            "--bench times a compressed model against its base: --model must be a compressed "
            "model directory (vitcompress apply --out DIR)"
        )
    return base


def _bench(
    loaded: LoadedModel,
    base: LoadedModel,
    out: Path,
    batch_size: int,
    opset: int,
    dynamic_batch: bool,
    warmup: int,
    runs: int,
    seconds: float,
    check: bool = True,
) -> dict[str, Any]:
    from vitcompress.workflows.export import export_model
    from vitcompress.workflows.export_bench import bench_exported
    from vitcompress.workflows.measure_models import show_round

    base_out = out.with_name(f"{out.stem}.base{out.suffix or '.onnx'}")
    with step(f"exporting the base to {base_out}"):
        base_export = export_model(
            base.model,
            loaded.input_size,
            "onnx",
            base_out,
            batch_size=batch_size,
            opset=opset,
            check=check,
            dynamic_batch=dynamic_batch,
        )
    with step(f"timing base and compressed in pytorch and onnxruntime (batch {batch_size})"):
        timed = bench_exported(
            {"base": base.model, "compressed": loaded.model},
            {"base": base_out, "compressed": out},
            loaded.input_size,
            reference="base",
            batch_size=batch_size,
            warmup=warmup,
            runs=runs,
            seconds=seconds,
            on_round=show_round,
        )
    for text in timed["warnings"]:
        warn(text)
    return timed | {"base_export": base_export}


def _print_bench(bench: dict[str, Any]) -> None:
    table = Table(show_edge=False)
    for column in ("runtime", "base (img/s)", "compressed (img/s)", "speed-up [95% CI]"):
        table.add_column(column)
    for runtime, throughput in bench["throughput"].items():
        table.add_row(
            runtime,
            fmt_throughput(throughput["base"]),
            fmt_throughput(throughput["compressed"]),
            paired_text(bench["speedup"][runtime]["compressed"]),
        )
    console.print(table)
    console.print(
        "onnxruntime over pytorch: "
        + ", ".join(
            f"{name} {paired_text(ratio)}"
            for name, ratio in bench["onnxruntime_vs_pytorch"].items()
        ),
        highlight=False,
    )
    print_environment(bench["environment"] | {"warnings": bench["warnings"]})


def paired_text(ratio: dict[str, Any]) -> str:
    """``1.31x [1.25, 1.38]`` from a ``PairedRatio.to_json()``."""
    interval = ratio["ci95"]
    if interval is None:
        return f"{ratio['median']:.2f}x"
    return f"{ratio['median']:.2f}x [{interval[0]:.2f}, {interval[1]:.2f}]"
