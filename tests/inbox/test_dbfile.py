"""The database file under operators, in-process: the identity check at every synced
commit, the writer lock, the integrity check at open (dbfile.py, ConsumerDB)."""

from __future__ import annotations

import os
import sqlite3
import uuid
from pathlib import Path

import pytest
from support import env

from delivery_consumer import consumers
from delivery_consumer.dbfile import WriterLock
from delivery_consumer.errors import DatabaseError, DatabaseInUse, DatabaseLost
from delivery_consumer.inbox import ConsumerDB, InFlight, apply_batch


def _open(path: Path) -> ConsumerDB:
    return consumers.open_db(path, "catalog", create=True)


def test_a_commit_into_a_deleted_file_raises_before_its_outcomes_are_returned(tmp_path: Path) -> None:
    """After the file is deleted, the next batch commits (into the unlinked file) and raises
    DatabaseLost instead of returning outcomes; until then batches apply normally."""
    db = _open(tmp_path / "c.db")
    assert [o.status for o in apply_batch(db, [env(article_id="a", revision=1)])] == ["updated"]
    for name in ("c.db", "c.db-wal", "c.db-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    with pytest.raises(DatabaseLost, match="was deleted while in use"):
        apply_batch(db, [env(event_id=str(uuid.uuid4()), article_id="a", revision=2)])
    db.close()


def test_a_replaced_file_is_noticed_and_an_unsynced_commit_does_not_stat(tmp_path: Path) -> None:
    """A file moved over the database makes the next synced commit raise DatabaseLost; the
    in_flight note's unsynced commit does not look (nothing is acknowledged on it)."""
    db = _open(tmp_path / "c.db")
    _open(tmp_path / "other.db").close()
    os.replace(tmp_path / "other.db", tmp_path / "c.db")
    note = InFlight(db)
    note.mark(["k"])  # unsynced: no check
    with pytest.raises(DatabaseLost, match="was replaced while in use"):
        apply_batch(db, [env(article_id="a", revision=1)])
    db.close()


def test_the_writer_lock_is_exclusive_and_names_its_holder(tmp_path: Path) -> None:
    """One exclusive holder; a second is refused naming pid and command; shared holders
    (replays) share it with each other but not with an exclusive one; released on close."""
    path = tmp_path / "c.db"
    first, second, third = WriterLock(path), WriterLock(path), WriterLock(path)
    me = os.getpid()
    first.acquire(me, "run")
    with pytest.raises(DatabaseInUse, match=rf"in use by pid {me} \(run\)"):
        second.acquire(99, "run")
    with pytest.raises(DatabaseInUse):
        second.acquire(99, "replay", shared=True)
    first.release()
    second.acquire(7, "replay", shared=True)
    third.acquire(8, "replay", shared=True)
    with pytest.raises(DatabaseInUse, match="replay"):
        first.acquire(me, "run")
    second.release()
    third.release()
    first.acquire(me, "run")
    first.release()


def test_the_integrity_check_passes_a_sound_file_and_refuses_a_damaged_page(tmp_path: Path) -> None:
    """quick_check passes a sound database; garbage in a page of the inbox index is refused
    with one line saying how to recover (.recover, a backup)."""
    path = tmp_path / "c.db"
    db = _open(path)
    apply_batch(db, [env(event_id=str(uuid.uuid4()), article_id=f"a{i}", revision=1) for i in range(2000)])
    assert db.check_integrity(10.0) is True
    db.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'sqlite_autoindex_inbox_1'").fetchone()
    conn.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xa5" * page_size)
    db = _open(path)
    with pytest.raises(DatabaseError, match=r"is damaged .*\.recover.*backup") as raised:
        db.check_integrity(10.0)
    assert "\n" not in str(raised.value)
    db.close()
