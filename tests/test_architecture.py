"""Import rules of the package, checked on the source with ``ast`` (no module is imported)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "delivery_consumer"

#: (library, the only package allowed to import it). A module imports the
#: library when it imports it or any of its submodules, at any depth of the file.
ONLY_IMPORTED_BY = [
    ("pika", "delivery_consumer.amqp"),
    ("opentelemetry", "delivery_consumer.tracing"),
]


def modules() -> Iterator[tuple[str, ast.Module]]:
    """Every module of the package: its dotted name and its parsed source."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), ast.parse(path.read_text("utf-8"), filename=str(path))


def imported(tree: ast.Module) -> set[str]:
    """The absolute names a module imports (relative imports are the package's own)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("library", "owner"), ONLY_IMPORTED_BY)
def test_library_is_imported_only_by_its_owner(library: str, owner: str) -> None:
    """Only the owning package imports the library, and it does (the rule is not vacuous)."""
    importers = {name for name, tree in modules() if any(within(n, library) for n in imported(tree))}
    assert [] == sorted(name for name in importers if not within(name, owner))
    assert any(within(name, owner) for name in importers)
