"""Parsing ahead of the database changes nothing but speed.

``replay`` may parse several batches of bodies before applying the first
(``read_ahead``), or, for large batches, parse the next batch in a thread
while the current one commits. For any stream -- duplicates, reused
eventIds, stale revisions, bodies that do not parse -- and any batch size,
the outcomes, their order, the number of transactions and every table must
be those of replay without either; what came from a stream that is still
open is applied as soon as its batch is complete; an error reading the
source reaches the caller after the batches before it; and no parsing
thread outlives the replay.
"""

from __future__ import annotations

import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer.consumers import get
from delivery_consumer.inbox import ConsumerDB
from delivery_consumer.inbox import apply as apply_module
from delivery_consumer.model.errors import TransientError
from delivery_consumer.ops import replay as replay_lib
from delivery_consumer.ops.sources import Item
from delivery_consumer.store.sqlite import DATABASE_BUSY

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


@contextmanager
def _parse_in_thread(from_batch: int) -> Iterator[None]:
    """Replay parses in a thread from batches of *from_batch* events on."""
    original = replay_lib.PARSE_AHEAD_MIN_BATCH
    replay_lib.PARSE_AHEAD_MIN_BATCH = from_batch
    try:
        yield
    finally:
        replay_lib.PARSE_AHEAD_MIN_BATCH = original


def _no_parse_thread_left() -> None:
    """Every parsing thread replay started has ended (each is joined: it ends
    right after handing over its last batch)."""
    for thread in threading.enumerate():
        if thread.name == "replay-parse":
            thread.join(10)
            assert not thread.is_alive(), "a parsing thread outlived its replay"


def _catalog_body(event_id: str, article: str) -> bytes:
    return orjson.dumps({
        "eventId": event_id, "type": "material.published", "articleId": article, "revision": 1,
        "occurredAt": "2026-11-29T10:00:00Z", "data": {"title": "t", "url": "u"}})


def _run(workdir: Path, name: str, stream: list[bytes], batch: int, read_ahead: int,
         thread_from: int = 1 << 30) -> tuple[list[str], int, list]:
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
        with _parse_in_thread(thread_from), ConsumerDB.open(path, spec=get("catalog"), create=True) as db:
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


@settings(max_examples=60, deadline=None)
@given(stream=st.lists(bodies(), max_size=40), batch=st.integers(1, 7))
def test_parsing_in_a_thread_gives_the_same_outcomes_commits_and_tables(stream: list[bytes], batch: int) -> None:
    """Outcomes, their order, the transactions and the tables are those of replay parsing in turn."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        threaded = _run(workdir, "thread", stream, batch, 1, thread_from=1)
        assert threaded == _run(workdir, "plain", stream, batch, 0)
    _no_parse_thread_left()


def test_standard_input_is_never_read_in_a_thread(tmp_path: Path) -> None:
    """read_ahead=0 (stdin, which may block): no parsing thread, at a batch size that would use one."""
    threads: list[bool] = []

    def watched() -> Iterator[Item]:
        for i, event_id in enumerate(EVENT_IDS[:6]):
            threads.append(threading.current_thread() is threading.main_thread())
            yield Item(f"stdin:{i + 1}", _catalog_body(event_id, f"a-{i}"))

    with _parse_in_thread(2), ConsumerDB.open(tmp_path / "t.db", spec=get("catalog"), create=True) as db:
        outcomes = [outcome.status for _, outcome in replay_lib.replay(db, watched(), batch=2, read_ahead=0)]
    assert outcomes == ["updated"] * 6
    assert threads == [True] * 6


def test_an_error_reading_the_source_comes_after_the_batches_before_it(tmp_path: Path) -> None:
    """A source that fails mid-stream: the complete batches before are applied and yielded, then the error."""

    def failing() -> Iterator[Item]:
        for i, event_id in enumerate(EVENT_IDS[:5]):
            yield Item(f"f:{i + 1}", _catalog_body(event_id, f"a-{i}"))
        raise OSError("the disk went away")

    yielded: list[str] = []
    with _parse_in_thread(2), ConsumerDB.open(tmp_path / "t.db", spec=get("catalog"), create=True) as db:
        with pytest.raises(OSError, match="the disk went away"):
            for _, outcome in replay_lib.replay(db, failing(), batch=2, read_ahead=1):
                yielded.append(outcome.status)
        receipts = db.conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
    assert yielded == ["updated"] * 4  # the fifth event's batch never completed
    assert receipts == 4
    _no_parse_thread_left()


def test_stopping_early_ends_the_thread_and_leaves_the_rest_of_the_source(tmp_path: Path) -> None:
    """A caller that stops after the first outcome: the thread has ended when close() returns, at most
    one batch was taken beyond the outcomes yielded, and the source can be read on."""
    parsed_in: list[str] = []

    def source() -> Iterator[Item]:
        for i, event_id in enumerate(EVENT_IDS):
            parsed_in.append(threading.current_thread().name)
            yield Item(f"f:{i + 1}", _catalog_body(event_id, f"a-{i}"))

    shared = source()
    with _parse_in_thread(2), ConsumerDB.open(tmp_path / "t.db", spec=get("catalog"), create=True) as db:
        outcomes = replay_lib.replay(db, shared, batch=2, read_ahead=1)
        assert next(outcomes)[1].status == "updated"
        outcomes.close()  # type: ignore[attr-defined]
        assert not [t for t in threading.enumerate() if t.name == "replay-parse"]
        receipts = db.conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
    assert receipts == 2
    taken = len(parsed_in)
    assert set(parsed_in) == {"replay-parse"} and taken <= 4
    rest = [item.location for item in shared]  # no "generator already executing"
    assert rest == [f"f:{i + 1}" for i in range(taken, len(EVENT_IDS))]


def test_a_batch_run_again_after_a_busy_commit_asks_for_one_batch_ahead(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that meets a busy database runs the batch again: still one batch read ahead, all in order."""
    real_apply_batch = replay_lib.apply_batch
    read: list[str] = []
    calls: list[int] = []

    def source() -> Iterator[Item]:
        for i, event_id in enumerate(EVENT_IDS):
            read.append(event_id)
            yield Item(f"f:{i + 1}", _catalog_body(event_id, f"a-{i}"))

    def busy_at_first_commit(db: ConsumerDB, parsed: list, **kwargs: object) -> list:
        calls.append(len(read))  # what was read when this transaction began
        if len(calls) == 1:
            hook = kwargs["before_commit"]
            assert callable(hook)
            hook(None, [])  # the hook ran, then the COMMIT found the database busy
            raise TransientError("database is locked", code=DATABASE_BUSY)
        return real_apply_batch(db, parsed, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(replay_lib, "apply_batch", busy_at_first_commit)
    monkeypatch.setattr("time.sleep", lambda _seconds: None)  # the backoff
    with _parse_in_thread(2), ConsumerDB.open(tmp_path / "t.db", spec=get("catalog"), create=True) as db:
        located = [(item.location, outcome.status) for item, outcome in replay_lib.replay(db, source(), batch=2,
                                                                                       read_ahead=1)]
    assert located == [(f"f:{i + 1}", "updated") for i in range(len(EVENT_IDS))]
    # Batch k begins with batches 0..k read and no more: the next one is
    # asked for at its commit, once, also when batch 0 ran twice.
    assert calls[0] == 2 and calls[1] <= 4
    assert calls[2:] == [2 * (k + 1) for k in range(1, len(calls) - 1)], calls
    _no_parse_thread_left()
