"""A consumer of a declared non-material type end to end: outbox -> dispatch -> RabbitMQ -> run,
unpartitioned and partitioned, with its meta recorded and each event applied once."""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import orders_consumer
import orjson
import pytest
from brokerkit import Namespace
from partitionkit import Cluster
from support import count_rows, read_rows, wait_until

from delivery_consumer import outbox
from delivery_consumer.amqp.partitions import partition_of

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(autouse=True)
def _plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CLI process of the test loads the orders consumer (ns.env copies the environment)."""
    monkeypatch.setenv("DELIVERY_PLUGINS", "orders_consumer")


def order_events(count: int, orders: int, seed: int = 3) -> list[dict[str, Any]]:
    """*count* order events over *orders* orders, revisions increasing per order, some with meta."""
    rng = random.Random(seed)
    revisions: dict[str, int] = {}
    events = []
    for i in range(count):
        order = f"order-{rng.randrange(orders)}"
        revisions[order] = revisions.get(order, 0) + 1
        event: dict[str, Any] = {
            "eventId": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "type": "order.placed" if revisions[order] == 1 else "order.changed",
            "orderId": order, "revision": revisions[order], "occurredAt": "2026-11-29T10:00:00Z",
            "data": {"status": rng.choice(["placed", "paid", "shipped"]), "totalCents": rng.randrange(10_000)},
        }
        if i % 3 == 0:
            event["meta"] = {"correlationId": f"req-{i}", "traceparent": TRACEPARENT}
        events.append(event)
    return events


def latest(events: list[dict[str, Any]]) -> list[tuple[str, int, str, int]]:
    last: dict[str, dict[str, Any]] = {}
    for e in events:
        last[e["orderId"]] = e
    return sorted((k, e["revision"], e["data"]["status"], e["data"]["totalCents"]) for k, e in last.items())


def enqueue_all(db: Path, events: list[dict[str, Any]]) -> None:
    """The producer's transactions: each event enqueued with the consumer's declared types (twice: a no-op)."""
    conn = outbox.connect(db)
    try:
        for e in events:
            with outbox.transaction(conn):
                assert outbox.enqueue(conn, e, types=orders_consumer.TYPES)
                assert not outbox.enqueue(conn, {**e, "meta": {"correlationId": "retry"}}, types=orders_consumer.TYPES)
    finally:
        conn.close()


def test_outbox_dispatch_run_applies_each_order_event_once(ns: Namespace) -> None:
    """Order events enqueued, dispatched and consumed by run: the latest revision of each order, one receipt
    per event with its meta, and the slot headers computed from orderId."""
    events = order_events(120, orders=15)
    db = ns.workdir / "producer.db"
    enqueue_all(db, events)
    sent = ns.cli("dispatch", "--db", str(db), "--consumer", "orders", "--exit-when-idle", "500ms",
                  "--poll", "50ms")
    assert 0 == sent.returncode, sent.stderr[-2000:]
    assert "120 published" in sent.stderr

    done = ns.run_until_idle("orders", idle=1.0)
    assert 0 == done.returncode, done.stderr[-2000:]
    inbox = ns.db("orders")
    assert latest(events) == read_rows(inbox, "orders", "order_id, revision, status, total_cents")
    receipts = dict(read_rows(inbox, "inbox", "event_id, meta"))
    assert set(receipts) == {e["eventId"] for e in events}
    with_meta = [e for e in events if "meta" in e]
    assert all(orjson.loads(receipts[e["eventId"]]) == e["meta"] for e in with_meta)
    assert all(receipts[e["eventId"]] is None for e in events if "meta" not in e)
    traced = ns.cli("trace", "--consumer", "orders", "--db", str(inbox), with_meta[0]["eventId"])
    assert 0 == traced.returncode, traced.stderr
    assert f"meta.traceparent:   {TRACEPARENT}" in traced.stdout


def test_a_partitioned_run_keeps_each_order_in_its_partition(ns: Namespace) -> None:
    """Dispatched order events reach the partition of their orderId's slot, each applied once there."""
    cluster = Cluster(ns, "orders", 2)
    cluster.declare()
    try:
        events = order_events(80, orders=12, seed=5)
        db = ns.workdir / "producer.db"
        enqueue_all(db, events)
        for k in range(2):
            cluster.start(k)
        sent = ns.cli("dispatch", "--db", str(db), "--exit-when-idle", "500ms", "--poll", "50ms")
        assert 0 == sent.returncode, sent.stderr[-2000:]
        wait_until("every event applied", lambda: cluster.receipts() == len(events), 120, cluster.procs)
        rows = []
        for k in range(2):
            for event_id, key in read_rows(cluster.db(k), "inbox", "event_id, partition_key"):
                assert partition_of(key, 2) == k, (event_id, key, k)
            part = read_rows(cluster.db(k), "orders", "order_id, revision, status, total_cents")
            assert all(partition_of(row[0], 2) == k for row in part)
            rows += part
        assert latest(events) == sorted(rows)
        assert count_rows(cluster.db(0), "rejected") + count_rows(cluster.db(1), "rejected") == 0
    finally:
        cluster.stop()
        cluster.delete()
