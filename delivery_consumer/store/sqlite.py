"""SQLite as every database of the project uses it.

The consumer's inbox (``inbox/``), the producer's outbox (``outbox/``) and the
demo producer (``producer.py``) connect, migrate, roll back and translate
errors through this module, and take their transactions, read snapshots
and the ages of stored timestamps from it. Why autocommit with explicit
``BEGIN IMMEDIATE`` and why ``synchronous=FULL``: docs/architecture.md, "SQLite".
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import overload
from urllib.parse import quote

from ..model.errors import DatabaseError, DatabaseMalformed, StoreUnavailable

#: How long a writer waits for another writer before giving up (ms). Kept well
#: below the AMQP heartbeat (60 s) so that waiting never costs the connection.
DEFAULT_BUSY_TIMEOUT_MS = 5000

#: The StoreUnavailable code of a database still locked by another writer past
#: the busy timeout (replay tries such a batch again by itself).
DATABASE_BUSY = "database-busy"

# SQLite primary result codes (https://sqlite.org/rescode.html) that are failures
# of the environment, not of any event: busy/locked past the timeout, read-only,
# I/O error, disk full, cannot open. Anything else (corrupt, not a database,
# a schema error) makes the database unusable: DatabaseError.
_ENVIRONMENT_CODES = {5: DATABASE_BUSY, 6: DATABASE_BUSY, 8: "database-read-only", 10: "io-error",
                      13: "disk-full", 14: "cannot-open"}


# CORRUPT and NOTADB: the file reads as damaged -- or the disk under it failed (an
# I/O error is often followed by these on the same connection): DatabaseMalformed.
_DAMAGE_CODES = {11, 26}


def now_iso(when: float | None = None) -> str:
    """UTC time as ``YYYY-MM-DDTHH:MM:SS.mmmZ``, the form every table stores (sorts as text)."""
    global _last_second
    if when is None:
        when = time.time()
    # Every transaction stamps its receipts: the date and time are formatted
    # once per second, the milliseconds taken from a table.
    cached = _last_second
    if int(when) != cached[0] or when < 0:
        cached = (int(when), time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)))
        if when >= 0:
            _last_second = cached
    return cached[1] + _MILLIS[int(when % 1 * 1000)]


_last_second: tuple[int, str] = (-1, "")
#: ``.000Z`` ... ``.999Z``: the end of every stored time.
_MILLIS = tuple(f".{ms:03d}Z" for ms in range(1000))


@overload
def age_s(stamp: str, now: float) -> float: ...


@overload
def age_s(stamp: str | None, now: float) -> float | None: ...


def age_s(stamp: str | None, now: float) -> float | None:
    """Seconds from a stored timestamp (:func:`now_iso`'s format) to the Unix
    time *now*, to the millisecond; None for None (no such row)."""
    if stamp is None:
        return None
    return round(now - datetime.fromisoformat(stamp).timestamp(), 3)


def translate(exc: sqlite3.Error, path: Path | str) -> DatabaseError | StoreUnavailable:
    """Map an sqlite3 error to the project's own: the environment's (StoreUnavailable, a
    TransientError: try again later) or fatal (DatabaseError)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in _ENVIRONMENT_CODES:
        return StoreUnavailable(f"{path}: {exc}", code=_ENVIRONMENT_CODES[code & 0xFF])
    if code is not None and code & 0xFF in _DAMAGE_CODES:
        return DatabaseMalformed(f"{path}: {exc}")
    return DatabaseError(f"{path}: {exc}")


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if any; quietly, since SQLite may
    already have rolled back by itself (e.g. after SQLITE_FULL)."""
    if conn.in_transaction:
        with suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def path_of(conn: sqlite3.Connection) -> str:
    """The file of *conn*'s main database, for messages."""
    with suppress(sqlite3.Error):
        row = conn.execute("PRAGMA database_list").fetchone()
        if row and row[2]:
            return str(row[2])
    return "database"


def table_names(conn: sqlite3.Connection) -> set[str]:
    """The names of the tables in *conn*'s main database."""
    return {row[0] for row in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}


def connect(
    path: Path | str,
    *,
    readonly: bool = False,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    check: Callable[[sqlite3.Connection], None] | None = None,
    pragmas: Sequence[str] = (),
) -> sqlite3.Connection:
    """Open *path* in autocommit mode (``isolation_level=None``).

    Read-only: ``mode=ro``, the file must exist, nothing in it changes.
    Writable: the file is created if missing (its directory must exist),
    switched to WAL (persistent) with ``synchronous=FULL`` and *pragmas*
    (``"name = value"``, per connection). *check* runs first, before anything
    is switched: it raises to refuse a file (a foreign or newer database)
    without modifying it. Raises DatabaseError, naming the file.
    """
    path = Path(path)
    if path.is_dir():
        raise DatabaseError(f"{path}: is a directory, not a database file")
    timeout = busy_timeout_ms / 1000
    try:
        if readonly:
            conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, isolation_level=None,
                                   timeout=timeout)
        else:
            conn = sqlite3.connect(path, isolation_level=None, timeout=timeout)
    except sqlite3.Error as exc:
        raise DatabaseError(f"{path}: cannot open database: {exc}") from None
    with closed_on_failure(conn, path):
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if check is not None:
            check(conn)
        if not readonly:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise DatabaseError(f"{path}: cannot switch to WAL mode (got {mode!r})")
            conn.execute("PRAGMA synchronous = FULL")
            for pragma in pragmas:
                conn.execute(f"PRAGMA {pragma}")
    return conn


@contextmanager
def reading(path: Path | str, *, what: str = "read it") -> Iterator[sqlite3.Connection]:
    """*path* opened read-only (:func:`connect`) for the block, closed after it;
    an sqlite3 error in the block leaves as DatabaseError ``<path>: cannot <what>: ...``."""
    conn = connect(path, readonly=True)
    try:
        yield conn
    except sqlite3.Error as exc:
        raise DatabaseError(f"{path}: cannot {what}: {exc}") from None
    finally:
        conn.close()


@contextmanager
def closed_on_failure(conn: sqlite3.Connection, path: Path | str) -> Iterator[sqlite3.Connection]:
    """Close *conn* when the block raises (a connection being prepared is
    nobody's yet); an sqlite3 error leaves as DatabaseError naming *path* --
    StoreUnavailable when it is the environment's (disk full, I/O, busy)."""
    try:
        yield conn
    except sqlite3.Error as exc:
        conn.close()
        error = translate(exc, path)
        if isinstance(error, StoreUnavailable):  # the disk's fault (full, I/O, busy): wait, not refuse
            raise StoreUnavailable(f"{path}: cannot use this database now: {exc}", code=error.code) from None
        raise type(error)(f"{path}: cannot use this database: {exc}") from None
    except BaseException:
        conn.close()
        raise


def statements(script: str) -> Iterator[str]:
    """Split an SQL script into statements (``executescript`` would COMMIT)."""
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer.strip()
            buffer = ""
    if buffer.strip():
        raise ValueError(f"incomplete SQL statement in migration: {buffer.strip()[:60]!r}")


def migrate(conn: sqlite3.Connection, scripts: Sequence[str], applied: int, *, what: str) -> int:
    """Run the forward-only migrations *scripts* a database has not seen yet.

    *applied* is how many it has seen (where that number is kept is the
    caller's: ``user_version``, a meta row). Runs in the caller's open
    transaction, statement by statement; returns the number now applied.
    A database ahead of the code is refused (DatabaseError naming *what*):
    it is never downgraded.
    """
    if applied > len(scripts):
        raise DatabaseError(
            f"{path_of(conn)}: {what} version {applied} is newer than this code's {len(scripts)}; upgrade it"
        )
    for script in scripts[applied:]:
        for statement in statements(script):
            conn.execute(statement)
    return len(scripts)


@contextmanager
def transaction(conn: sqlite3.Connection, *, translated: bool = True) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``, or ROLLBACK when the block raises;
    sqlite3 errors leave translated (:func:`translate`), or as they are with
    ``translated=False`` (a caller that words them itself: opening a
    database, moving rows between partitions).

    IMMEDIATE takes the write lock at once, so a read-then-write never hits
    the deferred upgrade that fails without waiting in WAL mode
    (https://sqlite.org/lang_transaction.html).
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:  # nothing was begun: nothing to roll back
        if not translated:
            raise
        raise translate(exc, path_of(conn)) from None
    try:
        yield conn
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        rollback(conn)
        if not translated:
            raise
        raise translate(exc, path_of(conn)) from None
    except BaseException:
        rollback(conn)
        raise


@contextmanager
def read_snapshot(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One short read transaction, so that several SELECTs see one state
    (inside the caller's transaction when one is open: it is that state).
    Nothing is written, so it ends with a ROLLBACK; sqlite3 errors leave as
    they are (the reader words them)."""
    if conn.in_transaction:
        yield conn
        return
    conn.execute("BEGIN DEFERRED")
    try:
        yield conn
    finally:
        rollback(conn)  # SQLite may have ended it already after an error


__all__ = [
    "DATABASE_BUSY",
    "DEFAULT_BUSY_TIMEOUT_MS",
    "age_s",
    "closed_on_failure",
    "connect",
    "migrate",
    "now_iso",
    "path_of",
    "read_snapshot",
    "reading",
    "rollback",
    "statements",
    "table_names",
    "transaction",
    "translate",
]
