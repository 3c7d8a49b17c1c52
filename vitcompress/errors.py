"""The one base class of the errors that are the user's input, not a bug.

Every layer raises its own kind (``ModelLoadError``, ``PlanError``, ``DataError``, ...), each a
subclass of :class:`UserError`; the command line catches this one class, prints the message as one
line and exits with the error's ``exit_code``. This module imports nothing of the project, so any
layer may build on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["EXIT_USAGE", "UserError"]

EXIT_USAGE = 2


class UserError(Exception):
    """What the user asked for cannot be done as asked; the message is one line for them.

    ``exit_code`` is the command's exit status: 2 (bad input) unless a subclass says otherwise.
    """

    exit_code: int = EXIT_USAGE


def one_line(error: BaseException) -> str:
    """``Type: first line of the message``: how a caught exception is quoted in a result or a
    refusal, where a traceback would be noise."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def given_options(options: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the ``(name, value)`` pairs whose value is given (truthy), in their order:
    the options a refusal names when they do not apply."""
    return [name for name, value in options if value]
