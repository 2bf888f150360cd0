"""The crash points the package reaches are the ones faults.py documents (operators and test
authors read the list there to choose ``DELIVERY_CRASH_AT``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from delivery_consumer.model import faults

PACKAGE = Path(faults.__file__).resolve().parents[1]


def reached(function: str) -> set[str]:
    """Every point name given as a string to *function* anywhere in the package (in a
    conditional expression too: ``crashpoint("a" if x else "b")``), called as a function or as a
    method of that name (the worker's ``self.crashpoint``, which the test kit can intercept)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            called = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else \
                node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if called == function and isinstance(node, ast.Call) and node.args:
                names.update(c.value for c in ast.walk(node.args[0])
                             if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return names


def documented() -> set[str]:
    assert faults.__doc__ is not None
    return set(re.findall(r"``([a-z]+(?:-[a-z]+)+)``", faults.__doc__))


def test_every_crash_point_and_pause_point_is_documented_and_every_documented_one_exists() -> None:
    """The names in faults.py's docstring are exactly the points ``crashpoint`` and
    ``pausepoint`` are called with, no fewer and none that no longer exists."""
    points = reached("crashpoint") | reached("pausepoint")
    assert len(points) > 10  # the search finds the calls
    assert sorted(points) == sorted(documented())
