"""``vitcompress`` command line: the group and its commands, one module per kind of work."""

from __future__ import annotations

import sys

from vitcompress.cli import (  # noqa: F401 - importing a module registers its commands
    eval_command,
    export_command,
    finetune_command,
    model_commands,
    report_command,
    search_command,
    variants_command,
)
from vitcompress.cli.app import EXIT_INTERRUPTED, EXIT_USAGE, USER_ERRORS, cli

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "USER_ERRORS", "cli", "main"]


def main() -> None:
    cli(prog_name="vitcompress")


if __name__ == "__main__":
    sys.exit(main())
