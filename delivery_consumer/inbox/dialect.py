"""The few words the inbox's operator statements say differently on each backend.

``inbox prune``, ``rejected resolve`` and the dead queue's bookkeeping
(:mod:`.resolutions`) are written once, in SQL both backends run through the
store's connection (``?`` and ``?N`` parameters, translated on PostgreSQL);
what differs is here, chosen by the connection's dialect (:func:`words_for`):
the receipts' own order (SQLite's rowid, PostgreSQL's ``seq``), the temporary
table, a list of ids as a table, the system clock a prune compares its own
with, and the receipt counters SQLite keeps beside the receipts.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from . import counters
from .database import keep_high_water


def filesystem_now(directory: Path) -> float | None:
    """The system's time as the kernel stamps a new file in *directory* (None: cannot write there):
    a clock of its own, which a process's faked or skewed clock does not change."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".prune-clock-") as probe:
            return os.fstat(probe.fileno()).st_mtime
    except OSError:
        return None


class SqliteWords:
    """SQLite's words (a consumer's file)."""

    #: The receipts' own order: the order they were written in.
    order: str = "rowid"
    #: The prune's temporary table of eventIds to keep, as statements name it.
    keep_table: str = "temp.prune_keep"
    keep_create: str = "CREATE TEMP TABLE IF NOT EXISTS prune_keep (event_id TEXT PRIMARY KEY) WITHOUT ROWID"
    keep_insert: str = "INSERT OR IGNORE INTO temp.prune_keep (event_id) VALUES (?)"
    #: A JSON array of integers (one parameter) as a one-column table of them.
    ids_table: str = "SELECT value FROM json_each(?)"
    #: A JSON array of strings (one parameter) as a one-column table of them.
    texts_table: str = "SELECT value FROM json_each(?)"
    #: Whose clock a prune compares its own with.
    system_clock: str = "the system's (a new file's time)"

    def columns(self, conn: Any, table: str) -> set[str]:
        """The column names of *table* (none: no such table)."""
        return {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")').fetchall()}

    def receipts_since(self, conn: Any, since: str) -> int:
        """How many receipts were written since *since* (ISO time): the counters the writers keep
        (inbox/counters.py), not a scan of the receipts."""
        return sum(counters.since(conn, since).values())

    def per_minute(self, conn: Any, first: str, until: str | None) -> list[tuple[str, str, int]]:
        """(minute, result, n) of the receipts of the whole minutes from *first* up to (not
        including) *until* (``YYYY-MM-DDTHH:MM``): the writers' counters per minute."""
        return counters.per_minute(conn, first, until)

    def newest_received(self, conn: Any) -> str | None:
        """The newest receipt's time: among the last written (receipts are appended in time order)."""
        (newest,) = conn.execute(
            "SELECT max(received_at) FROM (SELECT received_at FROM inbox ORDER BY rowid DESC LIMIT 1000)").fetchone()
        return str(newest) if newest is not None else None

    def system_now(self, db: Any) -> float | None:
        """The system's time by a clock of its own: a new file's in the database's directory."""
        return filesystem_now(Path(db.path).parent)

    def prefix_bound(self, conn: Any, cutoff: str) -> int:
        """A bound of the order column: the receipts at or below it are older than *cutoff*
        (found without an index on ``received_at``: counters.inbox_rowid_before)."""
        return counters.inbox_rowid_before(conn, cutoff)

    def before_receipts_deleted(self, conn: sqlite3.Connection) -> None:
        """In the delete's transaction, first: every receipt deleted is then a counted one, and the
        newest's rowid stays known (SQLite numbers from 1 again once the table is empty)."""
        counters.catch_up(conn)
        keep_high_water(conn)

    def after_receipts_deleted(self, conn: sqlite3.Connection, gone: Sequence[Any]) -> None:
        """The counters lose what was deleted (``gone``: its received_at and result)."""
        counters.subtract(conn, gone)


class PostgresWords(SqliteWords):
    """PostgreSQL's words (a consumer's schema): ``seq`` is the receipts' order, the database
    server's clock is the system's, and no receipt counters are kept."""

    order = "seq"
    keep_table = "pg_temp.prune_keep"
    keep_create = "CREATE TEMP TABLE IF NOT EXISTS prune_keep (event_id text PRIMARY KEY)"
    keep_insert = "INSERT INTO pg_temp.prune_keep (event_id) VALUES (?) ON CONFLICT (event_id) DO NOTHING"
    ids_table = "SELECT CAST(value AS bigint) FROM json_array_elements_text(CAST(? AS json))"
    texts_table = "SELECT value FROM json_array_elements_text(CAST(? AS json))"
    system_clock = "the database server's"

    def columns(self, conn: Any, table: str) -> set[str]:
        return {row[0] for row in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
            " AND table_name = ?", (table,)).fetchall()}

    def receipts_since(self, conn: Any, since: str) -> int:
        # No counters: the receipts' received_at index.
        return int(conn.execute("SELECT count(*) FROM inbox WHERE received_at >= ?", (since,)).fetchone()[0])

    def per_minute(self, conn: Any, first: str, until: str | None) -> list[tuple[str, str, int]]:
        rows = conn.execute(
            "SELECT substr(received_at, 1, 16), result, count(*) FROM inbox WHERE received_at >= ?"
            " AND received_at < ? GROUP BY 1, 2", (counters.minute_of(first), until or "9999")).fetchall()
        return [(str(minute), str(result), int(n)) for minute, result, n in rows]

    def newest_received(self, conn: Any) -> str | None:
        (newest,) = conn.execute("SELECT max(received_at) FROM inbox").fetchone()
        return str(newest) if newest is not None else None

    def system_now(self, db: Any) -> float | None:
        row = db.conn.execute("SELECT CAST(extract(epoch FROM clock_timestamp()) AS double precision)").fetchone()
        return float(row[0])

    def prefix_bound(self, conn: Any, cutoff: str) -> int:
        # The receipts' received_at index: the newest seq received before the cutoff.
        (last,) = conn.execute("SELECT coalesce(max(seq), 0) FROM inbox WHERE received_at < ?", (cutoff,)).fetchone()
        return int(last)

    def before_receipts_deleted(self, conn: Any) -> None:
        """Nothing: no counters (``inbox stats`` counts over the index), and ``seq`` never goes back."""

    def after_receipts_deleted(self, conn: Any, gone: Sequence[Any]) -> None:
        """Nothing: no counters."""


SQLITE: Final = SqliteWords()
POSTGRES: Final = PostgresWords()


def words_for(db: Any) -> SqliteWords:
    """The words of *db*'s backend (its connection's ``dialect``)."""
    return POSTGRES if getattr(db.conn, "dialect", "sqlite") == "postgres" else SQLITE


__all__ = ["POSTGRES", "SQLITE", "PostgresWords", "SqliteWords", "filesystem_now", "words_for"]
