"""docs/api.md gives the code's own signatures and docstrings: one section per public function of
`vitcompress.api.__all__`, its parameters with their defaults, its docstring and its module."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import vitcompress.api as api

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
FUNCTIONS = sorted(n for n in api.__all__ if callable(getattr(api, n)))


def _section(name: str) -> tuple[str, str, str]:
    found = re.search(
        rf"^### `{name}`\n\n```python\n(.*?)```\n\n(.*?)\n\nDefined in `([\w.]+)`",
        PAGE.read_text(),
        re.S | re.M,
    )
    assert found, f"docs/api.md has no section for {name}"
    return found.group(1), found.group(2), found.group(3)


def _markdown(docstring: str) -> str:
    """A docstring as the page writes it: ``x`` and :func:`x` become `x`, lines joined."""
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", docstring).replace("``", "`")
    return " ".join(text.split())


def test_every_public_name_has_a_section():
    headings = re.findall(r"^### `(\w+)`", PAGE.read_text(), re.M)
    assert sorted(headings) == sorted(api.__all__)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_section_is_the_codes_signature_and_docstring(name):
    function = getattr(api, name)
    signature, text, module = _section(name)
    assert module == function.__module__
    written = re.findall(r"^    (\w+): [^=\n]*?(?: = (.*?))?,?$", signature, re.M)
    parameters = inspect.signature(function).parameters.values()
    assert written == [
        (p.name, "" if p.default is inspect.Parameter.empty else repr(p.default))
        for p in parameters
    ]
    docstring = inspect.getdoc(function)
    if docstring is not None:  # without one, the page says what the code does in its own words
        assert " ".join(text.split()) == _markdown(docstring)
