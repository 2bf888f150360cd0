"""Text output of the read commands: aligned columns, ``key: value`` records.

Values come from the database and so from producers: control and bidi
characters are shown escaped, so that a title can neither break the columns
nor send escape sequences to the terminal.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Any

import click
import orjson

from ..model.plural import count as count  # the CLI's counts in words

#: Widest cell of a list, in terminal columns; ``show`` prints values whole.
MAX_CELL = 60

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def cell(value: Any, *, null: str = "-") -> str:
    """One value as printable text."""
    if value is None:
        return null
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict | list):
        value = orjson.dumps(value).decode()
    return _UNSAFE.sub(_escape, str(value))


def width(text: str) -> int:
    """Terminal columns of *text* (wide East Asian characters take two)."""
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def clip(text: str, limit: int = MAX_CELL) -> str:
    if width(text) <= limit:
        return text
    while width(text) > limit - 1:
        text = text[:-1]
    return text + "…"


def _pad(text: str, size: int, right: bool) -> str:
    fill = " " * (size - width(text))
    return fill + text if right else text + fill


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, null: str = "-") -> list[str]:
    """Lines of an aligned table: header, rule, rows; numbers right-aligned."""
    cells = [[clip(cell(value, null=null)) for value in row] for row in rows]
    right = [
        bool(rows)
        and all(row[i] is None or (isinstance(row[i], int | float) and not isinstance(row[i], bool)) for row in rows)
        for i in range(len(columns))
    ]
    sizes = [max([width(name)] + [width(row[i]) for row in cells]) for i, name in enumerate(columns)]
    lines = []
    for row in [list(columns), ["-" * size for size in sizes], *cells]:
        lines.append("  ".join(_pad(text, size, r) for text, size, r in zip(row, sizes, right, strict=True)).rstrip())
    return lines


def echo_table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], *, empty: str = "no rows", null: str = "-"
) -> None:
    """Print a table on stdout; when there are no rows, say so on stderr."""
    for line in table(columns, rows, null=null):
        click.echo(line)
    if not rows:
        click.echo(f"({empty})", err=True)


def record(pairs: Sequence[tuple[str, Any]], *, indent: str = "") -> list[str]:
    """Lines of ``key: value`` with the values aligned."""
    size = max((len(key) for key, _ in pairs), default=0) + 1
    return [f"{indent}{key + ':':<{size}} {cell(value)}".rstrip() for key, value in pairs]


def echo_record(pairs: Sequence[tuple[str, Any]], *, indent: str = "") -> None:
    for line in record(pairs, indent=indent):
        click.echo(line)
