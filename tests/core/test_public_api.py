"""The package's public face: every name of ``delivery_consumer.__all__`` resolves, lazily, to the
object its module defines; importing the package loads none of the toolkit; and the manual imports
only public names (the package root or a public submodule, each name in that module's ``__all__``)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import delivery_consumer

REPO = Path(__file__).resolve().parents[2]
INIT = REPO / "delivery_consumer" / "__init__.py"
PUBLIC = ("delivery_consumer", *delivery_consumer.PUBLIC_MODULES)


def test_every_public_name_is_the_object_its_module_defines() -> None:
    """Each name of ``__all__`` resolves from the root to the very object of the module that defines it."""
    for name in delivery_consumer.__all__:
        if name == "__version__":
            continue
        module, attribute = delivery_consumer._LAZY[name]
        defined = importlib.import_module(module)
        assert (defined if attribute is None else getattr(defined, attribute)) is getattr(delivery_consumer, name)
    assert set(delivery_consumer._LAZY) | {"__version__"} == set(delivery_consumer.__all__)
    assert set(delivery_consumer.__all__) <= set(dir(delivery_consumer))
    with pytest.raises(AttributeError, match="no attribute 'apply_batch'"):
        delivery_consumer.apply_batch  # noqa: B018 -- an internal name is not at the root


def test_type_checkers_see_every_public_name() -> None:
    """The ``if TYPE_CHECKING:`` imports of the root name exactly ``__all__`` (``__version__`` aside), so
    that mypy and editors know each lazy name's type."""
    tree = ast.parse(INIT.read_text("utf-8"))
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    names = {alias.asname or alias.name for node in block.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    assert set(delivery_consumer.__all__) - {"__version__"} == names


def test_importing_the_package_loads_none_of_the_toolkit_and_names_load_no_broker_client() -> None:
    """In a fresh interpreter ``import delivery_consumer`` loads only its version; resolving every public
    name (the test kit and ``run_consumer`` included) and the public submodules loads neither pika nor click."""
    script = (
        "import sys\n"
        "import delivery_consumer\n"
        "print(sorted(m for m in sys.modules if m.startswith('delivery_consumer')))\n"
        "from delivery_consumer import *\n"
        "import delivery_consumer.outbox, delivery_consumer.testing\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pika', 'click'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert ["['delivery_consumer', 'delivery_consumer.version']", "[]"] == done.stdout.splitlines()


@pytest.mark.parametrize("module", delivery_consumer.PUBLIC_MODULES)
def test_every_name_of_a_public_submodule_resolves(module: str) -> None:
    """A public submodule's ``__all__`` names only what it has."""
    loaded = importlib.import_module(module)
    assert [] == [name for name in loaded.__all__ if not hasattr(loaded, name)]


# -- the manual imports public names only -------------------------------------------------------

def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def imports_in(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of the package in *text*: in its Python code blocks (parsed),
    and in its inline code spans of the form ``from delivery_consumer... import a, b``. ``import x`` gives
    no names."""
    for block in re.finditer(r"^```(?:python|py)\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, block.start()) + 2
        for node in ast.walk(ast.parse(block.group(1))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield first + node.lineno - 1, node.module, [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield first + node.lineno - 1, alias.name, []
    for span in re.finditer(r"`from\s+(delivery_consumer[\w.]*)\s+import\s+([\w,\s]+)`", text):
        yield (text.count("\n", 0, span.start()) + 1, span.group(1),
               [name.strip() for name in span.group(2).split(",")])


def private_imports(text: str) -> list[str]:
    found = []
    for line, module, names in imports_in(text):
        if module.split(".")[0] != "delivery_consumer":
            continue
        if module not in PUBLIC:
            found.append(f"{line}: {module} is not a public module")
            continue
        public = importlib.import_module(module).__all__
        found += [f"{line}: {module}.{name} is not in its __all__" for name in names if name not in public]
    return found


def test_the_check_finds_private_imports() -> None:
    """An internal module, a name outside ``__all__`` and an inline span are each found; public ones pass."""
    text = ("```python\nfrom delivery_consumer.model.contract import View\nfrom delivery_consumer import View, _LAZY\n"
            "import delivery_consumer.outbox\nimport delivery_consumer.inbox\n```\n"
            "Use `from delivery_consumer.model.state import RevisionTable`, or `from\n"
            "delivery_consumer import make_envelope,\n_LAZY`.\n")
    assert ["2: delivery_consumer.model.contract is not a public module",
            "3: delivery_consumer._LAZY is not in its __all__",
            "5: delivery_consumer.inbox is not a public module",
            "7: delivery_consumer.model.state is not a public module",
            "7: delivery_consumer._LAZY is not in its __all__"] == private_imports(text)


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.name)
def test_the_manual_imports_only_public_names(page: Path) -> None:
    """Every import of the package a page shows (code blocks and inline code) is from the root or a
    public submodule, of a name in that module's ``__all__``: the docs teach only what is supported."""
    assert [] == private_imports(page.read_text("utf-8"))


def test_the_manual_shows_imports_of_the_package() -> None:
    """The check is not vacuous: the pages show imports from the root and from a public submodule."""
    shown = {module for page in pages() for _, module, _ in imports_in(page.read_text("utf-8"))}
    assert {"delivery_consumer", "delivery_consumer.testing"} <= shown
