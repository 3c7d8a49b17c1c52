"""``export``: write a model's inference path as ONNX, TorchScript or an ExportedProgram."""

from __future__ import annotations

import click

from vitcompress.cli.app import cli, console, emit_json
from vitcompress.cli.options import load_from_options, model_options
from vitcompress.workflows.export import DEFAULT_OPSET, FORMATS


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
    help="The exported graph's batch size (fixed: every shape is a constant).",
)
@click.option(
    "--opset",
    default=DEFAULT_OPSET,
    show_default=True,
    type=click.IntRange(min=11),
    help="ONNX opset.",
)
@click.option("--no-check", is_flag=True, help="Do not compare the written file with PyTorch.")
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
    no_check,
    as_json,
) -> None:
    """Export the model's inference path (eval: tokens dropped, constant shapes) and check it."""
    from vitcompress.workflows.export import export_model

    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    # ExportError is one of the group's user errors: one line, exit code 2.
    result = export_model(
        loaded.model,
        loaded.input_size,
        fmt,
        out,
        batch_size=batch_size,
        opset=opset,
        check=not no_check,
    )
    result["model"] = model_spec
    if as_json:
        emit_json(result)
        return
    checked = (
        f"max |diff| {result['max_abs_diff']:.2e} <= {result['atol']:g}"
        if result["checked"]
        else "not checked"
    )
    console.print(
        f"[bold]{fmt}[/] {result['out']}  input {tuple(result['input_shape'])} "
        f"(fixed batch)  {result['bytes'] / 1e6:.1f} MB  {checked}"
    )
