"""The manual's "Adding a consumer" example (docs/adding-a-consumer.md), exactly as printed, works once
pip-installed: a consumer of a payment service's typed events (dataclass models, one handler per type, codes of
its own), registered by its entry point, whose own tests pass on the test kit in the installed venv, whose events
replay with the answers printed, whose view gives it list, show and its row in trace (a CloudEvent found by the id
its producer knows), and whose AsyncAPI document is valid."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from examplekit import example_files, install_example, section
from support import subprocess_env
from test_asyncapi import errors, payload_schema

FIRST = "01938b10-0000-7000-8000-000000000001"  # pay-1 authorized, with meta
CONFLICT = "01938b10-0000-7000-8000-000000000004"  # pay-1 captured again at revision 2, another amount
CLOUDEVENT = "pay-000002-auth"  # pay-2 authorized, a CloudEvent from /payments


def transcript() -> list[tuple[str, str]]:
    """(command, expected stdout) of each ``$ delivery-consumer`` line of the example's session."""
    (session,) = re.findall(r"```\n(\$ delivery-consumer .*?)```", section(), re.S)
    return [(step.split("\n", 1)[0], step.split("\n", 1)[1] if "\n" in step else "")
            for step in re.split(r"^\$ ", session, flags=re.M) if step]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The example pip-installed (entry points included) into a fresh venv that sees the test venv; its files."""
    yield install_example(tmp_path_factory.mktemp("readme_consumer"))


def run(python: Path, cwd: Path, command: str, code: int = 0) -> str:
    args = command.split()
    assert args[0] == "delivery-consumer"
    done = subprocess.run([str(python), "-m", "delivery_consumer", *args[1:]], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert code == done.returncode, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def test_the_example_has_a_module_its_entry_points_its_tests_and_events() -> None:
    """The section shows the module, a pyproject.toml whose entry points name it, its tests and its events."""
    files = example_files()
    assert {"delivery_payments.py", "pyproject.toml", "test_payments.py", "payments.ndjson"} == set(files)
    assert '[project.entry-points."delivery_consumer.consumers"]\npayments = "delivery_payments"' in (
        files["pyproject.toml"])
    assert '[project.entry-points."delivery_consumer.model.event_types"]\npayments = "delivery_payments"' in (
        files["pyproject.toml"])
    assert 7 == len(files["payments.ndjson"].splitlines())
    assert "@payments.on(" in files["delivery_payments.py"] and "consumer_harness" in files["test_payments.py"]


def test_the_examples_own_tests_pass_on_the_test_kit_once_installed(installed: tuple[Path, Path]) -> None:
    """pytest runs the example's tests in the venv it is installed in, from its own directory: the fixture
    consumer_harness comes from delivery-consumer's pytest plugin (its entry point), the consumer from the
    installed module; every test passes."""
    python, package = installed
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_payments.py"],
                          cwd=package, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\b6 passed\b", done.stdout), done.stdout


def test_the_installed_example_works_through_the_cli(installed: tuple[Path, Path], tmp_path: Path) -> None:
    """replay of its events, list and show (output exactly as printed), trace of the CloudEvent by its id and of
    the conflict by its key, and the AsyncAPI document, for the installed example found by its entry point
    alone (no DELIVERY_PLUGINS)."""
    python, _ = installed
    (tmp_path / "payments.ndjson").write_text(example_files()["payments.ndjson"], "utf-8")
    steps = transcript()
    assert [c for c, _ in steps] == ["delivery-consumer replay --consumer payments payments.ndjson",
                                     "delivery-consumer payments list", "delivery-consumer payments show pay-1"]
    for command, expected in steps:
        assert expected == run(python, tmp_path, command, code=1 if "replay" in command else 0), command

    traced = orjson.loads(run(python, tmp_path, f"delivery-consumer trace --consumer payments --json {FIRST}"))
    assert ("applied", "updated", "pay-1", {"correlationId": "checkout-77"}) == (
        traced["status"], traced["receipt"]["result"], traced["receipt"]["key"], traced["receipt"]["meta"])
    cloud = orjson.loads(run(python, tmp_path, f"delivery-consumer trace --consumer payments --json {CLOUDEVENT}"))
    assert {"id": CLOUDEVENT, "source": "/payments"} == cloud["cloudEvent"]
    assert ("pay-2", "authorized", "2026-12-01T09:00:00.250Z") == (
        cloud["key"]["value"], cloud["key"]["row"]["status"], run_sql(python, tmp_path, cloud["eventId"]))
    conflict = orjson.loads(run(python, tmp_path, f"delivery-consumer trace --consumer payments --json {CONFLICT}"))
    assert ("rejected", "paymentId", "pay-1", 3) == (conflict["status"], conflict["key"]["field"],
                                                      conflict["key"]["value"], conflict["key"]["row"]["revision"])

    run(python, tmp_path, "delivery-consumer asyncapi --consumer payments -o payments.asyncapi.json")
    doc: dict[str, Any] = orjson.loads((tmp_path / "payments.asyncapi.json").read_bytes())
    assert [] == errors(doc)
    assert {"payment.authorized", "payment.captured", "payment.refunded"} <= set(doc["components"]["messages"])
    assert {"payments.receive", "payments.deadLetter"} == set(doc["operations"])
    assert "^[A-Z]{3}$" == payload_schema(doc, "payment.captured")["properties"]["data"]["properties"][
        "currency"]["pattern"]


def run_sql(python: Path, cwd: Path, event_id: str) -> str:
    """The occurredAt the consumer stored for *event_id* (its row's occurred_at), asked with ``query``."""
    done = subprocess.run([str(python), "-m", "delivery_consumer", "query", "--consumer", "payments", "--json",
                           f"SELECT occurred_at FROM payments WHERE event_id = '{event_id}'"], cwd=cwd,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert 0 == done.returncode, done.stderr
    ((occurred_at,),) = orjson.loads(done.stdout)["rows"]
    return str(occurred_at)


def test_one_apply_instead_of_handlers_keeps_the_same_table(tmp_path: Path) -> None:
    """The page's plain ConsumerSpec, run in the example module's namespace, keeps the same rows from the same
    envelopes as the typed consumer (but the capture above its authorization, a rule of the typed handlers)."""
    import importlib.util

    from delivery_consumer import consumers
    from delivery_consumer.inbox import apply_batch
    from delivery_consumer.model.cloudevents import parse_body

    files = example_files()
    module_path = tmp_path / "delivery_payments.py"
    module_path.write_text(files["delivery_payments.py"], "utf-8")
    spec = importlib.util.spec_from_file_location("delivery_payments_doc", module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (plain_block,) = re.findall(r"## One `apply`.*?```python\n(.*?)```", section(), re.S)
    namespace = vars(module)
    exec(compile(plain_block, "adding-a-consumer.md", "exec"), namespace)
    # the envelopes, but the capture above its authorization (the plain apply has no such rule)
    envelopes = [line for line in files["payments.ndjson"].splitlines()
                 if '"eventId"' in line and '"capturedCents": 5000' not in line]
    rows = {}
    for name in ("payments", "payments-plain"):
        consumer = module.SPEC if name == "payments" else namespace["PLAIN"]
        consumers.register(consumer, replace=True)
        try:
            with consumers.open_db(tmp_path / f"{name}.db", name, create=True) as db:
                parsed = [parse_body(line.encode(), types=consumer.event_types) for line in envelopes]
                apply_batch(db, parsed)
                rows[name] = db.conn.execute("SELECT payment_id, revision, status, captured_cents, refunded_cents"
                                             " FROM payments ORDER BY 1").fetchall()
        finally:
            consumers.unregister(name)
    assert rows["payments"] == rows["payments-plain"]
    assert [("pay-1", 3, "refunded", 2500, 500)] == rows["payments"][:1]


def test_the_api_table_names_every_public_name_and_each_resolves() -> None:
    """The manual's table of the public API names exactly the package's ``__all__`` (its version aside),
    each name imported from the root."""
    import delivery_consumer

    (table,) = re.findall(r"## The API in one place\n\n.*?\n\n(\|.*?)\n\n", section(), re.S)
    rows = [line for line in table.splitlines()[2:] if line.startswith("| `")]
    names = [name for row in rows for name in re.findall(r"`(\w+)`", row.split(" | ")[0])]
    assert sorted(set(delivery_consumer.__all__) - {"__version__"}) == sorted(names)
    assert [] == [name for name in names if getattr(delivery_consumer, name, None) is None]
    assert callable(delivery_consumer.run_consumer)
