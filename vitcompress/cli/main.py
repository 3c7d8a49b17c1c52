"""``vitcompress`` command line: the group and its commands, one module per kind of work.

Ctrl-C is one line (``error: interrupted``) and exit code 130 whenever it comes. This module
imports nothing heavy, nor does the package above it (``vitcompress/__init__.py`` imports on
first use), so :func:`main` imports the commands (torch, timm: seconds) inside its own guard;
while a command runs, the group's handler answers (``app.VitcompressGroup``); once it has ended,
a Ctrl-C during the interpreter's shutdown (its ``atexit`` callbacks) ends the process at once.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from vitcompress.cli.app import EXIT_INTERRUPTED, EXIT_USAGE, USER_ERRORS, cli

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "USER_ERRORS", "cli", "main"]

# Importing a module registers its commands with the group.
_COMMAND_MODULES = (
    "eval_command",
    "export_command",
    "finetune_command",
    "model_commands",
    "report_command",
    "search_command",
    "variants_command",
)
_FROM_APP = ("EXIT_INTERRUPTED", "EXIT_USAGE", "USER_ERRORS", "cli")
_INTERRUPTED_CODE = 130  # app.EXIT_INTERRUPTED, needed before app can be imported


def _load_commands() -> Any:
    """The command group with every command registered (imports torch and timm)."""
    for name in _COMMAND_MODULES:
        importlib.import_module(f"vitcompress.cli.{name}")
    return importlib.import_module("vitcompress.cli.app").cli


def __getattr__(name: str) -> Any:
    """The group and the exit codes, importing the commands the first time one is asked for."""
    if name in _FROM_APP:
        _load_commands()
        value = getattr(importlib.import_module("vitcompress.cli.app"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _interrupted() -> NoReturn:
    """Say so in one line and end with 130, running nothing more (no ``atexit`` callback, whose
    own interrupted traceback would follow the line)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    try:
        os.write(2, b"error: interrupted\n")
    except OSError:
        pass
    os._exit(_INTERRUPTED_CODE)


def _on_interrupt_at_exit(signum: int, frame: FrameType | None) -> None:
    _interrupted()


def main() -> None:
    """The console script: run the command line, Ctrl-C one line and exit 130 at any time."""
    try:
        group = _load_commands()
    except KeyboardInterrupt:
        _interrupted()
    try:
        group(prog_name="vitcompress")
    except KeyboardInterrupt:  # between the group's handlers (click's own would say "Aborted!")
        _interrupted()
    finally:
        # The command has ended (click exits through SystemExit): its output is written, and
        # what is left is the interpreter's shutdown.
        if (
            threading.current_thread() is threading.main_thread()  # where handlers can be set
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, _on_interrupt_at_exit)


if __name__ == "__main__":
    sys.exit(main())
