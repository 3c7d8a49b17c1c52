"""The ``vitcompress`` command group: error handling shared by every command, and output."""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import click
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from vitcompress import __version__
from vitcompress.cli.outputs import check_output_suffixes, check_outputs_are_not_inputs
from vitcompress.cli.plan_options import plan_error_line
from vitcompress.cli.status import PROGRESS_MODES, ConsoleStatus
from vitcompress.compilation.plan import PlanError
from vitcompress.errors import EXIT_USAGE as EXIT_USAGE  # re-exported for the commands
from vitcompress.errors import UserError
from vitcompress.measure.throughput import ThreadChoice
from vitcompress.status import reporting
from vitcompress.workflows.gates import GateResult, failed

# Errors that are the user's input, not a bug: one line on stderr, exit code 2 (the error's own
# exit_code). Every layer's own kind subclasses it (vitcompress/errors.py).
USER_ERRORS = (UserError,)
EXIT_BUG = 1
EXIT_GATE = 3
EXIT_INTERRUPTED = 130
# click's own control flow (ctx.exit, usage errors, abort) passes through the handlers below.
_CLICK_FLOW = (click.exceptions.Exit, click.ClickException, click.exceptions.Abort)

console = Console()
err_console = Console(stderr=True)


class OneLineUsageError(click.UsageError):
    """A usage error shown as the one ``error:`` line every bad input gets (click's own shows a
    usage block, a hint and the message on four lines); exit code 2 as click's."""

    def __init__(self, error: click.UsageError, command_path: str) -> None:
        super().__init__(error.format_message(), error.ctx)
        self.exit_code = error.exit_code
        self.command_path = command_path

    def show(self, file: Any = None) -> None:
        message = " ".join(line.strip() for line in self.format_message().splitlines())
        hint = f"Try '{self.command_path} --help'."
        click.echo(f"error: {message} {hint}", file=file, err=file is None)


# Usage errors not made one line: already one, or a bare command, which shows its help (click 8.2
# and later raise NoArgsIsHelpError for it; 8.1 prints the help itself).
_SHOWN_AS_CLICK_DOES: tuple[type[click.UsageError], ...] = (
    OneLineUsageError,
    *(
        (click.exceptions.NoArgsIsHelpError,)
        if hasattr(click.exceptions, "NoArgsIsHelpError")
        else ()
    ),
)


def _one_line(error: click.UsageError, ctx: click.Context | None = None) -> OneLineUsageError:
    """``error`` as one line, its help hint naming the command it came from: the error's own
    context, else the command the group was invoking (an option that failed to parse has none)."""
    if error.ctx is not None:
        path = error.ctx.command_path
    elif ctx is not None and ctx.invoked_subcommand:
        path = f"{ctx.command_path} {ctx.invoked_subcommand}"
    else:
        path = ctx.command_path if ctx is not None else "vitcompress"
    return OneLineUsageError(error, path)


class VitcompressCommand(click.Command):
    """A command whose output files are checked, once every option is read, not to be files it
    reads (``visualize --image x.png --out x.png`` would replace the image)."""

    def invoke(self, ctx: click.Context) -> Any:
        check_outputs_are_not_inputs(ctx)
        check_output_suffixes(ctx)
        return super().invoke(ctx)


def _interrupted() -> click.exceptions.Exit:
    """Ctrl-C outside a command's work (reading the options, closing): the one line a command's
    own interruption gets, and its exit code (click's own handler says "Aborted!", exit 1)."""
    click.echo("error: interrupted", err=True)
    return click.exceptions.Exit(EXIT_INTERRUPTED)


class VitcompressContext(click.Context):
    """The group's context: Ctrl-C while it closes (the progress spinner stopping) is one line."""

    def close(self) -> None:
        try:
            super().close()
        except KeyboardInterrupt:
            raise _interrupted() from None


class VitcompressGroup(click.Group):
    """Turns known errors into one clear line; ``--debug`` shows the traceback instead. Usage
    errors (an unknown choice or option, a missing value) are one line too, for the group's own
    options and every command's. Ctrl-C is one line and exit code 130, whenever it comes."""

    command_class = VitcompressCommand
    context_class = VitcompressContext

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except _SHOWN_AS_CLICK_DOES:
            raise
        except click.UsageError as e:
            raise _one_line(e, parent) from e
        except KeyboardInterrupt:
            raise _interrupted() from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _SHOWN_AS_CLICK_DOES:
            raise
        except click.UsageError as e:  # a command's options, or a command that does not exist
            raise _one_line(e, ctx) from e
        except _CLICK_FLOW:
            raise
        except UserError as e:
            # A PlanError names make_plan's parameter; the user typed an option.
            text = plan_error_line(e) if isinstance(e, PlanError) else None
            self._fail(ctx, e, e.exit_code, text)
        except KeyboardInterrupt as e:  # finetune's says where its last step was saved
            self._fail(ctx, e, EXIT_INTERRUPTED, str(e) or "interrupted")
        except (MemoryError, RuntimeError) as e:
            out_of_memory = _out_of_memory_line(e)
            if out_of_memory is not None:  # the user's batch or input size, not a bug
                self._fail(ctx, e, EXIT_USAGE, out_of_memory)
            else:
                self._fail(ctx, e, EXIT_BUG, _bug_line(e))
        except Exception as e:  # noqa: BLE001 - a bug still gets one line, not a traceback
            self._fail(ctx, e, EXIT_BUG, _bug_line(e))

    @staticmethod
    def _fail(ctx: click.Context, error: BaseException, code: int, text: str | None = None):
        if ctx.obj and ctx.obj.get("debug"):
            traceback.print_exception(error)
        message = text or _first_line(error) or type(error).__name__
        click.echo(f"error: {message}", err=True)
        ctx.exit(code)


def _bug_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {_first_line(error)} (rerun with --debug for the traceback)"


# How torch says an allocation failed: on the CPU ("DefaultCPUAllocator: can't allocate memory:
# you tried to allocate 4915 bytes"), on a GPU ("CUDA out of memory. Tried to allocate 2.00 GiB").
_CPU_ALLOCATION = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
_GPU_ALLOCATION = re.compile(r"out of memory\. Tried to allocate ([\d.]+ [KMGTP]?i?B)")


def _out_of_memory_line(error: BaseException) -> str | None:
    """The one line for an allocation the machine could not make (a batch or an input size too
    large for it: the user's numbers, not a bug); None for any other error."""
    text = str(error)
    if (found := _CPU_ALLOCATION.search(text)) is not None:
        size = _bytes_text(int(found.group(1)))
    elif (found := _GPU_ALLOCATION.search(text)) is not None:
        size = found.group(1)
    elif isinstance(error, MemoryError):
        size = None
    else:
        return None
    tried = f": the work tried to allocate {size} at once" if size else ""
    return f"out of memory{tried}; lower --batch-size or the input size"


def _bytes_text(count: int) -> str:
    value, unit = float(count), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024:
            break
        value, unit = value / 1024, name
    return f"{value:.1f} {unit}" if unit != "bytes" else f"{count} bytes"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[1].startswith("Original Traceback"):
        # Re-raised from a DataLoader worker: "Caught X in DataLoader worker process 0.", the
        # worker's traceback, then "module.X: message"; the message is what the user needs.
        return lines[-1].split(": ", 1)[-1]
    return lines[0] if lines else ""


@click.group(cls=VitcompressGroup)
@click.version_option(__version__, prog_name="vitcompress")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option(
    "--progress",
    type=click.Choice(PROGRESS_MODES),
    default="auto",
    show_default=True,
    help="Steps of long work on stderr: auto (a spinner on a terminal, nothing "
    "otherwise), plain (one line per step, for CI logs), none. Warnings always "
    "show.",
)
@click.pass_context
def cli(ctx: click.Context, debug: bool, progress: str) -> None:
    """Compress Vision Transformers by joint Token Pruning & Squeezing (TPS)."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    # Until the command ends: its steps and warnings go to stderr, never into --json's stdout.
    status = ConsoleStatus(err_console, progress)
    ctx.call_on_close(status.close)
    ctx.with_resource(reporting(status))


def emit_json(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def json_option(help_text: str) -> Callable[[Callable], Callable]:
    """``--json``: the command's result as JSON on stdout (passed as ``as_json``)."""
    return click.option("--json", "as_json", is_flag=True, help=help_text)


class SaveError(UserError):
    """An output that could not be written after the work was done (its results were shown)."""


def raise_save_error(message: str | None) -> None:
    """After the results were shown: a save that failed ends the command with its one line."""
    if message:
        raise SaveError(message)


class CommandResult(Protocol):
    """What a workflow hands its command: its JSON. It may also carry ``notes`` (lines for
    stderr), ``save_error`` (an output that could not be written) and ``gates``."""

    def to_json(self) -> dict[str, Any]: ...


def show_result(result: CommandResult, print_result: Callable[[Any], None], as_json: bool) -> None:
    """A workflow's result as its command's output, in one order for every command: the result
    (``--json``, or ``print_result``), its notes on stderr, the one line of a save that failed
    (exit 2: the results were shown first), its gates (exit 3 on a missed bound)."""
    if as_json:
        emit_json(result.to_json())
    else:
        print_result(result)
    for note in getattr(result, "notes", ()):
        click.echo(note, err=True)
    raise_save_error(getattr(result, "save_error", None))
    finish_gates(getattr(result, "gates", []), as_json)


def print_table(table: Table) -> None:
    """On a terminal long cells fold; off one (a file, a pipe, CI) the table is as wide as it
    needs, so that nothing is cut to "..." or folded."""
    if console.is_terminal:
        console.print(table)
        return
    unbounded = console.options.update_width(1_000_000)  # measure, do not clamp to COLUMNS
    width = Measurement.get(console, unbounded, table).maximum
    # console.print never draws wider than the console: a console as wide as the table.
    wide = Console(
        file=console.file, width=max(width, console.width), color_system=console.color_system
    )
    wide.print(table)


def fmt_throughput(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_environment(environment: dict[str, Any]) -> None:
    if environment:
        # The threads timing chose (fewer than torch's under load, or 1 after a failed starvation
        # check) are part of what the numbers mean, so the line says why.
        choice = environment.get("thread_choice")
        threads = (
            ThreadChoice.from_json(choice).text()
            if choice
            else f"{environment.get('threads')} threads"
        )
        console.print(
            f"[dim]{environment.get('device_name', environment.get('device'))}, "
            f"{environment.get('dtype')}, {threads}, batch "
            f"{environment.get('batch_size')}{timing_mode(environment)}, "
            f"torch {environment.get('torch')}[/]"
        )


def timing_mode(environment: dict[str, Any]) -> str:
    """How the models were run while timed, where not eagerly: ``, CUDA graphs`` or
    ``, torch.compile (reduce-overhead)``; empty for eager."""
    if environment.get("cuda_graphs"):
        return ", CUDA graphs"
    if environment.get("compile"):
        mode = (environment.get("compile_options") or {}).get("mode")
        return ", torch.compile" + (f" ({mode})" if mode else "")
    return ""


def finish_gates(results: list[GateResult], as_json: bool) -> None:
    """After the report: list the gates (table mode), then exit 3 with one line per missed bound."""
    if not as_json:
        for result in results:
            state = "[green]passed[/]" if result.passed else "[red]FAILED[/]"
            console.print(f"gate {state}: {result.message()}", highlight=False)
    missed = failed(results)
    for result in missed:
        click.echo(f"gate failed: {result.message()}", err=True)
    if missed:
        click.get_current_context().exit(EXIT_GATE)
