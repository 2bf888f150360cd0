"""The receipt counters (inbox/counters.py) always equal a recount of the receipts: after applies
(any results, any times, with duplicates and failures), prunes and moves between partitions; and a
database from before them shows the same stats once upgraded."""

from __future__ import annotations

import shutil
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import env

from delivery_consumer import consumers
from delivery_consumer.amqp.partitions import Identity, partition_of
from delivery_consumer.inbox import ConsumerDB, apply_batch, counters, database, retention
from delivery_consumer.inbox import apply as apply_module
from delivery_consumer.inbox import reports as queries
from delivery_consumer.model.envelope import Envelope
from delivery_consumer.model.errors import TransientError
from delivery_consumer.ops import system_view as system
from delivery_consumer.ops.partition_databases import split_merge
from delivery_consumer.store.sqlite import now_iso

NOW = 1_800_000_000.0
RESULTS = st.sampled_from(["updated", "stale", "same-state", "created", "fail"])


def recount(conn: sqlite3.Connection) -> None:
    """What the readers see (the counters and the receipts not counted yet) equals a full recount of the
    inbox, per (minute, result) and result; and once caught up, the counters alone do, per hour too."""
    expected = {(m, r): n for m, r, n in conn.execute(counters.RECOUNT)}
    assert {(m, r): n for m, r, n in counters.per_minute(conn, "0000-00-00T00:00")} == expected
    by_result: Counter[str] = Counter()
    for (_minute, result), n in expected.items():
        by_result[result] += n
    assert dict(sorted(by_result.items())) == counters.totals(conn)
    conn.execute("BEGIN IMMEDIATE")
    counters.catch_up(conn)
    conn.execute("COMMIT")
    assert counters.tail(conn) == []
    minutes = {(m, r): n for m, r, n in conn.execute("SELECT minute, result, n FROM inbox_minutes") if n}
    assert expected == minutes
    assert all(n >= 0 for (n,) in conn.execute("SELECT n FROM inbox_minutes"))
    assert dict(sorted(by_result.items())) == counters.totals(conn)
    by_hour: Counter[tuple[str, str]] = Counter()
    for (minute, result), n in expected.items():
        by_hour[minute[:13], result] += n
    hours = conn.execute("SELECT hour, result, n FROM inbox_hours WHERE hour != ?", (counters.TOTAL,))
    assert by_hour == {(h, r): n for h, r, n in hours if n}


def event(i: int, partition_count: int = 1, partition: int = 0) -> Envelope:
    """Event *i* keyed to *partition* of *partition_count*: the same body each time it is asked for
    the same key (another key is another event, as a producer's would be)."""
    n = 0
    while partition_of(f"article-{i}-{n}", partition_count) != partition:
        n += 1
    return env(event_id=f"00000000-0000-4000-8000-{i:06d}{n:06d}", article_id=f"article-{i}-{n}")


def apply_at(db: ConsumerDB, when: float, batch: list[tuple[Envelope, str]], monkeypatch: Any) -> None:
    """Apply *batch* (event, result its effect returns; ``fail``: a transient failure) at *when*."""
    chosen = {e.event_id: result for e, result in batch}

    def effect(conn: sqlite3.Connection, e: Envelope) -> str:
        if chosen[e.event_id] == "fail":
            raise TransientError("not now")
        return chosen[e.event_id]

    monkeypatch.setattr(apply_module, "now_iso", lambda: now_iso(when))
    apply_batch(db, [e for e, _ in batch], effect=effect)


APPLY = st.tuples(st.just("apply"), st.integers(0, 3 * 24 * 60),
                  st.lists(st.tuples(st.integers(0, 40), RESULTS), min_size=1, max_size=8))
PRUNE = st.tuples(st.just("prune"), st.integers(1, 3 * 24 * 60), st.just([]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(APPLY, PRUNE), max_size=12))
def test_counters_equal_a_recount_after_applies_and_prunes(tmp_path: Path, monkeypatch: Any,
                                                          ops: list[tuple[str, int, list[tuple[int, str]]]]) -> None:
    """Batches at any time in three days (duplicates, failures, receipts out of time order) and
    prunes at any age: after each, the counters equal a recount of the inbox."""
    with consumers.open_db(tmp_path / f"c-{time.monotonic_ns()}.db", "catalog", create=True) as db:
        for op, minutes_ago, batch in ops:
            if op == "apply":
                apply_at(db, NOW - minutes_ago * 60, [(event(i), r) for i, r in batch], monkeypatch)
            else:
                retention.prune(db, older_than_s=minutes_ago * 60, horizon_s=0, keep_event_ids=set(), now=NOW,
                                sleep=lambda _s: None)
            recount(db.conn)


CATCH_UP = st.tuples(st.just("catch-up"), st.just(0), st.just([]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(APPLY, PRUNE, CATCH_UP), max_size=12),
       cutoffs=st.lists(st.integers(0, 3 * 24 * 3600), min_size=1, max_size=4))
def test_since_equals_a_scan_with_any_receipts_not_counted_yet(
    tmp_path: Path, monkeypatch: Any, cutoffs: list[int], ops: list[tuple[str, int, list[tuple[int, str]]]]) -> None:
    """Receipts at or after any cutoff, by result, equal a scan of the inbox whether the writer caught
    up a moment ago, long ago or never (the receipts since are read from the inbox's end), for
    receipts written as a clock that never goes back stamps them (the bound of a clock stepped
    back is in inbox_rowid_before's docstring)."""
    with consumers.open_db(tmp_path / f"s-{time.monotonic_ns()}.db", "catalog", create=True) as db:
        db.count_due = float("inf")  # this test says when the counters catch up
        clock = NOW - 3 * 24 * 3600
        for op, minutes_ago, batch in ops:
            if op == "apply":
                clock = max(clock, NOW - minutes_ago * 60)
                apply_at(db, clock, [(event(i), r) for i, r in batch], monkeypatch)
            elif op == "prune":
                retention.prune(db, older_than_s=minutes_ago * 60, horizon_s=0, keep_event_ids=set(), now=NOW,
                                sleep=lambda _s: None)
            else:
                with db.transaction() as tx:
                    counters.catch_up(tx.conn)
            for seconds_ago in cutoffs:
                cutoff = now_iso(NOW - seconds_ago)
                scan = dict(db.conn.execute("SELECT result, count(*) FROM inbox WHERE received_at >= ?"
                                            " GROUP BY result ORDER BY result", (cutoff,)).fetchall())
                assert counters.since(db.conn, cutoff) == scan


MOVE = st.tuples(st.just("move"), st.integers(1, 3), st.just([]))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(APPLY, PRUNE, MOVE), max_size=8), target=st.integers(0, 2))
def test_counters_equal_a_recount_across_repartitions(tmp_path: Path, monkeypatch: Any, target: int,
                                                     ops: list[tuple[str, int, list[tuple[int, str]]]]) -> None:
    """Applies and prunes on one partition of a partitioned consumer, and changes of the partition
    count: every database's counters equal a recount of its own inbox."""
    root = tmp_path / f"r-{time.monotonic_ns()}"
    count = 2

    def open_all(create: bool = False) -> list[ConsumerDB]:
        return [consumers.open_db(root / "catalog" / f"p{k}" / "inbox.db", "catalog", create=create,
                                  partition=Identity(k, count)) for k in range(count)]

    for db in open_all(create=True):
        db.close()
    for op, number, batch in ops:
        if op == "move":
            moved = split_merge("catalog", number, root)
            assert moved.backup is not None
            shutil.rmtree(moved.backup)  # named to the second: the next move may come within it
            count = number
        else:
            dbs = open_all()
            try:
                k = target % count
                if op == "apply":
                    apply_at(dbs[k], NOW - number * 60, [(event(i, count, k), r) for i, r in batch], monkeypatch)
                else:
                    retention.prune(dbs[k], older_than_s=number * 60, horizon_s=0, keep_event_ids=set(), now=NOW,
                                    sleep=lambda _s: None)
            finally:
                for db in dbs:
                    db.close()
        for db in open_all():
            with db:
                recount(db.conn)


def _old_stats(conn: sqlite3.Connection, now: float) -> dict[str, Any]:
    """What inbox stats and status said before the counters: scans of the receipts."""
    rows = conn.execute("SELECT result, count(*), sum(received_at >= ?), sum(received_at >= ?) FROM inbox"
                        " GROUP BY result ORDER BY result", (now_iso(now - 3600), now_iso(now - 86400))).fetchall()
    minute, hour = conn.execute("SELECT sum(received_at >= ?), sum(received_at >= ?) FROM inbox",
                                (now_iso(now - 60), now_iso(now - 3600))).fetchone()
    oldest, newest = conn.execute("SELECT min(received_at), max(received_at) FROM inbox").fetchone()
    return {"byResult": {r[0]: r[1] for r in rows}, "lastHour": {r[0]: r[2] for r in rows},
            "lastDay": {r[0]: r[3] for r in rows}, "oldestReceivedAt": oldest, "newestReceivedAt": newest,
            "receiptsLastMinute": minute or 0, "receiptsLastHour": hour or 0}


@pytest.mark.parametrize("receipts", [0, 1, 500])
def test_an_upgraded_database_shows_the_same_stats(tmp_path: Path, receipts: int) -> None:
    """A database of the schema before the counters, with receipts over two days, is backfilled
    when opened: inbox stats and status show what the scans of its receipts showed."""
    path = tmp_path / "old.db"
    with consumers.open_db(path, "catalog", create=True) as db:
        conn = db.conn
        conn.execute("BEGIN IMMEDIATE")
        for name in ("inbox_minutes_added", "inbox_minutes_changed", "inbox_minutes_removed"):
            conn.execute(f"DROP TRIGGER {name}")
        conn.execute("DROP TABLE inbox_minutes")
        conn.execute("DROP TABLE inbox_hours")
        conn.execute("DROP TABLE inbox_counted")
        # and what later migrations added (the CloudEvents' origins)
        conn.execute("DROP TABLE ce_sources")
        for table, column in (("inbox", "origin"), ("rejected", "origin"), ("rejected", "partition_key")):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        before = next(i for i, script in enumerate(database.CORE_MIGRATIONS) if "CREATE TABLE inbox_minutes" in script)
        conn.execute(f"PRAGMA user_version = {before}")
        results = ["updated", "stale", "same-state"]
        conn.executemany(
            "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, 'f', ?, 't', ?)",
            [(f"e{i}", results[i % 3], now_iso(NOW - 2 * 86400 + i * 2 * 86400 / max(receipts, 1)))
             for i in range(receipts)])
        conn.execute("COMMIT")
        expected = _old_stats(conn, NOW)

    with consumers.open_db(path, "catalog", create=True) as db:
        assert database.STORE_VERSION == db.conn.execute("PRAGMA user_version").fetchone()[0]
        recount(db.conn)
        stats = queries.inbox_stats(db, now=NOW)
        status = system._consumer_db_status(db, NOW)
    assert expected["byResult"] == stats["byResult"] and receipts == stats["receipts"]
    for key in ("lastHour", "lastDay"):
        assert {r: n for r, n in expected[key].items() if n} == {r: n for r, n in stats[key].items() if n}
    assert expected["oldestReceivedAt"] == stats["oldestReceivedAt"]
    assert expected["newestReceivedAt"] == stats["newestReceivedAt"] == status["newestReceivedAt"]
    assert expected["receiptsLastMinute"] == status["receiptsLastMinute"]
    assert expected["receiptsLastHour"] == status["receiptsLastHour"]
