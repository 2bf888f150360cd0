"""The database file under operators, in-process: the identity check at every synced
commit, the writer lock, the integrity check at open (dbfile.py, ConsumerDB)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import env, wait_until

from delivery_consumer import consumers
from delivery_consumer.inbox import ConsumerDB, InFlight, apply_batch
from delivery_consumer.model.errors import DatabaseError, DatabaseInUse, DatabaseLost
from delivery_consumer.store.dbfile import SerialLock, WriterLock


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
    with one line saying how to recover (inbox recover, a backup)."""
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
    with pytest.raises(DatabaseError, match=r"is damaged .*inbox recover.*backup") as raised:
        db.check_integrity(10.0)
    assert "\n" not in str(raised.value)
    db.close()


# -- one writer per file, whatever the path ---------------------------------------------------------

_HOLD = """
import os, sys, time
from delivery_consumer.store.dbfile import WriterLock, SerialLock
kind, path = sys.argv[1], sys.argv[2]
if kind == "writer":
    lock = WriterLock(path)
    lock.acquire(os.getpid(), "run")
    lock.beat()
else:
    SerialLock(path).__enter__()
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _held_elsewhere(kind: str, path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds the writer (or serial) lock of *path* until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, kind, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_every_path_to_the_file_meets_one_writer_lock_and_deleting_the_note_changes_nothing(tmp_path: Path) -> None:
    """A run holds the database: a symlink to the file, a relative path, a symlinked directory,
    a bind mount of the directory and a hard link are all refused in one line naming the holder's
    pid; deleting the note <db>.lock (the old lock file) lets no second writer in."""
    state = tmp_path / "state"
    state.mkdir()
    db = state / "inbox.db"
    _open(db).close()
    (tmp_path / "link.db").symlink_to(db)
    (tmp_path / "dir").symlink_to(state)
    paths = [tmp_path / "link.db", Path(os.path.relpath(db)), tmp_path / "dir" / "inbox.db"]
    bind = tmp_path / "bind"
    bind.mkdir()
    if subprocess.run(["mount", "--bind", str(state), str(bind)], capture_output=True).returncode == 0:
        paths.append(bind / "inbox.db")
    try:
        with _held_elsewhere("writer", db) as holder:
            (state / "inbox.db.lock").unlink()  # an operator "cleans up"
            os.link(db, tmp_path / "hard.db")
            for path in [*paths, db, tmp_path / "hard.db"]:
                with pytest.raises(DatabaseInUse) as refused:
                    WriterLock(path).acquire(os.getpid(), "run")
                assert f"in use by pid {holder.pid}" in str(refused.value) and "\n" not in str(refused.value)
            wait_until("the holder to write its note again", (state / "inbox.db.lock").exists, 30, [holder])
    finally:
        subprocess.run(["umount", str(bind)], capture_output=True)


def test_a_file_with_two_names_is_refused_to_every_writer(tmp_path: Path) -> None:
    """A hard link makes two names that SQLite journals separately: the writer lock and any
    writable open refuse the file in one line saying how many names it has; read-only opens work."""
    db = tmp_path / "inbox.db"
    _open(db).close()
    os.link(db, tmp_path / "other.db")
    with pytest.raises(DatabaseError, match="2 names") as refused:
        WriterLock(tmp_path / "other.db").acquire(os.getpid(), "run")
    assert "\n" not in str(refused.value)
    with pytest.raises(DatabaseError, match="2 names"):
        _open(db)
    consumers.open_db(db, "catalog", readonly=True).close()
    (tmp_path / "other.db").unlink()
    lock = WriterLock(db)
    lock.acquire(os.getpid(), "run")
    lock.release()


def test_the_fence_serial_lock_is_taken_on_the_file_whatever_its_name(tmp_path: Path) -> None:
    """The fence's serial lock held through the real path keeps a process that reaches the
    file through a symlink waiting (it is the file's, not <name>.serial.lock's)."""
    db = tmp_path / "inbox.db"
    _open(db).close()
    (tmp_path / "link.db").symlink_to(db)
    entered = threading.Event()

    def enter() -> None:
        with SerialLock(tmp_path / "link.db"):
            entered.set()

    with _held_elsewhere("serial", db) as holder:
        waiter = threading.Thread(target=enter, daemon=True)
        waiter.start()
        assert not entered.wait(1.0), "entered the serial lock while another process held it"
        holder.kill()
        assert entered.wait(30)
    waiter.join(30)


def test_releasing_the_lock_keeps_sqlites_own_locks(tmp_path: Path) -> None:
    """Closing any descriptor of a file drops every POSIX lock the process holds on it, SQLite's
    included: releasing the writer lock while a connection is open parks its descriptor, and
    SQLite's shared lock on the file stays (a second process cannot take the file exclusively)."""
    db_path = tmp_path / "inbox.db"
    lock = WriterLock(db_path)
    lock.acquire(os.getpid(), "run")
    db = consumers.open_db(db_path, "catalog", create=True, empty_ok=True)
    apply_batch(db, [env(event_id=str(uuid.uuid4()), article_id="a", revision=1)])
    st = os.stat(db_path)
    # /proc/locks names a file as MAJOR:MINOR:INODE (the device in hex): this file exactly, not
    # another file of this process with the same inode number on another filesystem.
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"

    def sqlite_locks() -> list[str]:
        return sorted(" ".join(line.split()[1:]) for line in Path("/proc/locks").read_text().splitlines()
                      if "POSIX" in line.split() and file_id in line.split() and str(os.getpid()) in line.split())

    before = sqlite_locks()
    assert before
    lock.release()
    assert sqlite_locks() == before
    db.close()


def test_an_empty_file_is_never_adopted_as_a_new_database(tmp_path: Path) -> None:
    """A 0-byte file and a database file with no tables (what a failed .recover leaves) are refused
    by every open that is not init, in one line; init adopts it as a new database."""
    for content in (b"", None):
        path = tmp_path / f"empty-{content is None}.db"
        if content is None:
            sqlite3.connect(path).execute("PRAGMA user_version = 0").connection.execute("VACUUM").connection.close()
        else:
            path.write_bytes(content)
        with pytest.raises(DatabaseError, match="holds no database") as refused:
            _open(path)
        assert "\n" not in str(refused.value)
        db = consumers.open_db(path, "catalog", create=True, empty_ok=True)
        assert db.created
        db.close()


def test_a_copy_written_over_the_live_file_stops_the_writer_before_its_ack(tmp_path: Path) -> None:
    """A backup copied over the live file (same inode) is noticed by the next commit's check:
    DatabaseLost naming the copy, whatever the file's size; until then batches apply normally."""
    path = tmp_path / "c.db"
    _open(path).close()
    backup = tmp_path / "backup.db"
    shutil.copyfile(path, backup)
    db = _open(path)
    db.watch_content()
    apply_batch(db, [env(event_id=str(uuid.uuid4()), article_id=f"a{i}", revision=1) for i in range(100)])
    with open(backup, "rb") as src, open(path, "r+b") as dst:  # what cp does: same inode, new content
        dst.truncate(0)
        dst.write(src.read())
    with pytest.raises(DatabaseLost, match="content was replaced"):
        apply_batch(db, [env(event_id=str(uuid.uuid4()), article_id="b", revision=1)])
    db.close()


def test_the_writer_s_own_checkpoints_never_look_like_a_copy(tmp_path: Path) -> None:
    """The tag moves forward through the writer's own list as checkpoints (its own, and another
    connection's) copy the header into the file: thousands of commits, forced checkpoints,
    no false alarm."""
    path = tmp_path / "c.db"
    db = _open(path)
    db.watch_content()
    other = sqlite3.connect(path)
    for i in range(40):
        db.count_due = 0.0  # a new tag at every commit
        apply_batch(db, [env(event_id=str(uuid.uuid4()), article_id=f"a{i}-{j}", revision=1) for j in range(50)])
        other.execute("PRAGMA wal_checkpoint(PASSIVE)")
    other.close()
    db.close()
