"""The test kit (delivery_consumer.testing): a user's consumer driven in memory through run's own worker and the
real store -- envelopes and CloudEvents in both modes, redeliveries, a crash between commit and ack, retries
through the tiers on a virtual clock and dead letters -- with results, receipts and tables to assert on."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from delivery_consumer import Consumer, Event, consumers, event_type
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.errors import ConfigError, Rejection, TransientError
from delivery_consumer.model.state import RevisionTable
from delivery_consumer.testing import ACKED, DEAD_LETTERED, RETRIED, ConsumerHarness, HarnessError

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Shipped:
    parcels: int
    carrier: str = "post"


TABLE = RevisionTable("shipments", key="order_id", state=("parcels", "carrier"))
CALLS: Counter[str] = Counter()  # effect calls per eventId: outside the database, so a rollback keeps them


def shipments() -> ConsumerSpec:
    """A consumer of its own typed events; parcels 0 is refused, 99 fails transiently (forever), 7 twice."""
    consumer = Consumer("shipments", types=[event_type("order.shipped", Shipped, key="orderId")],
                        migrations=("""CREATE TABLE shipments (order_id TEXT PRIMARY KEY, revision INTEGER NOT NULL,
                                       parcels INTEGER NOT NULL, carrier TEXT NOT NULL, event_id TEXT NOT NULL,
                                       occurred_at TEXT NOT NULL) STRICT;""",),
                        tables=("shipments",), checks=(TABLE.check,))

    @consumer.on("order.shipped")
    def shipped(conn: sqlite3.Connection, event: Event[Shipped]) -> str:
        CALLS[event.event_id] += 1
        if event.data.parcels == 0:
            raise Rejection("nothing-shipped", "no parcel")
        if event.data.parcels == 99 or (event.data.parcels == 7 and CALLS[event.event_id] <= 2):
            raise TransientError("the carrier's API is down", code="carrier-down")
        return TABLE.apply(conn, event.envelope, (event.data.parcels, event.data.carrier))

    return consumer.spec


@pytest.fixture
def kit(consumer_harness: Callable[..., ConsumerHarness]) -> ConsumerHarness:
    """The shipments consumer in memory, with short retry tiers."""
    CALLS.clear()
    return consumer_harness(shipments(), retry_delays_ms=(1_000, 60_000), max_attempts=3)


def test_envelopes_and_cloudevents_are_applied_once_and_answered_from_their_receipts(kit: ConsumerHarness) -> None:
    """An envelope, a structured CloudEvent and a binary one (each binding's prefix) are applied; each sent again
    is a duplicate; a late revision is stale; the rows, receipts and results say so."""
    first = kit.event("order.shipped", "order-1", Shipped(2), revision=2)
    late = kit.event("order.shipped", "order-1", Shipped(1), revision=1)
    structured = kit.cloudevent("order.shipped", "order-2", Shipped(3, "dhl"), revision=1, id="ship-2")
    binary = kit.cloudevent("order.shipped", "order-3", Shipped(4), revision=1, mode="binary", prefix="ce-",
                            time=1796205600123)
    run = kit.deliver(first, late, structured, binary, first, structured, binary)
    assert not run.crashed
    assert [("updated", ACKED), ("stale", ACKED), ("updated", ACKED), ("updated", ACKED),
            ("duplicate:updated", ACKED), ("duplicate:updated", ACKED), ("duplicate:updated", ACKED)] == [
        (d.status, d.fate) for d in run.deliveries]
    assert [("order-1", 2, 2), ("order-2", 1, 3), ("order-3", 1, 4)] == [
        (r["order_id"], r["revision"], r["parcels"]) for r in kit.rows("shipments")]
    receipt = kit.receipt(structured.event_id or "")
    assert receipt is not None and {"id": "ship-2", "source": "/tests"} == receipt["cloudEvent"]
    assert ["2026-12-02T10:00:00.123Z"] == [r["occurred_at"] for r in kit.rows("shipments", "order_id = ?", "order-3")]
    assert {first["eventId"]: 1, structured.event_id: 1, binary.event_id: 1} == {
        k: CALLS[k] for k in (first["eventId"], structured.event_id, binary.event_id) if k}


def test_a_transient_failure_goes_through_the_tiers_on_the_virtual_clock(kit: ConsumerHarness) -> None:
    """A handler failing twice transiently is retried through the two tiers (the virtual clock moves by their
    delays, the test does not wait) and applied at its third attempt; one failing every time is dead-lettered
    retries-exhausted after max_attempts, its rejection recorded with the event's key."""
    flaky = kit.event("order.shipped", "order-7", Shipped(7), revision=1)
    doomed = kit.event("order.shipped", "order-9", Shipped(99), revision=1)
    run = kit.deliver(flaky, doomed)
    assert [(1, RETRIED), (2, RETRIED), (3, ACKED)] == [(d.attempt, d.fate) for d in run.of(flaky["eventId"])]
    assert "updated" == run.last(flaky["eventId"]).status
    assert [(1, RETRIED), (2, RETRIED), (3, DEAD_LETTERED)] == [(d.attempt, d.fate) for d in run.of(doomed["eventId"])]
    assert "retries-exhausted" == run.last(doomed["eventId"]).code
    assert run.clock_ms >= 61_000  # both tiers passed, on the virtual clock
    (dead,) = kit.dead
    assert (doomed["eventId"], "retries-exhausted", 3) == (dead.event_id, dead.code, dead.attempts)
    assert "carrier-down after 3 attempts" in dead.reason
    assert [("retries-exhausted", "order-9", 3)] == [(r["code"], r["partitionKey"], r["attempts"])
                                                     for r in kit.rejections()]


def test_a_consumers_rejection_is_dead_lettered_with_its_code(kit: ConsumerHarness) -> None:
    """A Rejection the handler raises with its own code is dead-lettered at once under that code, with the
    event's id, and the events around it are applied."""
    refused = kit.event("order.shipped", "order-0", Shipped(0), revision=1)
    run = kit.deliver(kit.event("order.shipped", "order-1", Shipped(1), revision=1), refused)
    last = run.last(refused["eventId"])
    assert ("nothing-shipped", DEAD_LETTERED, 1) == (last.code, last.fate, last.attempt)
    assert [(refused["eventId"], "nothing-shipped")] == [(d.event_id, d.code) for d in kit.dead]
    assert ["order-1"] == [r["order_id"] for r in kit.rows("shipments")]


@pytest.mark.parametrize("crash_at", ["after-commit", "before-commit"])
def test_a_crash_between_commit_and_ack_applies_each_event_once(kit: ConsumerHarness, crash_at: str) -> None:
    """A process that dies after its commit and before its ack leaves the batch unacked: the next run gets it
    redelivered and answers each event from its receipt, applying nothing twice. One that dies before the commit
    leaves nothing committed: the next run applies the batch."""
    events = [kit.event("order.shipped", f"order-{i}", Shipped(i + 1), revision=1) for i in range(3)]
    died = kit.deliver(*events, crash_at=crash_at)
    assert died.crashed and [] == died.deliveries and 3 == kit.waiting
    committed = 3 if crash_at == "after-commit" else 0
    assert committed == len(kit.rows("shipments"))
    again = kit.run()
    assert not again.crashed and 0 == kit.waiting
    expected = "duplicate:updated" if crash_at == "after-commit" else "updated"
    assert [(expected, True)] * 3 == [(d.status, d.redelivered) for d in again.deliveries]
    assert 3 == len(kit.rows("shipments"))
    calls = 1 if crash_at == "after-commit" else 2  # before the commit, its first call was rolled back
    assert [calls] * 3 == [CALLS[e["eventId"]] for e in events]


def test_a_redelivery_is_answered_from_the_receipt(kit: ConsumerHarness) -> None:
    """A message the broker gives back (redelivered) after it was applied is a duplicate, marked redelivered."""
    shipped = kit.event("order.shipped", "order-1", Shipped(1), revision=1)
    kit.deliver(shipped)
    run = kit.deliver(shipped, redelivered=True)
    assert [("duplicate:updated", True)] == [(d.status, d.redelivered) for d in run.deliveries]
    assert 1 == CALLS[shipped["eventId"]]


def test_mistakes_are_one_line_each(consumer_harness: Callable[..., ConsumerHarness]) -> None:
    """A type the consumer does not bind, an undeclared type, an unknown option and an unknown crash point are
    each a HarnessError saying so; a table the consumer's check refuses stops the harness at its start."""
    kit = consumer_harness(shipments())
    with pytest.raises(HarnessError, match="reaches no queue of shipments"):
        kit.publish({"type": "invoice.sent", "eventId": "x"})
    with pytest.raises(HarnessError, match="is not a type of shipments"):
        kit.event("order.lost", "o-1")
    with pytest.raises(HarnessError, match="crash_at 'somewhere'"):
        kit.run(crash_at="somewhere")
    with pytest.raises(HarnessError, match="not options of a run here: colour"):
        consumer_harness(shipments(), colour="red")
    wrong = shipments()
    broken = ConsumerSpec(wrong.name, wrong.apply, ("CREATE TABLE shipments (order_id TEXT) STRICT;",),
                          event_types=wrong.event_types, binding_keys=wrong.binding_keys, checks=wrong.checks)
    with pytest.raises(ConfigError, match="RevisionTable shipments: no column revision"):
        consumer_harness(broken)


def test_the_registry_is_given_back(tmp_path: Path, register: Callable[[ConsumerSpec], ConsumerSpec]) -> None:
    """A harness of a spec registers it for its life, and gives the name back to the spec registered before."""
    before = register(shipments())
    mine = shipments()
    with ConsumerHarness(mine, tmp_path / "s.db"):
        assert consumers.registered("shipments") is mine
    assert consumers.registered("shipments") is before


def test_the_fixture_is_there_by_the_entry_point(tmp_path: Path) -> None:
    """In a project that only installed delivery-consumer, pytest offers the consumer_harness fixture (the
    pytest11 entry point): no conftest, no pytest_plugins."""
    (tmp_path / "test_mine.py").write_text(
        "from delivery_consumer.testing import ConsumerHarness\n\n\n"
        "def test_it(consumer_harness):\n"
        "    kit = consumer_harness('audit')\n"
        "    assert isinstance(kit, ConsumerHarness)\n"
        "    run = kit.deliver(kit.event('material.published', 'a-1', {'title': 'T', 'url': 'u'}, revision=1))\n"
        "    assert ['recorded'] == [d.status for d in run.deliveries]\n", "utf-8")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
