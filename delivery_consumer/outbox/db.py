"""The outbox's storage seam: one connection interface, two backends.

The dispatcher, the owners' table and the operator's queries are written
once, against :class:`OutboxDb` (:mod:`.seam`, re-exported here); SQLite
(:class:`SqliteDb`, here) and PostgreSQL (:class:`delivery_consumer.outbox.pg.PgDb`)
supply the connection, the transaction, the parameter style and a few SQL
fragments that differ (a list of seqs, a timestamp in milliseconds, the claim's lock).
The SQL is written in SQLite's parameter style (``?``, ``?1``, ``:name``);
the PostgreSQL backend rewrites it once per statement. Why one design and
not two outboxes: docs/outbox.md.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Final

from ..store.dbfile import FileGuard
from ..store.postgres import SCHEMES, is_url, redact
from ..store.sqlite import path_of, rollback
from . import wake
from .seam import Cursor, OutboxDb, WakeListener


class SqliteDb:
    """:class:`OutboxDb` on an :mod:`sqlite3` connection opened by :func:`.table.connect`."""

    kind: Final = "sqlite"
    seq_in_sql: Final = "seq IN (SELECT value FROM json_each(?))"
    body_sql: Final = "body"
    #: SQLite keeps a julian day as integer milliseconds, so this is exact; NULL when not a time.
    created_ms_sql: Final = "CAST(round((julianday(created_at) - 2440587.5) * 86400000.0) AS INTEGER)"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.label = path_of(conn)
        self._file = FileGuard(self.label) if os.path.isfile(self.label) else None

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Cursor:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Cursor:
        return self.conn.executemany(sql, rows)

    def scan(self, sql: str, params: Sequence[Any] = (), chunk: int = 1000) -> Cursor:
        return self.conn.execute(sql, params)  # sqlite3 steps lazily

    @contextmanager
    def transaction(self) -> Iterator[OutboxDb]:
        from .table import transaction

        with transaction(self.conn):
            yield self

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        if self.conn.in_transaction:
            yield
            return
        self.conn.execute("BEGIN DEFERRED")
        try:
            yield
        finally:
            rollback(self.conn)

    def seqs(self, seqs: Iterable[int]) -> str:
        # One JSON array: a fraction of the cost of an executemany with a statement per row.
        return "[" + ",".join(map(str, seqs)) + "]"

    def lock_claims(self) -> None:
        """BEGIN IMMEDIATE already holds the database's one write lock."""

    def reopen(self) -> OutboxDb:
        from .table import connect

        return SqliteDb(connect(self.label, install_tables=False))

    def listener(self) -> WakeListener | None:
        if not os.path.isfile(self.label):
            return None
        return wake.Listener.bind(self.label)

    def check_alive(self) -> None:
        if self._file is not None:
            self._file.check()

    def close(self) -> None:
        with suppress(sqlite3.Error):
            self.conn.close()


#: URL schemes that name a PostgreSQL database instead of a SQLite file.
PG_SCHEMES: Final = SCHEMES


def is_pg_url(target: object) -> bool:
    """Whether *target* (a ``--db`` value) is a PostgreSQL URL."""
    return is_url(target)


def exists(target: Path | str) -> bool:
    """Whether the producer database *target* exists (a server's database is assumed to: connecting tells)."""
    return True if is_pg_url(target) else Path(target).exists()


def display(target: Path | str) -> str:
    """*target* for messages and views: a path, or a URL without its password."""
    if is_pg_url(target):
        return redact(str(target))
    return str(target)


def as_db(conn: Any) -> OutboxDb:
    """*conn* as an :class:`OutboxDb`: a sqlite3 connection is wrapped, an OutboxDb is itself."""
    if isinstance(conn, sqlite3.Connection):
        return SqliteDb(conn)
    return conn  # type: ignore[no-any-return]


def open_db(target: Path | str, *, readonly: bool = False, install_tables: bool = True) -> OutboxDb:
    """The outbox at *target*: a PostgreSQL URL or a SQLite file."""
    if is_pg_url(target):
        from . import pg

        return pg.connect(str(target), readonly=readonly, install_tables=install_tables)
    from .table import connect

    return SqliteDb(connect(target, readonly=readonly, install_tables=install_tables))


__all__ = ["PG_SCHEMES", "Cursor", "OutboxDb", "SqliteDb", "WakeListener", "as_db", "display", "exists", "is_pg_url",
           "open_db"]
