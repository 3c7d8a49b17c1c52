"""``report`` (merge result JSON into one table and a plot) and ``visualize`` (kept tokens)."""

from __future__ import annotations

import math
from pathlib import Path

import click
from rich.table import Table

from vitcompress.cli.app import cli, console, emit_json, json_option, raise_save_error
from vitcompress.cli.options import model_options, output_option
from vitcompress.cli.outputs import PLOT_SUFFIXES
from vitcompress.workflows.inputs import ModelRequest


@cli.command()
@click.argument("runs", nargs=-1, required=True, metavar="RUN.json...")
@output_option("--out-md", folder=False, help="Write the table as Markdown here.")
@output_option(
    "--out-png",
    folder=False,
    help="Plot top-1 vs GMACs and throughput vs GMACs here (needs matplotlib).",
    suffixes=PLOT_SUFFIXES,
)
@json_option("Print the merged rows as JSON.")
def report(
    runs: tuple[str, ...],
    out_md: str | None,
    out_png: str | None,
    as_json: bool,
) -> None:
    """Merge the JSON of apply, bench, eval and finetune runs into one comparison."""
    from vitcompress.workflows.report import (
        MARKDOWN_COLUMNS,
        load_rows,
        render_markdown,
        render_png,
        row_cells,
        rows_to_json,
    )

    rows = load_rows(runs)  # ReportError is one of the group's user errors already
    if as_json:
        emit_json(rows_to_json(rows))
    else:
        table = Table(show_edge=False)
        for i, column in enumerate(MARKDOWN_COLUMNS):
            table.add_column(column, justify="left" if i < 3 else "right")
        for row in rows:
            table.add_row(*row_cells(row))
        console.print(table)
    try:  # after the table: a file that cannot be written does not take the results with it
        if out_md:
            Path(out_md).parent.mkdir(parents=True, exist_ok=True)  # as the PNG's does
            with open(out_md, "w") as f:
                f.write(render_markdown(rows))
        if out_png:
            render_png(rows, out_png)
    except OSError as e:
        raise_save_error(f"{e.filename}: {e.strerror or e}")
    for path in (out_md, out_png):
        if path and not as_json:
            console.print(f"wrote {path}")


@cli.command()
@model_options(accepts=("artifact",))
@click.option(
    "--image",
    required=True,
    type=click.Path(dir_okay=False),
    help="Image to show (resized to the model's input size).",
)
@output_option("--out", folder=False, required=True, help="PNG to write.", suffixes=PLOT_SUFFIXES)
@json_option("Also print the recorded positions per location as JSON.")
def visualize(model: ModelRequest, image: str, out: str, as_json: bool) -> None:
    """Draw which tokens a compressed model keeps at each location, and for TPS variants which
    kept token (host) each pruned token is squeezed into."""
    from vitcompress.workflows.visualize_run import visualize_model

    try:
        result = visualize_model(model, image, out)
    except OSError as e:  # VisualizeError and ReportError are the group's user errors already
        raise_save_error(f"{e.filename or out}: {e.strerror or e}")
    if as_json:
        emit_json(result.to_json())
        return
    for r in result.records:
        grid = math.prod(r.grid)
        squeezed = sum(1 for donors in r.hosts.values() if donors)
        console.print(
            f"block {r.block} (stage {r.stage}, grid {'x'.join(map(str, r.grid))}): "
            f"{len(r.kept)}/{grid} kept"
            + (f", {squeezed} hosts" if r.hosts else "")
            + (", +1 fused token" if r.fused_token else "")
        )
    console.print(f"wrote {out}")
