"""The manual's example consumer (docs/adding-a-consumer.md), pip-installed exactly as printed, run by
``delivery-consumer run --consumer payments`` on a SQLite file and on a ``postgresql://`` URL alike: a stream of
its own events over a few dozen payments, a producer's duplicates among them, kill -9 of run's main PID
mid-stream and, on PostgreSQL, a restart of a private server while run consumes. The ledger is the model's:
each event's effect once, the refusals the example's rules call for and nothing else."""

from __future__ import annotations

import importlib.util
import random
import secrets
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, RunProcess, kill
from examplekit import install_example
from pgkit import PrivatePostgres, admin, with_database
from support import wait_until

from delivery_consumer import consumers, new_event_id

pytestmark = [pytest.mark.broker, pytest.mark.slow]

CONSUMER = "payments"
#: The example's own refusals (its handlers' codes).
OVER_CAPTURE = "capture-exceeds-authorization"
OVER_REFUND = "refund-exceeds-capture"
#: A row of the example's table, as the model predicts it.
Row = tuple[int, str, int, str, int, int, str, str]
COLUMNS = "revision, status, amount_cents, currency, captured_cents, refunded_cents, event_id, occurred_at"


@dataclass
class Stream:
    """What a payment service publishes, and what the example must make of it (computed here, not by it)."""

    #: Every distinct event, in the order of its first copy.
    events: list[dict[str, Any]] = field(default_factory=list)
    #: The bodies published, in order: each event once, some again later (a producer's redelivery).
    bodies: list[bytes] = field(default_factory=list)
    #: eventId -> code of each event the example must refuse.
    refused: dict[str, str] = field(default_factory=dict)
    #: payment_id -> its row once every event is applied.
    rows: dict[str, Row] = field(default_factory=dict)

    @property
    def applied(self) -> set[str]:
        """The eventIds that must each leave one receipt ``updated`` (in per-payment order, none stale)."""
        return {e["eventId"] for e in self.events} - set(self.refused)

    def copies(self) -> Counter[str]:
        return Counter(orjson.loads(body)["eventId"] for body in self.bodies)


def payment_stream(payments: int = 60, seed: int = 36) -> Stream:
    """A few hundred events of the example's three types over *payments* payments: each payment authorized,
    captured (now and then first above its authorization: refused), then refunded a few times (now and then
    above its capture: refused), at increasing revisions. The payments' events are interleaved, each payment's
    kept in order as its producer publishes them; a fifth of the events are published a second time, later."""
    rng = random.Random(seed)
    stream = Stream()
    lanes: list[list[dict[str, Any]]] = []
    start = datetime(2026, 12, 1, 9, tzinfo=UTC)
    for p in range(payments):
        payment = f"pay-{p:03d}"
        amount, currency = rng.randint(100, 100_000), rng.choice(("EUR", "CHF", "USD"))
        lane: list[dict[str, Any]] = []

        def emit(kind: str, refused: str | None = None, *, payment: str = payment, lane: list[dict[str, Any]] = lane,
                 **data: Any) -> None:
            revision = len(lane) + 1
            at = start + timedelta(minutes=revision, milliseconds=rng.randint(0, 59_999))
            event = {"eventId": new_event_id(), "type": f"payment.{kind}", "paymentId": payment,
                     "revision": revision, "occurredAt": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                     "data": data}
            lane.append(event)
            if refused is not None:
                stream.refused[event["eventId"]] = refused
                return
            state = (kind, data["amountCents"], data["currency"], data.get("capturedCents", 0),
                     data.get("refundedCents", 0))
            stream.rows[payment] = (revision, *state, event["eventId"], event["occurredAt"])

        emit("authorized", amountCents=amount, currency=currency)
        if rng.random() < 0.2:
            emit("captured", OVER_CAPTURE, amountCents=amount, currency=currency,
                 capturedCents=amount + rng.randint(1, 500))
        captured = rng.randint(1, amount)
        emit("captured", amountCents=amount, currency=currency, capturedCents=captured)
        refunded = 0
        for _ in range(rng.randint(0, 4)):
            if rng.random() < 0.2:
                emit("refunded", OVER_REFUND, amountCents=amount, currency=currency, capturedCents=captured,
                     refundedCents=captured + rng.randint(1, 100), reason="too much")
            if refunded == captured:
                break
            refunded = rng.randint(refunded + 1, captured)
            emit("refunded", amountCents=amount, currency=currency, capturedCents=captured, refundedCents=refunded,
                 reason=rng.choice(("", "one item returned", "goodwill")))
        lanes.append(lane)
    while any(lanes):  # the payments' events interleaved, each payment's in its order
        lane = rng.choice([lane for lane in lanes if lane])
        stream.events.append(lane.pop(0))
    placed = [(float(i), orjson.dumps(e)) for i, e in enumerate(stream.events)]
    n = len(stream.events)
    placed += [(rng.uniform(i, n), orjson.dumps(stream.events[i])) for i in rng.sample(range(n), n // 5)]
    stream.bodies = [body for _, body in sorted(placed, key=lambda pair: pair[0])]
    return stream


@dataclass
class Backend:
    """Where run keeps the example's inbox (its ``--db``), read back by the test with the same SQL on both."""

    kind: str
    db: str
    read: Callable[[str], list[tuple[Any, ...]]]
    #: What ``read`` raises before run created the inbox (no file, no schema, no table).
    absent: tuple[type[Exception], ...]
    #: A restart of the database server (PostgreSQL's private one), None on SQLite.
    restart: Callable[[], None] | None = None

    def receipts(self) -> int:
        """Receipts in the example's inbox (0 before run created it)."""
        try:
            return int(self.read("SELECT count(*) FROM inbox")[0][0])
        except self.absent:
            return 0


def sqlite_reader(path: Path) -> Callable[[str], list[tuple[Any, ...]]]:
    def read(sql: str) -> list[tuple[Any, ...]]:
        if not path.exists():
            raise FileNotFoundError(path)
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            return conn.execute(sql).fetchall()
        finally:
            conn.close()

    return read


def postgres_reader(url: str) -> Callable[[str], list[tuple[Any, ...]]]:
    def read(sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(url, autocommit=True, connect_timeout=5,
                             options=f"-c search_path=dc_{CONSUMER}") as conn:
            return [tuple(row) for row in conn.execute(sql).fetchall()]

    return read


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example installed as printed (its python), and its spec registered in this process too, so that the
    test declares and deletes its queues by its name."""
    python, package = install_example(tmp_path_factory.mktemp("example_consumer"))
    found = importlib.util.spec_from_file_location("delivery_payments_as_printed", package / "delivery_payments.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    consumers.register(module.SPEC, replace=True)
    try:
        yield python
    finally:
        consumers.unregister(CONSUMER)


@pytest.fixture
def space(installed: Path, ns: Namespace) -> Namespace:
    """The test's namespace, torn down while the example is still registered (its queues deleted by name)."""
    return ns


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, space: Namespace) -> Iterator[Backend]:
    if request.param == "sqlite":
        path = space.db(CONSUMER)
        yield Backend("sqlite", str(path), sqlite_reader(path), (OSError, sqlite3.Error))
        return
    import psycopg

    server: PrivatePostgres = request.getfixturevalue("private_pg")  # restarted by the test: never the shared one
    name = f"dc_example_{secrets.token_hex(6)}"
    admin(server.url, f'CREATE DATABASE "{name}"')
    try:
        url = with_database(server.url, name)
        yield Backend("postgres", url, postgres_reader(url), (psycopg.Error,), server.restart)
    finally:
        admin(server.url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_run(ns: Namespace, python: Path, backend: Backend, *args: str) -> RunProcess:
    """``delivery-consumer run --consumer payments --db <backend>`` of the installed example, a real process
    (its own session), found by its entry point alone."""
    proc = RunProcess([str(python), "-m", "delivery_consumer", "run", "--consumer", CONSUMER, "--db", backend.db,
                       *args], cwd=ns.workdir, env=ns.env())
    ns.started.append(proc)
    return proc


def test_the_example_keeps_an_exact_ledger_through_kill_9_and_a_server_restart(
        space: Namespace, installed: Path, backend: Backend) -> None:
    """The installed example, unchanged, on this backend: kill -9 of run's main PID mid-stream, then a second
    run (meeting, on PostgreSQL, a restart of the server mid-stream) drains the queue. Every event the example
    accepts has one receipt, ``updated`` (each payment's order kept), and its effect once: the table is the
    model's, row by row, and so is the example's view. The refused events, and only they, are in ``rejected``
    and the dead-letter queue with the example's codes, each published copy refused once (a copy in flight
    at the kill or the restart may be refused twice: a refusal leaves no receipt); no delivery spent a second
    attempt."""
    stream = payment_stream()
    applied = stream.applied
    space.publish(stream.bodies, declare=[CONSUMER])

    # The first run in batches (killed with deliveries in flight), the second one delivery per transaction: the rest of
    # the stream then lasts seconds, long enough for the server's restart to land mid-stream.
    first = start_run(space, installed, backend, "--batch", "8", "--prefetch", "16")
    wait_until("a tenth of the receipts", lambda: backend.receipts() >= len(applied) // 10, procs=[first])
    kill(first, main_only=True)
    at_kill = backend.receipts()
    assert at_kill < len(applied), "the kill came after the stream was consumed"

    second = start_run(space, installed, backend, "--batch", "1", "--prefetch", "4", "--exit-when-idle", "2")
    if backend.restart is not None:
        wait_until("half of the receipts", lambda: backend.receipts() >= max(len(applied) // 2, at_kill + 1),
                   procs=[second])
        backend.restart()
        assert backend.receipts() < len(applied), "the restart came after the stream was consumed"
    done = second.until_idle(120)
    assert 0 == done.returncode, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    if backend.restart is not None:
        assert "database unusable" in done.stderr  # it did meet the restart, and waited for the server

    table = {row[0]: tuple(row[1:]) for row in backend.read(f"SELECT payment_id, {COLUMNS} FROM payments")}
    assert stream.rows == table
    assert dict.fromkeys(applied, "updated") == dict(backend.read("SELECT event_id, result FROM inbox"))
    assert [] == backend.read("SELECT key, attempts FROM deliveries WHERE attempts > 1")
    assert [] == backend.read("SELECT owner FROM in_flight")

    topo = space.topology(CONSUMER)
    assert 0 == space.count(topo.queue)
    dead = [(orjson.loads(body)["eventId"], (props.headers or {}).get("x-error-code"))
            for props, body in space.drain(topo.dead_queue)]
    rejected = backend.read("SELECT event_id, code FROM rejected")
    assert stream.refused == dict(dead) == dict(rejected)
    copies = stream.copies()
    for refusals in (Counter(e for e, _ in dead), Counter(e for e, _ in rejected)):
        assert [] == [e for e, n in refusals.items() if not copies[e] <= n <= copies[e] + 1]

    listed = orjson.loads(subprocess.run(
        [str(installed), "-m", "delivery_consumer", CONSUMER, "list", "--json", "--db", backend.db],
        cwd=space.workdir, env=space.env(), capture_output=True, check=True, timeout=120).stdout)
    assert {p: row[:-1] for p, row in stream.rows.items()} == {
        r["paymentId"]: (r["revision"], r["status"], r["amountCents"], r["currency"], r["capturedCents"],
                         r["refundedCents"], r["eventId"]) for r in listed}
