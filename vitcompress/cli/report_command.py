"""``report`` (merge result JSON into one table and a plot) and ``visualize`` (kept tokens)."""

from __future__ import annotations

import click
from rich.table import Table

from vitcompress.cli.app import EXIT_USAGE, cli, console, emit_json
from vitcompress.cli.options import load_from_options, model_options
from vitcompress.metadata import compression_info


@cli.command()
@click.argument("runs", nargs=-1, required=True, metavar="RUN.json...")
@click.option(
    "--out-md",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the table as Markdown here.",
)
@click.option(
    "--out-png",
    type=click.Path(dir_okay=False),
    default=None,
    help="Plot top-1 vs GMACs and throughput vs GMACs here (needs matplotlib).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the merged rows as JSON.")
@click.pass_context
def report(
    ctx: click.Context,
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

    try:
        rows = load_rows(runs)
        if out_md:
            with open(out_md, "w") as f:
                f.write(render_markdown(rows))
        if out_png:
            render_png(rows, out_png)
    except OSError as e:  # ReportError is one of the group's user errors already
        click.echo(f"error: {e.filename}: {e.strerror or e}", err=True)
        ctx.exit(EXIT_USAGE)
    if as_json:
        emit_json(rows_to_json(rows))
        return
    table = Table(show_edge=False)
    for i, column in enumerate(MARKDOWN_COLUMNS):
        table.add_column(column, justify="left" if i < 3 else "right")
    for row in rows:
        table.add_row(*row_cells(row))
    console.print(table)
    for path in (out_md, out_png):
        if path:
            console.print(f"wrote {path}")


@cli.command()
@model_options
@click.option(
    "--image",
    required=True,
    type=click.Path(dir_okay=False),
    help="Image to show (resized to the model's input size).",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="PNG to write.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Also print the recorded positions per location as JSON.",
)
@click.pass_context
def visualize(
    ctx: click.Context,
    model_spec,
    model_args,
    checkpoint,
    pretrained,
    input_size,
    image: str,
    out: str,
    as_json: bool,
) -> None:
    """Draw which tokens a compressed model keeps at each location, and for TPS variants which
    kept token (host) each pruned token is squeezed into."""
    from vitcompress.data import resolve_data_config
    from vitcompress.workflows.visualize import (
        draw_locations,
        load_image,
        record_locations,
    )

    try:
        loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
        # Fed as eval feeds it: the model's own normalisation and resize interpolation.
        data_config = resolve_data_config(loaded.model, loaded.input_size[0])
        picture, tensor = load_image(image, loaded.input_size, data_config)
        records, logits = record_locations(loaded.model, tensor)
        draw_locations(
            picture,
            records,
            out,
            title=f"{model_spec}: "
            f"{compression_info(loaded.model).plan.variant}, predicted class "
            f"{int(logits.argmax(-1)[0])}",
        )
    except OSError as e:  # VisualizeError and ReportError are the group's user errors already
        click.echo(f"error: {e.filename or out}: {e.strerror or e}", err=True)
        ctx.exit(EXIT_USAGE)
    if as_json:
        emit_json(
            {
                "model": model_spec,
                "image": image,
                "out": out,
                "locations": [r.to_json() for r in records],
            }
        )
        return
    for r in records:
        grid = r.grid[0] * r.grid[1]
        squeezed = sum(1 for donors in r.hosts.values() if donors)
        console.print(
            f"block {r.block} (stage {r.stage}, grid {r.grid[0]}x{r.grid[1]}): "
            f"{len(r.kept)}/{grid} kept"
            + (f", {squeezed} hosts" if r.hosts else "")
            + (", +1 fused token" if r.fused_token else "")
        )
    console.print(f"wrote {out}")
