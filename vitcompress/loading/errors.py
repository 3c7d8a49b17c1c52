"""The errors loading raises: one line each, which the CLI prints before exiting 2."""

from __future__ import annotations

import re

from vitcompress.errors import UserError

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
SHOW_KEYS = 5  # how many names (keys, models) an error message lists before "..."


class ModelLoadError(UserError):
    """One clear line for the user; the CLI prints ``str(e)`` and exits 2."""

    def __init__(self, message: str) -> None:
        # Messages embed text from other libraries that may span lines; the CLI promises one line.
        super().__init__(" ".join(str(message).splitlines()))


class ModelInputError(ModelLoadError):
    """The model does not run on the input size it was given or says it takes."""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` -- what the user needs, without the traceback."""
    lines = [line.strip() for line in ANSI_ESCAPE.sub("", str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
