"""The README is a front page and docs/ the manual: every relative link of either names a file that
exists and, into a Markdown page, a heading (or an ``<a id>``) that page has; the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text("utf-8")
    found = {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M)}
    return found | set(re.findall(r'<a id="([^"]+)"', text))


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text("utf-8"), flags=re.S)  # code blocks hold no links
    return [target for _label, target in re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", text)
            if not target.startswith(("http://", "https://", "mailto:"))]


def test_every_relative_link_of_the_readme_and_the_manual_resolves() -> None:
    """Each relative link names an existing file, and each #anchor into a Markdown page one of its headings."""
    broken = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_manual_index_lists_every_page() -> None:
    """docs/README.md links every page of docs/, so nothing in the manual is out of reach."""
    index = set(_links(REPO / "docs" / "README.md"))
    listed = {target.partition("#")[0] for target in index}
    pages = {page.name for page in PAGES[1:] if page.name != "README.md"}
    assert pages <= listed, sorted(pages - listed)


def test_the_readme_is_a_front_page() -> None:
    """The README holds what a newcomer needs first (two commands, one example, where to read on), not the manual."""
    lines = (REPO / "README.md").read_text("utf-8").splitlines()
    assert len(lines) <= 200, len(lines)
    assert any("docs/README.md" in line for line in lines)
