"""The manual's "Adding a consumer" example (docs/adding-a-consumer.md), exactly as printed, works through
the CLI once pip-installed: a consumer of its own event types (orders keyed by
orderId), registered by its entry point, whose events replay with the answers
printed, and whose view gives it list, show and its row and meta in trace."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from support import subprocess_env

REPO = Path(__file__).resolve().parents[2]
FIRST = "01938a7e-7c00-7000-8000-000000000001"  # order-7 placed, with meta
PAID = "01938a7e-7c00-7000-8000-000000000002"  # order-7 paid: its current event


def section() -> str:
    return (REPO / "docs" / "adding-a-consumer.md").read_text("utf-8")


def example_files() -> dict[str, str]:
    """File name -> content of each code block introduced by its name in backquotes."""
    return dict(re.findall(r"`([\w.]+)`:?\n\n```\w+\n(.*?)```", section(), re.S))


def transcript() -> list[tuple[str, str]]:
    """(command, expected stdout) of each ``$ delivery-consumer`` line of the example's session."""
    (session,) = re.findall(r"```\n(\$ delivery-consumer .*?)```", section(), re.S)
    return [(step.split("\n", 1)[0], step.split("\n", 1)[1] if "\n" in step else "")
            for step in re.split(r"^\$ ", session, flags=re.M) if step]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example pip-installed (entry point included) into a fresh venv that sees the test venv."""
    root = tmp_path_factory.mktemp("readme_consumer")
    package = root / "delivery-orders"
    package.mkdir()
    for name, content in example_files().items():
        if name != "orders.ndjson":  # the events, not part of the distribution
            (package / name).write_text(content, "utf-8")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    # --system-site-packages of a venv made from a venv sees the base Python, not the test venv: add it.
    Path(purelib, "_test_venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                    str(package)], check=True, timeout=300, env=subprocess_env())
    yield python


def run(python: Path, cwd: Path, command: str, code: int = 0) -> str:
    args = command.split()
    assert args[0] == "delivery-consumer"
    done = subprocess.run([str(python), "-m", "delivery_consumer", *args[1:]], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert code == done.returncode, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def test_the_example_has_a_module_its_entry_points_and_events() -> None:
    """The section shows the module, a pyproject.toml whose entry points name it, and its events."""
    files = example_files()
    assert {"delivery_orders.py", "pyproject.toml", "orders.ndjson"} == set(files)
    assert '[project.entry-points."delivery_consumer.consumers"]\norders = "delivery_orders"' in files["pyproject.toml"]
    assert '[project.entry-points."delivery_consumer.event_types"]\norders = "delivery_orders"' in (
        files["pyproject.toml"])
    assert 6 == len(files["orders.ndjson"].splitlines())


def test_the_installed_example_works_through_the_cli(installed: Path, tmp_path: Path) -> None:
    """replay of its events, list and show (output exactly as printed) and trace with the key and meta
    work for the installed example, found by its entry point alone (no DELIVERY_PLUGINS)."""
    (tmp_path / "orders.ndjson").write_text(example_files()["orders.ndjson"], "utf-8")
    steps = transcript()
    assert [c for c, _ in steps] == ["delivery-consumer replay --consumer orders orders.ndjson",
                                     "delivery-consumer orders list", "delivery-consumer orders show order-7"]
    for command, expected in steps:
        assert expected == run(installed, tmp_path, command, code=1 if "replay" in command else 0), command

    traced = orjson.loads(run(installed, tmp_path, f"delivery-consumer trace --consumer orders --json {FIRST}"))
    assert ("applied", "updated", "order-7") == (traced["status"], traced["receipt"]["result"],
                                                 traced["receipt"]["key"])
    assert {"correlationId": "checkout-31",
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"} == traced["receipt"]["meta"]
    current = orjson.loads(run(installed, tmp_path, f"delivery-consumer trace --consumer orders --json {PAID}"))
    assert {"orderId": "order-7", "revision": 2, "status": "paid", "totalCents": 1250, "eventId": PAID,
            "currentEvent": True} == current["key"]["row"]
    assert ("orderId", "order-7") == (current["key"]["field"], current["key"]["value"])
    missing = subprocess.run([str(installed), "-m", "delivery_consumer", "orders", "show", "order-0"],
                             cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert (1, "") == (missing.returncode, missing.stdout)
    assert "orderId order-0 not found" in missing.stderr
