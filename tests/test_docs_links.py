"""Every relative link of the README and docs/ leads somewhere: the file exists and, where the link
names a heading (`page.md#anchor`), the page has that heading, slugged as GitHub slugs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to
    hyphens (`## int8: `--quantize int8|int8-static`` -> `int8---quantize-int8int8-static`)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", page.read_text()), re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z+.-]*:", t)]


def broken(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading")
    return bad


def test_slug_follows_github():
    assert slug("int8: `--quantize int8|int8-static`") == "int8---quantize-int8int8-static"
    assert slug("Hybrids: the paper's settings (params / GMACs)") == (
        "hybrids-the-papers-settings-params--gmacs"
    )


def test_the_checker_finds_a_missing_page_and_a_missing_heading(tmp_path: Path):
    (tmp_path / "b.md").write_text("# Title\n\n## A heading\n\n```\n## not a heading\n```\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#a-heading) [top](b.md#title) [web](https://example.com/x.md#y)\n"
        "[gone](c.md) [no](b.md#not-a-heading) [self](#nothing)\n"
    )
    assert broken(page) == [
        "c.md: no such file",
        "b.md#not-a-heading: no such heading",
        "#nothing: no such heading",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path):
    assert broken(page) == []
