"""The ``vitcompress`` command group: error handling shared by every command, and output."""

from __future__ import annotations

import json
import traceback
from typing import Any

import click
from rich.console import Console

from vitcompress import __version__
from vitcompress.data import DataError
from vitcompress.graph.analyse import MappingError
from vitcompress.graph.capture import CaptureError
from vitcompress.graph.rewrite import RewriteError
from vitcompress.loading import ModelLoadError
from vitcompress.plan import PlanError

# Errors that are the user's input, not a bug: one line on stderr, exit code 2.
USER_ERRORS = (ModelLoadError, PlanError, MappingError, CaptureError, RewriteError, DataError)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

console = Console()
err_console = Console(stderr=True)


class VitcompressGroup(click.Group):
    """Turns known errors into one clear line; ``--debug`` shows the traceback instead."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            self._fail(ctx, e, EXIT_USAGE)
        except KeyboardInterrupt as e:
            self._fail(ctx, e, EXIT_INTERRUPTED, "interrupted")

    @staticmethod
    def _fail(ctx: click.Context, error: BaseException, code: int, text: str | None = None):
        if ctx.obj and ctx.obj.get("debug"):
            traceback.print_exception(error)
        message = text or str(error).splitlines()[0] if str(error) else type(error).__name__
        click.echo(f"error: {message}", err=True)
        ctx.exit(code)


@click.group(cls=VitcompressGroup)
@click.version_option(__version__, prog_name="vitcompress")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Compress Vision Transformers by joint Token Pruning & Squeezing (TPS)."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def emit_json(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def fmt_throughput(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_environment(environment: dict[str, Any]) -> None:
    if environment:
        console.print(
            f"[dim]{environment.get('device_name', environment.get('device'))}, "
            f"{environment.get('dtype')}, {environment.get('threads')} threads, batch "
            f"{environment.get('batch_size')}, torch {environment.get('torch')}[/]"
        )

