"""What a long step is doing now, told to whoever displays it.

Workflows mark their slow steps (``with step("counting MACs of base"): ...``), report progress
within one (``detail("round 3/10")``) and warnings about their results (``warn(...)``). The CLI
installs a reporter for the duration of a command (:func:`reporting`) that draws them on stderr;
without one, steps and details go nowhere and warnings become Python warnings. A context variable
carries the reporter, so the workflows in between (apply, eval) need not pass it along.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol

__all__ = ["StatusReporter", "detail", "reporting", "step", "warn"]


class StatusReporter(Protocol):
    def begin(self, text: str) -> None:
        """A step starts (steps nest; the innermost is the one shown)."""

    def end(self) -> None:
        """The innermost step is over."""

    def update(self, text: str) -> None:
        """Progress within the innermost step."""

    def warn(self, text: str) -> None:
        """Something about the results that the user must know."""


_reporter: ContextVar[StatusReporter | None] = ContextVar("vitcompress_status", default=None)


@contextlib.contextmanager
def reporting(reporter: StatusReporter) -> Iterator[StatusReporter]:
    """Send the steps, details and warnings of the enclosed code to ``reporter``."""
    token = _reporter.set(reporter)
    try:
        yield reporter
    finally:
        _reporter.reset(token)


@contextlib.contextmanager
def step(text: str) -> Iterator[None]:
    reporter = _reporter.get()
    if reporter is None:
        yield
        return
    reporter.begin(text)
    try:
        yield
    finally:
        reporter.end()


def detail(text: str) -> None:
    reporter = _reporter.get()
    if reporter is not None:
        reporter.update(text)


def warn(text: str) -> None:
    reporter = _reporter.get()
    if reporter is None:
        warnings.warn(text, stacklevel=2)
    else:
        reporter.warn(text)


@contextlib.contextmanager
def quiet_logger(name: str | None = None) -> Iterator[None]:
    """Only errors from the logger ``name`` (the root logger when None) while inside: for a
    library's lines that are true and beside the point in a command's output."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
