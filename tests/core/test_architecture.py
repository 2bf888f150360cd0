"""Import rules of the package, checked on the source with ``ast`` (no module is imported)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "delivery_consumer"

#: (library, the only package allowed to import it). A module imports the
#: library when it imports it or any of its submodules, at any depth of the file.
ONLY_IMPORTED_BY = [
    ("pika", "delivery_consumer.amqp"),
    ("opentelemetry", "delivery_consumer.observability.tracing"),
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


# -- layers ---------------------------------------------------------------------------------

#: The package's folders by layer, lowest first, each with why it stands there. A module may
#: import modules of its own folder and of lower layers only; folders named on one line are
#: siblings and import neither each other. ``delivery_consumer/<folder>/`` or a module at the
#: root (``version``) is a folder here; a new folder fails the test until it is given a place.
LAYERS: list[tuple[tuple[str, ...], str]] = [
    (("version",), "the release, imported by whoever prints it"),
    (("model",), "what an event, an event type, a consumer and a rejection are: no I/O"),
    (("amqp",), "RabbitMQ's terms: queue names and headers, slots, retry tiers, and pika in its modules"),
    (("store",), "SQLite as every database here uses it, the file under operators, placement"),
    (("observability",), "metrics, logs, traces of the lower layers' work"),
    (("inbox", "outbox"), "the consumer's database and its reports; the producer's outbox"),
    (("consumers",), "the registry and the built-in effects, on the inbox"),
    (("ops",), "the operator's tools: deployment file, system view, dead letters, recovery, replay"),
    (("service",), "run: a consumer as a RabbitMQ service"),
    (("console", "testing"), "the operator's web page; the test kit (run's worker in memory)"),
    (("cli",), "the command line (click)"),
    (("delivery_consumer", "__main__"), "the package's face (names loaded on first use) and python -m"),
]

#: Modules at the root that keep an old import path working for one release: nothing imports them.
SHIMS = ("cloudevents", "contract", "envelope", "errors", "event_ids", "event_types", "faults", "producer",
         "sqlite", "state", "typed", "views")

#: The layers whose modules stand without the broker client and the command line: importing one,
#: at any depth (lazy imports too), reaches no module that imports pika or click.
CORE = ("model", "store", "observability", "inbox", "outbox", "consumers")

RANK = {folder: rank for rank, (folders, _why) in enumerate(LAYERS) for folder in folders}


def folder(name: str) -> str:
    """The folder of module *name*: its first part under the package, or the package itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import that runs back up, or sideways between sibling folders, as ``a -> b``."""
    found = []
    for name, targets in sorted(edges.items()):
        if folder(name) in SHIMS:
            continue
        for target in sorted(targets):
            here, there = folder(name), folder(target)
            if here != there and RANK.get(there, len(LAYERS)) >= RANK[here]:
                found.append(f"{name} ({here}) -> {target} ({there})")
    return found


def module_imports() -> dict[str, set[str]]:
    """Module -> the package's modules its file imports, at any depth (lazy and
    ``if TYPE_CHECKING:`` imports too): ``from .x import y`` names module ``x.y``
    when there is one, else ``x``; ``import a.b`` names the deepest module of ``a.b``."""
    trees = dict(modules())
    edges: dict[str, set[str]] = {}
    for name, tree in trees.items():
        is_package = PACKAGE.joinpath(*name.split(".")[1:], "__init__.py").exists()
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in trees else base)
        found = set()
        for target in targets:
            parts = target.split(".")
            known = [".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in trees]
            found.update(known[-1:])
        edges[name] = found - {name}
    return edges


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth of its file.

    As :func:`module_imports`, and importing a module runs its parent packages'
    ``__init__`` too (the package's face aside: it imports the service lazily,
    in ``__getattr__``)."""
    trees = dict(modules())
    edges: dict[str, set[str]] = {}
    for name, targets in module_imports().items():
        found = set()
        for target in targets:
            parts = target.split(".")
            found.update(".".join(parts[:n]) for n in range(2, len(parts) + 1) if ".".join(parts[:n]) in trees)
        edges[name] = found - {name}
    return edges


def reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_folder_has_a_layer() -> None:
    """Every module lives in a folder of :data:`LAYERS` or is a shim: a new folder is given a place."""
    assert [] == sorted({folder(name) for name, _ in modules()} - set(RANK) - set(SHIMS))


def test_no_import_runs_back_up() -> None:
    """Grouped by folder, every import (lazy and ``if TYPE_CHECKING:`` ones too, and a package's
    ``__init__`` that importing a module runs) points to the module's own folder or a lower layer."""
    edges = graph()
    assert [] == upward(edges)
    assert sum(len(targets) for targets in edges.values()) > 300  # the graph is read


def test_an_upward_import_is_found() -> None:
    """The check is not vacuous: the store importing the inbox, the inbox the outbox (siblings)
    or the model the command line is each reported."""
    edges = graph()
    edges["delivery_consumer.store.sqlite"].add("delivery_consumer.inbox.apply")
    edges["delivery_consumer.inbox.apply"].add("delivery_consumer.outbox.table")
    edges["delivery_consumer.model.errors"].add("delivery_consumer.cli")
    assert [
        "delivery_consumer.inbox.apply (inbox) -> delivery_consumer.outbox.table (outbox)",
        "delivery_consumer.model.errors (model) -> delivery_consumer.cli (cli)",
        "delivery_consumer.store.sqlite (store) -> delivery_consumer.inbox.apply (inbox)",
    ] == upward(edges)


def test_nothing_in_the_package_imports_a_shim() -> None:
    """The old import paths are for users only: no module of the package imports one (each shim
    imports nothing of the package but its new home)."""
    edges = module_imports()
    shims = {f"delivery_consumer.{name}" for name in SHIMS}
    assert shims <= set(edges)
    assert [] == sorted(f"{name} -> {target}" for name, targets in edges.items() for target in targets
                        if target in shims)


def test_the_core_reaches_neither_pika_nor_click() -> None:
    """No module of the :data:`CORE` layers imports pika or click, directly or through the modules it
    imports (lazy imports too): the store, the applier and the slot math stand alone."""
    edges = graph()
    trees = dict(modules())
    found = []
    for name in sorted(n for n in trees if folder(n) in CORE):
        for module in {name} | reach(edges, name):
            bad = sorted(n for n in imported(trees[module]) if any(within(n, b) for b in ("pika", "click")))
            if bad:
                found.append(f"{name} (through {module}): {', '.join(bad)}")
    assert [] == found
    assert len([n for n in trees if folder(n) in CORE]) > 40  # the core is most of the package


def test_importing_the_core_or_the_worker_loads_neither_pika_nor_click() -> None:
    """Importing, in a fresh interpreter, each module of the :data:`CORE` layers (the outbox is what a
    producer embeds) and ``service.worker`` loads neither pika nor click: the first that would is named."""
    names = sorted(n for n, _ in modules() if folder(n) in CORE)
    names += ["delivery_consumer.service.worker"]
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "    loaded = sorted({m.split('.')[0] for m in sys.modules} & {'pika', 'click'})\n"
        "    if loaded:\n"
        "        print(name, *loaded)\n"
        "        break\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert 0 == done.returncode, done.stderr
    assert "" == done.stdout


# -- no circle of modules -----------------------------------------------------------------

def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted."""
    reached = {name: reach(edges, name) for name in edges}
    found = {tuple(sorted(n for n in reached[name] if name in reached[n])) for name in edges if name in reached[name]}
    return sorted(list(circle) for circle in found)


def file_of(name: str) -> str:
    """The file of module *name*, relative to the repository."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(PACKAGE.parent))


def test_circles_are_found() -> None:
    """The search finds a circle through a package's ``__init__`` and leaves a one-way chain alone."""
    edges = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "p.c": {"p.a"}, "q": {"q.x"}, "q.x": set()}
    assert [["p", "p.a", "p.b"]] == circles(edges)


def test_no_import_cycle_among_the_package_modules() -> None:
    """No module imports itself back through others, counting every import of a file
    (lazy and ``if TYPE_CHECKING:`` too, and the package's face): the types point one
    way, core types <- inbox <- service <- command line. Each circle found is named with
    its files and the imports that close it."""
    edges = module_imports()
    assert "delivery_consumer.service.launch" in edges["delivery_consumer"]  # a lazy import is counted
    found = circles(edges)
    report = [
        " <-> ".join(file_of(n) for n in circle) + ": "
        + "; ".join(f"{file_of(a)} -> {file_of(b)}" for a in circle for b in sorted(edges[a]) if b in circle)
        for circle in found
    ]
    assert [] == report, "\n".join(report)
