"""``variants``: the registered methods, each with its scorer, its fuse and its own settings."""

from __future__ import annotations

import click
from rich.table import Table

from vitcompress.cli.app import cli, emit_json, json_option, print_table
from vitcompress.workflows.variants import describe_variants


@cli.command("variants")
@json_option("Print the methods as JSON.")
def variants_command(as_json: bool) -> None:
    """List the methods --variant takes, and the settings --variant-arg gives each."""
    rows = describe_variants()
    if as_json:
        emit_json({"variants": rows})
        return
    table = Table(title="methods")
    for column in ("--variant", "scores by", "reduced tokens", "--variant-arg", "search"):
        table.add_column(column)
    for row in rows:
        settings = ", ".join(f"{k}={v!r}" for k, v in row["settings"].items()) or "-"
        table.add_row(
            row["name"], row["scorer"], row["fuse"], settings, "yes" if row["searchable"] else "no"
        )
    print_table(table)
    click.echo(
        "Defaults shown; a setting of None is unset: r=None means the method derives it from "
        "--keep, kept_multiple=None that counts are not rounded."
    )
