"""docs/cli.md is the help texts themselves: every command's block is what `--help` prints at the
width the page names, and its table lists every command with the line `vitcompress --help` gives
it. An option added, renamed, removed or re-described without the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from vitcompress.cli.main import cli

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _blocks() -> dict[str, str]:
    """The page's help blocks by command ("" for the group), as written."""
    blocks = {}
    for block in re.findall(r"```text\n(.*?)```", PAGE.read_text(), re.S):
        usage = re.match(r"Usage: vitcompress(?: (\w+))? ", block)
        assert usage, block[:80]
        blocks[usage.group(1) or ""] = block
    return blocks


def _help(command: str) -> str:
    """`--help` as the page's "Regenerating this page" prints it (100 columns)."""
    args = [command, "--help"] if command else ["--help"]
    result = CliRunner().invoke(cli, args, terminal_width=100, prog_name="vitcompress")
    assert result.exit_code == 0, result.output
    return "".join(line.rstrip() + "\n" for line in result.output.splitlines())


def test_no_option_describes_a_range_without_bounds():
    # click words a float range with neither bound as "[x<=None]" (FiniteFloat() is one).
    for command in ["", *sorted(cli.commands)]:
        assert "None]" not in _help(command), command


def test_the_page_has_one_block_per_command():
    assert sorted(_blocks()) == sorted(["", *cli.commands])


@pytest.mark.parametrize("command", ["", *sorted(cli.commands)])
def test_each_block_is_the_commands_help(command):
    # On a failure: print the help again as docs/cli.md's last section says, and paste it in.
    assert _blocks()[command] == _help(command)


def _options(text: str) -> set[str]:
    return set(re.findall(r"^  (--[\w-]+)", text, re.M))


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_option_of_a_command_is_on_the_page(command):
    # The same comparison, by option name only: a failure here names the option.
    listed = _options(_blocks()[command])
    offered = {
        opt
        for param in cli.commands[command].params
        if not getattr(param, "hidden", False)
        for opt in param.opts[:1]
        if opt.startswith("--")
    } | {"--help"}
    assert listed == offered, {"missing": offered - listed, "not an option": listed - offered}


def test_the_table_lists_every_command_with_its_line():
    rows = dict(re.findall(r"^\| \[`(\w+)`\]\(#(\w+)\) \|", PAGE.read_text(), re.M))
    assert rows == {name: name for name in cli.commands}
    text = PAGE.read_text()
    for name, command in cli.commands.items():
        line = command.get_short_help_str(limit=10_000)
        assert f"| [`{name}`](#{name}) | {line} |" in text, name
