"""``trace``'s ``firstAt`` is the first delivery's time even when a later
duplicate is what writes the event's first ``deliveries`` row (``run`` writes
none for a first delivery applied fresh: its receipt records it)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import test_worker
from support import body, new_event, read_rows, wait_until
from test_worker import Recorder, delivery

from delivery_consumer import consumers
from delivery_consumer.inbox import history as trace
from delivery_consumer.service.worker import Worker
from delivery_consumer.store.sqlite import now_iso

make_worker = test_worker.make_worker  # the fixture: an opened worker on a fresh database


def test_a_duplicate_keeps_the_first_delivery_time(make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """A redelivered duplicate, handled after the clock moved on, leaves firstAt at the
    receipt's time (the first delivery) and lastAt at its own; two deliveries in all."""
    worker, _io = make_worker()
    assert worker.db is not None
    event = new_event()
    first = delivery(1, body(event), message_id=event["eventId"])
    worker.process([first])
    ((received_at,),) = read_rows(worker.db.path, "inbox", "received_at")
    assert [] == read_rows(worker.db.path, "deliveries")  # the receipt stands for it
    wait_until("the clock to move past the receipt", lambda: now_iso() > received_at)
    worker.process([delivery(2, first.body, message_id=first.message_id, redelivered=True)])

    ((first_at, last_at),) = read_rows(worker.db.path, "deliveries", "first_at, last_at")
    assert (received_at, True) == (first_at, last_at > received_at)
    with consumers.open_db(worker.db.path, readonly=True) as db:
        shown = trace.trace(db, event["eventId"])["deliveries"]
    assert (received_at, last_at, 2) == (shown["firstAt"], shown["lastAt"], shown["deliveries"])


def test_trace_mends_a_row_an_older_release_wrote(tmp_path: Path,
                                                 make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """A deliveries row written by 0.1.0 with the duplicate's time as first_at: trace
    still reports the receipt's earlier time as firstAt."""
    worker, _io = make_worker()
    assert worker.db is not None
    event = new_event()
    first = delivery(1, body(event), message_id=event["eventId"])
    worker.process([first])
    worker.process([delivery(2, first.body, message_id=first.message_id, redelivered=True)])
    ((received_at,),) = read_rows(worker.db.path, "inbox", "received_at")
    with sqlite3.connect(worker.db.path) as conn:
        conn.execute("UPDATE deliveries SET first_at = ?1, last_at = ?1", ("2999-01-01T00:00:00.000Z",))
    conn.close()
    with consumers.open_db(worker.db.path, readonly=True) as db:
        shown = trace.trace(db, event["eventId"])["deliveries"]
    assert (received_at, "2999-01-01T00:00:00.000Z") == (shown["firstAt"], shown["lastAt"])
