"""Poison detection in the store: the notes of what a process is handling
(``inbox.InFlight``), who owns them, and what a dead owner's note means."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import OpenDB, read_rows

from delivery_consumer.inbox import ConsumerDB, InFlight, owner_alive, process_owner
from delivery_consumer.model.errors import DatabaseMalformed, StoreUnavailable
from delivery_consumer.store.sqlite import translate

GONE = "gone:1:1"  # another boot: certainly not running


def deliveries(db: ConsumerDB) -> list[tuple[object, ...]]:
    return read_rows(db.path, "deliveries", "key, deliveries, crashes, last_outcome")


def test_an_owner_is_alive_while_its_process_runs_and_never_after() -> None:
    """A process's owner name is alive while it runs; once it exited (zombie or
    reaped) it is not, nor is a name with another start time or boot."""
    assert owner_alive(process_owner())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    name = process_owner(child.pid)
    assert owner_alive(name)
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    assert not owner_alive(name)
    boot, pid, start = process_owner().split(":")
    assert not owner_alive(f"{boot}:{pid}:{int(start) + 1}")
    assert not owner_alive(f"other:{pid}:{start}")
    assert not owner_alive(GONE)


def test_a_dead_owners_note_makes_a_crash_of_a_key_handled_alone_and_suspects_of_a_batch(open_db: OpenDB) -> None:
    """Reaping: a note of one key (or of copies of one key) is that key's crash; a
    note of a batch makes each key a suspect without a crash; both are open."""
    db = open_db("audit")
    InFlight(db, "gone:1:1").mark(["alone"])
    InFlight(db, "gone:1:2").mark(["b-1", "b-2"])
    InFlight(db, "gone:1:3").mark(["copy", "copy", "copy"])

    assert 3 == InFlight(db).reap()
    assert [("alone", 1, 1, "crashed"), ("b-1", 1, 0, "interrupted"), ("b-2", 1, 0, "interrupted"),
            ("copy", 1, 1, "crashed")] == sorted(deliveries(db))
    assert [] == read_rows(db.path, "in_flight")
    assert {"alone": 1, "b-1": 0, "copy": 1} == InFlight(db).open_keys(["alone", "b-1", "never-seen", "copy"])
    assert 0 == InFlight(db).reap()


def test_a_live_owners_note_is_no_crash(open_db: OpenDB) -> None:
    """An orphan or a process whose channel dropped still runs: its note is left
    alone, and the keys it holds are neither crashes nor suspects."""
    db = open_db("audit")
    sibling = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        InFlight(db, process_owner(sibling.pid)).mark(["busy"])
        assert 0 == InFlight(db).reap()
        assert {} == InFlight(db).open_keys(["busy"])
        assert [] == deliveries(db)
    finally:
        assert sibling.stdin is not None
        sibling.stdin.close()
        sibling.wait()
    assert 1 == InFlight(db).reap()
    assert [("busy", 1, 1, "crashed")] == deliveries(db)


def test_a_batch_commit_clears_its_note_and_counting_a_delivery_counts_no_crash(open_db: OpenDB) -> None:
    """The batch's own transaction deletes the note; a delivery recorded after a
    crash closes the key without adding a crash (crashes are counted only by reaping)."""
    db = open_db("audit")
    mine = InFlight(db)
    mine.mark(["k"])
    with db.transaction() as tx:
        mine.clear(tx)
    assert [] == read_rows(db.path, "in_flight")
    InFlight(db, GONE).mark(["k"])
    InFlight(db).reap()
    with db.transaction() as tx:
        tx.record_delivery("k", None, redelivered=True, attempt=1, outcome="recorded")
    assert [("k", 2, 1, "recorded")] == deliveries(db)
    assert {} == InFlight(db).open_keys(["k"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4), max_size=8))
def test_crashes_count_the_dead_notes_that_held_a_key_alone(open_db: OpenDB, notes: list[list[str]]) -> None:
    """For any sequence of processes dying with a note: a key's crashes are the
    notes that held it alone, its deliveries the notes that held it."""
    db = open_db("audit", name=f"p-{uuid.uuid4().hex}.db")
    for i, keys in enumerate(notes):
        InFlight(db, f"gone:{i}:1").mark(keys)
        InFlight(db).reap()
    got = {key: (delivered, crashes) for key, delivered, crashes, _ in deliveries(db)}
    expected = {key: (sum(key in n for n in notes), sum(set(n) == {key} for n in notes))
                for key in {k for n in notes for k in n}}
    assert expected == got


@pytest.mark.parametrize(("code", "kind"), [
    (sqlite3.SQLITE_FULL, StoreUnavailable), (sqlite3.SQLITE_IOERR, StoreUnavailable),
    (sqlite3.SQLITE_BUSY, StoreUnavailable), (sqlite3.SQLITE_READONLY, StoreUnavailable),
    (sqlite3.SQLITE_CANTOPEN, StoreUnavailable), (sqlite3.SQLITE_CORRUPT, DatabaseMalformed),
])
def test_failures_of_the_environment_are_store_unavailable(code: int, kind: type, tmp_path: Path) -> None:
    """Disk full, I/O error, busy, read-only, cannot open: the environment's
    (StoreUnavailable, no event's fault); corruption: the database is unusable."""
    error = sqlite3.OperationalError("boom")
    error.sqlite_errorcode = code  # type: ignore[attr-defined]
    assert type(translate(error, tmp_path)) is kind
