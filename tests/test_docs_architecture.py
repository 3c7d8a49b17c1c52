"""docs/architecture.md describes the package as it is: its layer table is tests/test_structure.py's
LAYERS, row by row, and every module it names (`analysis/records.py`, `search/driver.py`, ...)
exists."""

from __future__ import annotations

import re

from tests.test_structure import LAYERS, PACKAGE

PAGE = PACKAGE.parent / "docs" / "architecture.md"


def _unit(cell: str) -> str | None:
    """The LAYERS unit a table cell's code span names: `vitcompress/method/` -> method,
    `errors.py` -> errors, `vitcompress/__init__.py` -> vitcompress; None for anything else."""
    name = re.fullmatch(r"(?:vitcompress/)?(\w+)(?:/|\.py)", cell)
    if name is None:
        return None
    return "vitcompress" if name.group(1) == "__init__" else name.group(1)


def layer_table(text: str) -> list[set[str]]:
    section = text.split("## The layers, bottom up", 1)[1].split("\n## ", 1)[0]
    rows = []
    for number, packages in re.findall(r"^\| (\d+) \| (.*?) \|", section, re.M):
        assert int(number) == len(rows), f"layer {number} out of order"
        # Only the code spans outside parentheses name a layer's units; the rest describe them.
        depth, outside = 0, []
        for char in packages:
            depth += char == "("
            if depth == 0:
                outside.append(char)
            depth -= char == ")"
        rows.append({u for s in re.findall(r"`([^`]+)`", "".join(outside)) if (u := _unit(s))})
    return rows


def test_the_layer_table_is_the_declared_layers():
    assert layer_table(PAGE.read_text()) == [set(layer) for layer in LAYERS]


def test_the_table_reader_sees_a_package_in_the_wrong_layer():
    text = (
        "## The layers, bottom up\n\n| # | packages | what |\n|---:|---|---|\n"
        "| 0 | `errors.py`, `vitcompress/zoo/` (pvt, `cvt.py`) | x |\n"
        "| 1 | `vitcompress/__init__.py`, `vitcompress/analysis/` | y |\n"
    )
    assert layer_table(text) == [{"errors", "zoo"}, {"vitcompress", "analysis"}]


def test_every_module_the_page_names_exists():
    # A path with a folder: under the repository where it starts with one of its folders
    # (`tests/`, `vitcompress/`), else under the package (`analysis/records.py`).
    text = PAGE.read_text()
    named = set(re.findall(r"`((?:\w+/)+\w+\.py)`", text))
    root = PACKAGE.parent
    missing = sorted(
        n
        for n in named
        if not (root / n if (root / n.split("/")[0]).is_dir() else PACKAGE / n).exists()
    )
    assert named and missing == []
    packages = set(re.findall(r"`vitcompress/((?:\w+/)*\w+)/`", text))
    assert packages and sorted(p for p in packages if not (PACKAGE / p).is_dir()) == []


def test_every_package_is_in_the_table():
    described = set().union(*layer_table(PAGE.read_text()))
    on_disk = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    on_disk |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {"vitcompress"}
    assert on_disk - described == set()
