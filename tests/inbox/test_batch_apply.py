"""The optimistic batch and the per-event path give the same outcomes and the same database.

``Transaction.apply_many`` applies a batch without savepoints (the catalog
with its own ``apply_many``, other consumers with ``apply`` in turn) and
falls back to the per-event path (a savepoint per event) when an event
fails. Whatever the events -- duplicates, eventIds reused with another body,
stale revisions, revision conflicts, parse rejections, effects that raise --
the outcomes and every table (rowids included, receipt times excluded) must
equal those of the per-event path applied to the same batches.
"""

from __future__ import annotations

import sqlite3
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer import consumers
from delivery_consumer.consumers import register, unregister
from delivery_consumer.inbox import ConsumerDB, apply_batch
from delivery_consumer.model.contract import ConsumerSpec, Outcome
from delivery_consumer.model.envelope import Envelope, from_mapping
from delivery_consumer.model.errors import INVALID_ENVELOPE, Rejection, TransientError

EVENT_IDS = [str(uuid.UUID(int=i + 1)) for i in range(6)]


def _moody_apply(conn: sqlite3.Connection, env: Envelope) -> str:
    """An effect without ``apply_many`` that writes, then fails as its title asks."""
    conn.execute("INSERT INTO moody (event_id, title) VALUES (?, ?)", (env.event_id, env.data["title"]))
    if env.data["title"] == "reject":
        raise Rejection("moody-refused", "the title asks for a rejection", event_id=env.event_id)
    if env.data["title"] == "transient":
        raise TransientError("the title asks for a retry", code="dependency-down")
    if env.data["title"] == "bug":
        raise KeyError("a bug in the effect")
    return "recorded"


MOODY = ConsumerSpec(
    name="moody-batch-test",
    apply=_moody_apply,
    migrations=("CREATE TABLE moody (id INTEGER PRIMARY KEY, event_id TEXT NOT NULL, title TEXT NOT NULL) STRICT;",),
)

TITLES = {
    "catalog": ["Доставка без потерь", "Inbox в SQLite"],
    MOODY.name: ["fine", "also fine", "reject", "transient", "bug"],
}


@st.composite
def items(draw: st.DrawFn, consumer: str) -> Envelope | Rejection:
    """An envelope from a small space (so that eventIds, articles and revisions collide), or a parse rejection."""
    if draw(st.integers(0, 9)) == 0:
        return Rejection(INVALID_ENVELOPE, "body is 2000000 bytes, over the limit of 1048576")
    return from_mapping({
        "eventId": draw(st.sampled_from(EVENT_IDS)),
        "type": draw(st.sampled_from(["material.published", "material.withdrawn"])),
        "articleId": draw(st.sampled_from(["article-1", "article-2"])),
        "revision": draw(st.integers(1, 3)),
        "occurredAt": "2026-11-29T10:00:00Z",
        "data": {"title": draw(st.sampled_from(TITLES[consumer])), "url": "https://example.org/a/1"},
    })


def per_event(db: ConsumerDB, batch: Sequence[Envelope | Rejection]) -> list[Outcome]:
    """The reference: one transaction, a savepoint per event, rejections recorded in order."""
    with db.transaction() as tx:
        envs = [item for item in batch if not isinstance(item, Rejection)]
        if len(envs) > 1:
            tx.prefetch(envs)
        outcomes = [Outcome(i.event_id, rejection=i) if isinstance(i, Rejection) else tx.apply(i) for i in batch]
        for outcome in outcomes:
            if outcome.rejection is not None:
                tx.record_rejection(outcome.rejection)
    return outcomes


def _answers(outcomes: list[Outcome]) -> list[tuple[Any, ...]]:
    return [
        (o.event_id, o.status, o.rejection.reason if o.rejection else None,
         str(o.transient) if o.transient else None)
        for o in outcomes
    ]


def _state(db: ConsumerDB, table: str) -> dict[str, list[tuple[Any, ...]]]:
    conn = db.conn
    return {
        "inbox": conn.execute("SELECT rowid, event_id, fingerprint, result, event_type FROM inbox").fetchall(),
        "rejected": conn.execute(
            "SELECT id, code, reason, event_id, fingerprint, body_sha256, source, attempts FROM rejected"
        ).fetchall(),
        table: conn.execute(f"SELECT rowid, * FROM {table}").fetchall(),
    }


def _check(consumer: str, table: str, events: list[Envelope | Rejection], sizes: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        optimistic = consumers.open_db(Path(tmp) / "a.db", consumer, create=True)
        reference = consumers.open_db(Path(tmp) / "b.db", consumer, create=True)
        try:
            start = 0
            for size in sizes:
                batch = events[start:start + size]
                start += size
                if not batch:
                    break
                assert _answers(per_event(reference, batch)) == _answers(apply_batch(optimistic, batch))
            assert _state(reference, table) == _state(optimistic, table)
        finally:
            optimistic.close()
            reference.close()


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_catalog_batch_equals_per_event_path(data: st.DataObject) -> None:
    """Catalog: the optimistic batch (its apply_many) answers and writes exactly what the per-event path does."""
    events = data.draw(st.lists(items("catalog"), min_size=1, max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=40))
    _check("catalog", "catalog", events, sizes)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_generic_batch_equals_per_event_path(data: st.DataObject) -> None:
    """A consumer without apply_many whose effect writes then fails: the same outcomes and state as per event."""
    register(MOODY, replace=True)
    try:
        events = data.draw(st.lists(items(MOODY.name), min_size=1, max_size=30))
        sizes = data.draw(st.lists(st.integers(1, 10), min_size=1, max_size=30))
        _check(MOODY.name, "moody", events, sizes)
    finally:
        unregister(MOODY.name)
