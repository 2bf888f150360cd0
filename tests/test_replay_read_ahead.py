"""Parsing ahead of the database changes nothing but speed.

``replay`` may parse several batches of bodies before applying the first
(``read_ahead``). For any stream -- duplicates, reused eventIds, stale
revisions, bodies that do not parse -- and any batch size, the outcomes,
their order, the number of transactions and every table must be those of
replay without read-ahead; and what came from a stream that is still open
is applied as soon as its batch is complete.
"""

from __future__ import annotations

import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer import replay as replay_lib
from delivery_consumer.consumers import get
from delivery_consumer.inbox import ConsumerDB
from delivery_consumer.inbox import apply as apply_module
from delivery_consumer.sources import Item

EVENT_IDS = [str(uuid.UUID(int=i + 1)) for i in range(8)]


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A catalog envelope from a small space (eventIds, articles and revisions collide), or a bad body."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from([b"{broken", b"[]", b'{"eventId": 1}']))
    return orjson.dumps({
        "eventId": draw(st.sampled_from(EVENT_IDS)), "type": "material.published",
        "articleId": draw(st.sampled_from(["a-1", "a-2", "a-3"])), "revision": draw(st.integers(1, 3)),
        "occurredAt": "2026-11-29T10:00:00Z",
        "data": {"title": draw(st.sampled_from(["one", "two"])), "url": "https://example.org/a"},
    })


def _run(workdir: Path, name: str, stream: list[bytes], batch: int, read_ahead: int) -> tuple[list[str], int, list]:
    """Replay *stream*; the outcomes, the number of transactions and the tables."""
    path = workdir / f"{name}.db"
    commits = 0
    original = apply_module.Transaction.__exit__

    def counting(self: apply_module.Transaction, *exc: object) -> None:
        nonlocal commits
        commits += 1
        original(self, *exc)  # type: ignore[arg-type]

    items = [Item(f"stream:{i + 1}", body) for i, body in enumerate(stream)]
    apply_module.Transaction.__exit__ = counting  # type: ignore[method-assign]
    try:
        with ConsumerDB.open(path, spec=get("catalog"), create=True) as db:
            outcomes = [outcome.status for _, outcome in
                        replay_lib.replay(db, items, batch=batch, read_ahead=read_ahead)]
    finally:
        apply_module.Transaction.__exit__ = original  # type: ignore[method-assign]
    conn = sqlite3.connect(path)
    try:
        tables = [conn.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall() for table in ("catalog",)]
        tables.append(conn.execute("SELECT rowid, event_id, fingerprint, result FROM inbox ORDER BY rowid").fetchall())
        tables.append(conn.execute("SELECT code, event_id, source FROM rejected ORDER BY id").fetchall())
    finally:
        conn.close()
    return outcomes, commits, tables


@settings(max_examples=60, deadline=None)
@given(stream=st.lists(bodies(), max_size=40), batch=st.integers(1, 7), read_ahead=st.integers(0, 30))
def test_read_ahead_gives_the_same_outcomes_commits_and_tables(stream: list[bytes], batch: int,
                                                              read_ahead: int) -> None:
    """Outcomes, their order, the transactions and the tables do not depend on read_ahead."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        assert _run(workdir, "ahead", stream, batch, read_ahead) == _run(workdir, "plain", stream, batch, 0)


def test_without_read_ahead_a_batch_is_applied_before_the_next_body_arrives(tmp_path: Path) -> None:
    """read_ahead=0 (stdin): each complete batch is applied while the stream is still open."""
    arrived = threading.Event()
    applied: list[str] = []

    def trickle() -> Iterator[Item]:
        for i, event_id in enumerate(EVENT_IDS[:4]):
            yield Item(f"stdin:{i + 1}", orjson.dumps({
                "eventId": event_id, "type": "material.published", "articleId": f"a-{i}", "revision": 1,
                "occurredAt": "2026-11-29T10:00:00Z", "data": {"title": "t", "url": "u"}}))
            # The next body "arrives" only once this one's outcome was yielded.
            assert arrived.wait(10), "the batch was not applied before more input was asked for"
            arrived.clear()

    with ConsumerDB.open(tmp_path / "stdin.db", spec=get("catalog"), create=True) as db:
        for _, outcome in replay_lib.replay(db, trickle(), batch=1, read_ahead=0):
            applied.append(outcome.status)
            arrived.set()
    assert applied == ["updated"] * 4
