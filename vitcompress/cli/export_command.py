"""``export``: write a model's inference path as ONNX, TorchScript or an ExportedProgram."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from vitcompress.cli.data_options import data_options
from vitcompress.cli.options import (
    bench_seconds_option,
    model_options,
    output_option,
    runs_option,
    serving_compile_options,
    warmup_option,
)
from vitcompress.workflows.export import DEFAULT_OPSET, DTYPES, FORMATS
from vitcompress.workflows.export_bench import ExportTiming
from vitcompress.workflows.export_run import ExportResult, ExportSettings, export_request
from vitcompress.workflows.inputs import DataRequest, ModelRequest
from vitcompress.workflows.onnx_quantize import DEFAULT_CALIBRATION_IMAGES, QUANTIZE_MODES


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
@output_option(
    "--out",
    folder=False,
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
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPES)),
    default="float32",
    show_default=True,
    help="Weights, input and output at this dtype, checked against PyTorch at the same dtype "
    "(docs/export.md states the tolerance). A bfloat16 ONNX file, which onnxruntime cannot run "
    "on the CPU, is checked as a file (onnx.checker), not run.",
)
@click.option("--no-check", is_flag=True, help="Do not compare the written file with PyTorch.")
@click.option(
    "--bench",
    is_flag=True,
    help="ONNX of a compressed model: also export its base next to FILE (NAME.base.onnx) and time "
    "both in onnxruntime and in eager PyTorch, interleaved, at --batch-size.",
)
@click.option(
    "--quantize",
    type=click.Choice(QUANTIZE_MODES),
    default=None,
    help="ONNX: quantize the file with onnxruntime.quantization, the reducers kept in float. "
    "int8: weights int8 per channel, activations quantized at run time; int8-static: "
    "activations calibrated on --data. FILE is then the int8 file, NAME.fp32.onnx the float32 "
    "one beside it; with --bench, the base is exported and quantized alike and the four files "
    "are timed in onnxruntime.",
)
@data_options(
    "train",
    "--quantize int8-static: the split the calibration images are read from.",
    required=False,
)
@click.option(
    "--calibration-images",
    default=None,
    type=click.IntRange(min=1),
    metavar="N",
    help="--quantize int8-static: images of --data to calibrate on, evenly spread, brought to "
    f"the model by its own preprocessing (default {DEFAULT_CALIBRATION_IMAGES}).",
)
@serving_compile_options
@warmup_option()
@runs_option("--bench: timed rounds (one batch of every runner per round) at most.")
@bench_seconds_option("--bench: time budget of warm-up and timed rounds.")
@json_option("Print the result as JSON.")
def export(
    model: ModelRequest,
    fmt: str,
    out: str,
    batch_size: int,
    opset: int,
    dynamic_batch: bool,
    dtype: str,
    no_check: bool,
    bench: bool,
    quantize: str | None,
    data: DataRequest,
    calibration_images: int | None,
    serving_mode: str | None,
    warmup: int,
    runs: int,
    bench_seconds: float,
    as_json: bool,
) -> None:
    """Export the model's inference path (eval: tokens dropped, constant shapes) and check it."""
    ctx = click.get_current_context()
    timed_only = [
        f"--{name.replace('_', '-')}"
        for name in ("warmup", "runs", "bench_seconds")
        if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)
    ]
    if timed_only and not bench:
        raise click.UsageError(
            f"{', '.join(timed_only)}: only --bench times anything; add it or drop "
            f"{'them' if len(timed_only) > 1 else 'it'}."
        )
    named = _format_named_by(out)
    if named is not None and named != fmt:
        # A suffix of another format is a slip in --format or --out; the file there would be
        # replaced by one its name misdescribes (eval would then not read it).
        raise click.UsageError(
            f"--out {out} has the suffix of {named} files but --format is {fmt}: name it "
            f"{Path(out).stem}{SUFFIXES[fmt][0]}, or pass --format {named}"
        )
    batch_given = ctx.get_parameter_source("batch_size") not in (
        None,
        click.core.ParameterSource.DEFAULT,
    )
    if dynamic_batch and batch_given and not bench and serving_mode is None:
        # The graph takes any batch and is checked at its own sizes: only a timing (--bench) or
        # the serving path (--compile) runs at --batch-size.
        raise click.UsageError(
            "--batch-size: a --dynamic-batch graph takes any batch, and only --bench or "
            "--compile run one batch size; drop it or add one of them."
        )
    settings = ExportSettings(
        fmt,
        out,
        batch_size,
        opset,
        dynamic_batch,
        check=not no_check,
        dtype=dtype,
        compile=serving_mode is not None,
        compile_mode=serving_mode,
        quantize=quantize,
        calibration_images=calibration_images,
    )
    timing = ExportTiming(warmup, runs, bench_seconds) if bench else None
    result = export_request(model, settings, timing, data)
    show_result(result, lambda shown: _print_export(shown, dynamic_batch), as_json)


# The suffixes each format is written under; another format's suffix on --out is refused.
SUFFIXES = {"onnx": (".onnx",), "torchscript": (".pt", ".pth"), "exported-program": (".pt2",)}


def _format_named_by(out: str) -> str | None:
    suffix = Path(out).suffix.lower()
    return next((fmt for fmt, names in SUFFIXES.items() if suffix in names), None)


def _print_export(result: ExportResult, dynamic_batch: bool) -> None:
    written = result.export
    checked = (
        f"max |diff| {written['max_abs_diff']:.2e} <= {written['atol']:.2g}"
        if written["checked"]
        else "checked as a file (onnx.checker), not run"
        if written.get("check") == "structural"
        else "not checked"
    )
    if written["checked"] and dynamic_batch:
        checked += f" at batch sizes {', '.join(map(str, written['checked_batch_sizes']))}"
    if result.quantized is not None:
        checked = f"int8; its float32 file {checked}"
    console.print(
        f"[bold]{written['format']}[/] {written['out']}  {written.get('dtype', 'float32')} input "
        f"{tuple(written['input_shape'])} ({written['batch']} batch)  "
        f"{written['bytes'] / 1e6:.1f} MB  {checked}"
    )
    if written.get("check") == "structural":
        console.print(f"onnxruntime: {written['onnxruntime_error']}", style="dim", highlight=False)
    if "op_audit" in written:
        console.print(audit_text(written["op_audit"]), highlight=False)
    if result.quantized is not None:
        console.print(quantized_text(result.quantized, written["fp32"]), highlight=False)
    if result.serving is not None:
        console.print(result.serving.text(), highlight=False)
    if result.bench is not None and result.quantized is not None:
        _print_quantized_bench(result.bench)
    elif result.bench is not None:
        _print_bench(result.bench)


def quantized_text(quantized: dict[str, Any], fp32: dict[str, Any]) -> str:
    """What ``--quantize`` did, in two lines: ops quantized and kept float, the error against
    the float32 file, and where that file is."""
    ops = quantized["quantized_ops"]
    check = quantized["check"]
    return (
        f"{quantized['mode']} ({quantized['format']}, weights {quantized['weights']}): "
        f"{ops['quantized']} of {ops['matmul_gemm']} MatMul/Gemm quantized, "
        f"{quantized['float_nodes']['count']} nodes of the inserted modules kept float; "
        f"max |diff| to the float32 file {check['max_abs_diff_to_fp32']:.2e} "
        f"(output scale {check['fp32_output_scale']:.2g})\n"
        f"float32 file: {fp32['out']}  {fp32['bytes'] / 1e6:.1f} MB"
    )


def _print_quantized_bench(bench: dict[str, Any]) -> None:
    table = Table(show_edge=False)
    for column in ("onnxruntime", "img/s", "over float32 base [95% CI]"):
        table.add_column(column)
    speedups = bench["speedup"]["onnxruntime"]
    for name, throughput in bench["throughput"]["onnxruntime"].items():
        ratio = "1" if name == bench["reference"] else paired_text(speedups[name])
        table.add_row(_RUNNER_LABELS.get(name, name), fmt_throughput(throughput), ratio)
    console.print(table)
    console.print(
        "; ".join(
            f"{_pair_label(pair)}: {paired_text(ratio)}" for pair, ratio in bench["paired"].items()
        ),
        highlight=False,
    )
    print_environment(bench["environment"] | {"warnings": bench["warnings"]})


_RUNNER_LABELS = {
    "base": "float32 base",
    "compressed": "float32 compressed",
    "base.int8": "int8 base",
    "compressed.int8": "int8 compressed",
}


def _pair_label(pair: str) -> str:
    a, b = pair.split("/")
    return f"{_RUNNER_LABELS.get(a, a)} over {_RUNNER_LABELS.get(b, b)}"


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


def audit_text(audit: dict[str, Any]) -> str:
    """``ops: 31 types, 402 nodes; portable (TensorRT ...)``, or what is not portable."""
    head = f"ops: {len(audit['ops'])} types, {sum(audit['ops'].values())} nodes; "
    if audit["portable"]:
        return head + f"portable ({audit['reference']})"
    reasons = "; ".join(
        f"{item['op']} x{item['count']}"
        + "".join(f" {key}={value}" for key, value in item.get("attribute", {}).items())
        for item in audit["not_portable"]
    )
    return head + f"NOT portable to {audit['reference']}: {reasons}"


def paired_text(ratio: dict[str, Any]) -> str:
    """``1.31x [1.25, 1.38]`` from a ``PairedRatio.to_json()``."""
    interval = ratio["ci95"]
    if interval is None:
        return f"{ratio['median']:.2f}x"
    return f"{ratio['median']:.2f}x [{interval[0]:.2f}, {interval[1]:.2f}]"
