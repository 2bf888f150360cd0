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


# -- layers ---------------------------------------------------------------------------------

#: The edge of the package: what talks to the broker, the command line or a person, each with why.
#: Every other module is the core, and a new module is core until it says otherwise here.
EDGE = {
    "delivery_consumer": "the package's face: its public names, each loaded on first use (the service too)",
    "delivery_consumer.__main__": "python -m delivery_consumer: the command line",
    "delivery_consumer.amqp": "RabbitMQ through pika",
    "delivery_consumer.service": "run: a consumer as a RabbitMQ service",
    "delivery_consumer.cli": "the command line (click)",
    "delivery_consumer.console": "the operator's web page (broker and databases)",
    "delivery_consumer.system": "the system view: databases and broker queues",
    "delivery_consumer.deadletters": "the dead-queue tools",
    "delivery_consumer.queue_metrics": "queue depths asked of the broker",
    "delivery_consumer.partition_queues": "a partitioned consumer's queues on the broker",
    "delivery_consumer.outbox": "the producer's outbox and its dispatcher to RabbitMQ",
    "delivery_consumer.producer": "the demo producer (on the outbox)",
    "delivery_consumer.testing": "the test kit: run's worker in memory, and its pytest plugin",
}
#: What the core never imports, at any depth of a file (lazy imports included).
NOT_IN_THE_CORE = ("pika", "click", "delivery_consumer.amqp", "delivery_consumer.service", "delivery_consumer.cli")


def group(name: str) -> str:
    """The EDGE entry *name* belongs to (the longest that contains it), or ``core``."""
    owners = [edge for edge in EDGE if name == edge or (edge != "delivery_consumer" and within(name, edge))]
    return max(owners, key=len) if owners else "core"


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


def test_the_core_imports_neither_the_broker_the_service_nor_the_command_line() -> None:
    """No core module imports pika, click, amqp, service or cli, directly or through the
    modules it imports (lazy imports too): the store, the applier and the slot math stand alone."""
    edges = graph()
    trees = dict(modules())
    found = []
    for name in sorted(n for n in trees if group(n) == "core"):
        for module in {name} | reach(edges, name):
            bad = sorted(n for n in imported(trees[module]) | edges[module]
                         if any(within(n, b) for b in NOT_IN_THE_CORE))
            if bad:
                found.append(f"{name} (through {module}): {', '.join(bad)}")
    assert [] == found
    assert len([n for n in trees if group(n) == "core"]) > 30  # the core is most of the package


def test_the_layers_import_each_other_in_one_direction() -> None:
    """Grouped as the core and the EDGE entries, the package's imports form no cycle:
    the core imports no edge, amqp no service, the service no command line."""
    edges = graph()
    layers: dict[str, set[str]] = {}
    for name, targets in edges.items():
        layers.setdefault(group(name), set()).update(group(t) for t in targets if group(t) != group(name))
    cycles = []
    for start in layers:
        if start in reach(layers, start):
            cycles.append(start)
    assert [] == sorted(cycles), {g: sorted(layers[g]) for g in cycles}
    assert set() == layers["core"]


def test_importing_the_core_the_worker_or_the_outbox_loads_neither_pika_nor_click() -> None:
    """Importing, in a fresh interpreter, each core module, ``service.worker`` and ``outbox``
    (what a producer embeds) loads neither pika nor click: the first that would is named."""
    names = sorted(n for n, _ in modules() if group(n) == "core")
    names += ["delivery_consumer.service.worker", "delivery_consumer.outbox"]
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
