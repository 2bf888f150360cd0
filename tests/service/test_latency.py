"""Latency without a broker: a commit wakes the dispatchers of its database
(outbox.wake), a lone delivery is applied at once, each event's age at
commit is observed and exported."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from outboxkit import Clock, FakePublisher, add, dispatcher, envelope
from support import new_event
from test_worker import Recorder, delivery, event_id, on_memory_link

from delivery_consumer import outbox
from delivery_consumer.amqp.topology import H_PRODUCED_MS
from delivery_consumer.model.deliveries import Observer
from delivery_consumer.model.errors import StoreUnavailable
from delivery_consumer.observability.metrics import Metrics
from delivery_consumer.outbox import wake
from delivery_consumer.outbox.db import SqliteDb
from delivery_consumer.service.settings import RunConfig
from delivery_consumer.service.worker import Worker
from delivery_consumer.store.sqlite import now_iso


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = outbox.connect(tmp_path / "producer.db")
    yield conn
    conn.close()


@pytest.fixture
def listener(db: sqlite3.Connection) -> Iterator[wake.Listener]:
    bound = wake.Listener.bind(wake.database_file(db) or "")
    assert bound is not None
    yield bound
    bound.close()


def test_nobody_listening_is_no_error(db: sqlite3.Connection) -> None:
    """A commit with no dispatcher on the host tells nobody and succeeds."""
    with outbox.transaction(db):
        assert outbox.enqueue(db, new_event())
    assert 0 == outbox.notify(db)
    assert 1 == db.execute("SELECT count(*) FROM outbox").fetchone()[0]


def test_a_commit_that_enqueued_wakes_the_dispatcher(db: sqlite3.Connection, listener: wake.Listener) -> None:
    """outbox.transaction wakes the listener after a COMMIT that enqueued, and only then."""
    with outbox.transaction(db):
        db.execute("CREATE TABLE mine (x)")  # the producer's own change, no event
    assert 0 == listener.drain()
    with pytest.raises(RuntimeError), outbox.transaction(db):
        outbox.enqueue(db, new_event())
        raise RuntimeError("the producer gives up")
    assert 0 == listener.drain(), "a rolled back transaction must not wake anybody"
    with outbox.transaction(db):
        outbox.enqueue(db, new_event())
    assert 1 == listener.drain()
    assert 0 == listener.drain()


def test_a_producer_that_commits_itself_calls_notify(db: sqlite3.Connection, listener: wake.Listener) -> None:
    """enqueue inside the producer's own BEGIN ... COMMIT wakes nobody by itself; notify after the COMMIT does."""
    db.execute("BEGIN IMMEDIATE")
    outbox.enqueue(db, new_event())
    db.execute("COMMIT")
    assert 0 == listener.drain()
    assert 1 == outbox.notify(db)
    assert 1 == listener.drain()


def test_every_dispatcher_of_the_database_is_woken_up_to_the_slots(db: sqlite3.Connection) -> None:
    """SLOTS listeners of one database are all woken; one more gets no slot (it polls); a closed one frees its slot."""
    path = wake.database_file(db) or ""
    listeners = [wake.Listener.bind(path) for _ in range(wake.SLOTS)]
    try:
        assert all(listeners) and sorted(x.slot for x in listeners if x) == list(range(wake.SLOTS))
        assert wake.Listener.bind(path) is None
        assert wake.SLOTS == outbox.notify(db)
        assert [1] * wake.SLOTS == [x.drain() for x in listeners if x]
        first = listeners.pop(0)
        assert first is not None
        first.close()
        again = wake.Listener.bind(path)
        assert again is not None and 0 == again.slot
        listeners.append(again)
    finally:
        for x in listeners:
            if x:
                x.close()


def test_the_name_follows_the_file_not_its_spelling(tmp_path: Path, db: sqlite3.Connection,
                                                    listener: wake.Listener) -> None:
    """The same database reached through a symlink wakes the same listener; another database does not."""
    link = tmp_path / "link"
    link.mkdir()
    (link / "same.db").symlink_to(tmp_path / "producer.db")
    assert wake.addresses(link / "same.db") == wake.addresses(tmp_path / "producer.db")
    other = outbox.connect(tmp_path / "other.db")
    try:
        with outbox.transaction(other):
            outbox.enqueue(other, new_event())
        assert 0 == listener.drain()
    finally:
        other.close()
    assert 1 == wake.notify_path(link / "same.db")
    assert 1 == listener.drain()


def test_the_slot_of_a_killed_dispatcher_is_free_at_once(db: sqlite3.Connection) -> None:
    """After kill -9 of a process holding slot 0 nothing is left behind: the slot binds again at once."""
    path = wake.database_file(db) or ""
    code = ("import sys, time; from delivery_consumer.outbox import wake; "
            "l = wake.Listener.bind(sys.argv[1]); print(l.slot, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "0" == proc.stdout.readline().strip()
        assert 1 == outbox.notify(db)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 0 == outbox.notify(db)
    again = wake.Listener.bind(path)
    assert again is not None and 0 == again.slot
    again.close()


def test_a_wake_up_never_blocks_the_producer(db: sqlite3.Connection, listener: wake.Listener) -> None:
    """A listener that never reads fills its queue; commits go on, their notify returns at once."""
    for _ in range(200):
        with outbox.transaction(db):
            outbox.enqueue(db, new_event())
    assert 200 == db.execute("SELECT count(*) FROM outbox").fetchone()[0]
    assert 1 == outbox.notify(db)  # its queue is full: it has wake-ups waiting, so it counts as told
    assert listener.drain() >= 1


def test_the_write_lock_is_waited_for_within_the_busy_timeout(tmp_path: Path) -> None:
    """outbox.transaction waits for another connection's write lock (retrying finely), then fails busy after the
    busy timeout, leaving the connection's busy timeout as it was."""
    path = tmp_path / "p.db"
    holder = outbox.connect(path)
    waiter = outbox.connect(path, busy_timeout_ms=200)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable) as caught, outbox.transaction(waiter):
            pass
        assert "locked" in str(caught.value) or "busy" in str(caught.value)
        assert 200 == waiter.execute("PRAGMA busy_timeout").fetchone()[0]
        holder.execute("COMMIT")
        with outbox.transaction(waiter):
            outbox.enqueue(waiter, new_event())
        assert not waiter.in_transaction
    finally:
        holder.close()
        waiter.close()


def created_ms(stamp: str) -> int | None:
    conn = sqlite3.connect(":memory:")
    try:
        row = conn.execute(f"SELECT {SqliteDb.created_ms_sql} FROM (SELECT ? AS created_at)", (stamp,)).fetchone()
        return None if row[0] is None else int(row[0])
    finally:
        conn.close()


@given(st.floats(min_value=0, max_value=4102444800, allow_nan=False))
def test_the_produced_stamp_is_the_rows_created_at_in_milliseconds(when: float) -> None:
    """x-produced-ms is created_at (now_iso, to the millisecond) read back as an independent parser reads it."""
    stamp = now_iso(when)
    ms = created_ms(stamp)
    assert ms == round(datetime.fromisoformat(stamp).timestamp() * 1000)
    assert ms is not None and abs(ms - when * 1000) <= 1


def test_anything_else_is_no_stamp() -> None:
    """A created_at that is not a time gives no header rather than a wrong one."""
    assert created_ms("") is None
    assert created_ms("yesterday") is None
    assert created_ms("2026-12-02T10:00:00Z") == 1796205600000


# -- run's side: a lone delivery, and ages at commit --


class Ages(Observer):
    """Records the ages the worker reports."""

    wants_ages = True

    def __init__(self) -> None:
        self.ages: list[tuple[str, float]] = []

    def event_ages(self, stamp: str, seconds: Sequence[float]) -> None:
        self.ages.extend((stamp, s) for s in seconds)


def started_worker(tmp_path: Path, observer: Observer | None = None, **options: object) -> tuple[Worker, Recorder]:
    config = RunConfig(consumer="catalog", url="memory:", db_path=tmp_path / "catalog.db",
                       **options)  # type: ignore[arg-type]
    worker = Worker(config, observer)
    assert worker.open(), worker.error
    io = on_memory_link(worker)
    worker.start()
    return worker, io


def stop(worker: Worker) -> None:
    worker.stop_requested.set()
    worker.join(10)
    assert not worker.is_alive() and worker.error is None


def test_a_lone_delivery_is_applied_and_acked_without_waiting_for_a_batch(tmp_path: Path) -> None:
    """With batches of 250 and a batch wait of a minute, one delivery arriving alone is committed and acked
    at once: the ack comes while the worker would still be waiting for the batch to fill."""
    worker, io = started_worker(tmp_path, batch=250, batch_wait_ms=60_000)
    try:
        lone = delivery(1)
        given_at = time.monotonic()
        worker.deliver(lone)
        io.wait_for(lambda: len(io.acks()) == 1, timeout=50)
        assert time.monotonic() - given_at < 60, "the ack waited for the batch wait"
        ack = io.acks()[0]
        assert (1, True) == (ack.tag, ack.multiple) and {event_id(lone)} == ack.receipts
        second = delivery(2)  # and the next one too, alone again
        worker.deliver(second)
        io.wait_for(lambda: len(io.acks()) == 2, timeout=50)
        assert event_id(second) in io.acks()[1].receipts
    finally:
        stop(worker)


def test_deliveries_waiting_together_still_make_one_batch(tmp_path: Path) -> None:
    """Deliveries already received when a batch begins go in that batch: batching is not lost."""
    worker, io = started_worker(tmp_path, batch=250, batch_wait_ms=60_000)
    try:
        worker.deliver_all([delivery(tag) for tag in range(1, 51)])
        io.wait_for(lambda: sum(1 for a in io.acks() if a.tag == 50) == 1, timeout=50)
        assert [50] == [a.tag for a in io.acks()]
    finally:
        stop(worker)


def test_ages_at_commit_come_from_the_producers_stamp_else_occurred_at(tmp_path: Path) -> None:
    """Each applied event's age is measured from x-produced-ms when present, else from occurredAt; a rejected
    delivery has no age (it never takes effect)."""
    ages = Ages()
    worker, io = started_worker(tmp_path, ages)
    try:
        produced_ms = int(time.time() * 1000) - 1500
        stamped = delivery(1, headers={H_PRODUCED_MS: produced_ms})
        old = new_event(article_id="old", occurred_at="2026-01-01T00:00:00Z")
        unstamped = delivery(2, orjson.dumps(old), message_id=old["eventId"])
        rejected = delivery(3, b"{not json", headers={H_PRODUCED_MS: produced_ms})
        worker.deliver_all([stamped, unstamped, rejected])
        io.wait_for(lambda: bool(io.acks()) and io.acks()[-1].tag == 3, timeout=50)
    finally:
        stop(worker)
    by_stamp = dict(ages.ages)
    assert 2 == len(ages.ages) and {"produced", "occurred"} == set(by_stamp)
    assert 1.5 <= by_stamp["produced"] < 60
    assert by_stamp["occurred"] > 24 * 3600


def test_the_age_histogram_is_exported() -> None:
    """Metrics.event_ages feeds delivery_event_age_seconds{stamp} with each age."""
    m = Metrics("catalog")
    m.event_ages("produced", [0.004, 0.03, 2.0])
    text = m.text()
    assert 'delivery_event_age_seconds_count{consumer="catalog",stamp="produced"} 3.0' in text
    assert 'delivery_event_age_seconds_bucket{consumer="catalog",le="0.005",stamp="produced"} 1.0' in text
    assert 'delivery_event_age_seconds_bucket{consumer="catalog",le="0.05",stamp="produced"} 2.0' in text


def test_each_message_carries_its_rows_creation_in_milliseconds(db: sqlite3.Connection) -> None:
    """The dispatcher stamps x-produced-ms = the row's created_at in ms on every message it sends."""
    ids = add(db, envelope("a-1"), envelope("a-2", revision=1))
    pub = FakePublisher()
    d = dispatcher(db, pub, Clock())
    assert 2 == d.step()
    created = dict(db.execute("SELECT event_id, created_at FROM outbox").fetchall())
    sent = {m.message_id: (m.headers or {}).get(H_PRODUCED_MS) for m in pub.sent}
    assert {i: round(datetime.fromisoformat(created[i]).timestamp() * 1000) for i in ids} == sent
