"""A database file in an operator's hands: is it still the file we opened, who writes it.

* :class:`FileGuard` -- the file's identity (device, inode) when it was
  opened; :meth:`FileGuard.check` (one ``stat``) raises
  :class:`~delivery_consumer.errors.DatabaseLost` once the path names
  another file or none: a connection keeps writing into a deleted or
  replaced file without an error, and nothing may be acknowledged on that.
* :class:`WriterLock` -- an exclusive ``flock`` on ``<db>.lock`` beside the
  database, held for a writer's life: one ``run`` (or ``replay``) per
  database; the kernel releases it when the holder dies, however it dies.
* :class:`SerialLock` -- the same kind of lock held around one protocol
  step that spans transactions (the fence's claim, call and completion).

Why and what the operator sees: docs/failures.md, "Operator mistakes".
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from .errors import DatabaseError, DatabaseInUse, DatabaseLost, StoreUnavailable

#: How often a waiting standby tries the lock again (and looks at its parent).
LOCK_POLL_S = 0.2


class FileGuard:
    """The identity of a database file as it was opened; :meth:`check` says whether the path still names it."""

    __slots__ = ("identity", "path")

    def __init__(self, path: Path | str) -> None:
        self.path = os.path.abspath(path)
        st = os.stat(self.path)
        self.identity = (st.st_dev, st.st_ino)

    def check(self) -> None:
        """One ``stat`` of the path: DatabaseLost when the file is gone or another
        one; StoreUnavailable when the path cannot be looked at now."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise DatabaseLost(f"{self.path}: the database file was deleted while in use; stopped: nothing "
                                   f"written since is acknowledged or published (restore a backup; see "
                                   f"docs/failures.md)") from None
            raise StoreUnavailable(f"{self.path}: cannot look at the database file: {exc.strerror}",
                                   code="io-error") from None
        if (st.st_dev, st.st_ino) != self.identity:
            raise DatabaseLost(f"{self.path}: the database file was replaced while in use; stopped: nothing "
                               f"written since is acknowledged or published (start again if the new file is meant; "
                               f"see docs/failures.md)")


def lock_path(db_path: Path | str) -> Path:
    """The lock file of a database: ``<db>.lock`` beside it."""
    return Path(f"{db_path}.lock")


class _FileLock:
    """An ``flock`` on a file beside a database (created if missing, never deleted:
    deleting it would let a second process lock a new file while the first holds the old)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                try:  # a read-only file or disk: an flock needs no write access
                    self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    raise DatabaseError(f"{self.path}: cannot open the lock file: {exc.strerror}") from None
        return self._fd

    def _locked(self, blocking: bool, shared: bool = False) -> bool:
        """Lock the file (the one the path names now); False when another holds it."""
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return True
            self.close()  # someone deleted or replaced the lock file: lock the one the path names

    def unlock(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the file, which releases the lock."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class WriterLock(_FileLock):
    """One writer per database: an exclusive lock on ``<db>.lock``, held until
    :meth:`release` or the process's end. The holder writes ``<pid> <what>`` in it
    so that a refused or waiting process can name it. The descriptor is not
    inherited by programs the holder executes (``O_CLOEXEC``); a ``fork`` shares
    it, so a forked child holds the lock with its parent (``run`` takes it in
    its worker process, which forks nothing)."""

    def __init__(self, db_path: Path | str) -> None:
        super().__init__(lock_path(db_path))
        self.db_path = Path(db_path)

    def try_acquire(self, pid: int, what: str, *, shared: bool = False) -> bool:
        """Take the lock if it is free (and record *pid* and *what*); False when another holds it.
        *shared*: writers that may share the database with each other, not with
        an exclusive holder (``replay``: its concurrent writers are safe)."""
        if not self._locked(blocking=False, shared=shared):
            return False
        fd = self._open()
        with suppress(OSError):  # who holds it is for messages only (a full or read-only disk)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{pid} {what}\n".encode(), 0)
        return True

    def holder(self) -> str:
        """Who holds the lock, as its holder wrote it: ``pid N (what)``."""
        try:
            text = self.path.read_text(errors="replace").split()
        except OSError:
            text = []
        if not text:
            return "another process"
        return f"pid {text[0]}" + (f" ({' '.join(text[1:])})" if len(text) > 1 else "")

    def acquire(self, pid: int, what: str, *, shared: bool = False) -> None:
        """Take the lock or raise DatabaseInUse in one line naming the holder."""
        if not self.try_acquire(pid, what, shared=shared):
            holder = self.holder()
            self.close()
            raise DatabaseInUse(f"{self.db_path}: in use by {holder}, which holds {self.path}; one writer per "
                                f"database: stop it first (a partition's standby waits instead)")

    def wait(self, pid: int, what: str, *, give_up: Callable[[], bool],
             on_wait: Callable[[str], None] = lambda _holder: None) -> bool:
        """Wait for the lock (a standby); *on_wait* is told the holder once.
        False when *give_up* said so before the lock was free."""
        told = False
        while not self.try_acquire(pid, what):
            if not told:
                on_wait(self.holder())
                told = True
            if give_up():
                self.close()
                return False
            time.sleep(LOCK_POLL_S)
        return True

    def release(self) -> None:
        self.close()


class SerialLock(_FileLock):
    """``with lock:`` -- one process at a time in the block, whichever connection
    it uses (the fence's claim, call and completion: docs/fence.md). Blocks."""

    def __enter__(self) -> SerialLock:
        self._locked(blocking=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.unlock()


__all__ = ["LOCK_POLL_S", "FileGuard", "SerialLock", "WriterLock", "lock_path"]
