"""Showing the workflows' steps (:mod:`vitcompress.status`) on stderr.

stdout carries only the command's result (``--json`` stays parseable), so steps, progress and
warnings go to stderr: on a terminal as a rich spinner line that disappears when the step ends;
with ``--progress plain`` as one plain line per step and round (for CI logs and ``| tee``).
Warnings are printed in every mode.
"""

from __future__ import annotations

import time

import click
from rich.console import Console
from rich.markup import escape
from rich.status import Status

PROGRESS_MODES = ("auto", "plain", "none")


class ConsoleStatus:
    """A :class:`~vitcompress.status.StatusReporter` drawing on ``console`` (stderr).

    ``mode``: ``auto`` (a spinner on a terminal, nothing otherwise), ``plain`` (lines), or
    ``none`` (warnings only).
    """

    def __init__(self, console: Console, mode: str = "auto") -> None:
        if mode not in PROGRESS_MODES:
            raise ValueError(f"unknown progress mode {mode!r}")
        self.console = console
        self.mode = mode if mode != "auto" else ("spinner" if console.is_terminal else "none")
        self.steps: list[tuple[str, float]] = []  # (text, start time), innermost last
        self.spinner: Status | None = None

    def begin(self, text: str) -> None:
        self.steps.append((text, time.monotonic()))
        if self.mode == "plain":
            click.echo(f"{text} ...", err=True)
        self._show(text)

    def end(self) -> None:
        if not self.steps:
            return
        self.steps.pop()
        if self.steps:
            self._show(self.steps[-1][0])
        else:
            self.close()

    def update(self, text: str) -> None:
        if not self.steps:
            return
        step, started = self.steps[-1]
        if self.mode == "plain":
            click.echo(f"  {text}", err=True)
        else:
            self._show(f"{step}: {text} ({time.monotonic() - started:.0f} s)")

    def warn(self, text: str) -> None:
        if self.spinner is not None:
            self.spinner.console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False)
        else:
            click.echo(f"warning: {text}", err=True)

    def close(self) -> None:
        if self.spinner is not None:
            self.spinner.stop()
            self.spinner = None

    def _show(self, text: str) -> None:
        """The spinner's text (the other modes show a step once, when it begins)."""
        if self.mode == "spinner":
            if self.spinner is None:
                self.spinner = Status(escape(text), console=self.console)
                self.spinner.start()
            else:
                self.spinner.update(escape(text))
