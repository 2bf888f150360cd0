"""``inbox recover``: copy what can still be read of a damaged database into a new one.

SQLite's own ``.recover`` needs the ``sqlite_dbpage`` table, which Debian's
sqlite3 3.40 is built without ("no such table: sqlite_dbpage"), and a failed
run of it leaves an empty file that looks like a new database. This reads
the damaged file through SQLite, table by table, in key order, and steps
over what it cannot read: for a rowid table it finds, by binary search on
the rowid, the first row after a damaged page that can be read again, so
one bad page costs the rows on it and no more; for a table without rowid
it reads from both ends. Indexes are not read (they are rebuilt), the
receipt counters are recounted, ``in_flight`` is left empty. The new file
keeps the old one's identity (``meta``: consumer, partition, seal key,
database id), so the restore check (acked.py) compares it with what was
acknowledged: a recovered file that lost its newest receipts is refused
until the loss is accepted. Nothing is written to the damaged file.
Procedure: docs/failures.md, "Restores".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .. import consumers
from ..inbox import ConsumerDB, counters
from ..inbox.database import CONSUMER_VERSION_KEY, SCHEMA_BY_KEY
from ..model.errors import DatabaseError
from ..store import sqlite

#: Store tables that are derived (recounted) or describe processes that are gone.
_NOT_COPIED = {*counters.TABLES, "in_flight"}
_BATCH = 500


@dataclass
class TableReport:
    """What was copied of one table and what could not be read."""

    name: str
    copied: int = 0
    #: Rowid (or key) ranges that could not be read, as text.
    lost: list[str] = field(default_factory=list)
    unreadable: bool = False


@dataclass
class RecoveryReport:
    source: str
    target: str
    consumer: str
    tables: list[TableReport] = field(default_factory=list)
    integrity: str = ""

    @property
    def complete(self) -> bool:
        return not any(t.lost or t.unreadable for t in self.tables)


def _open_damaged(path: Path) -> sqlite3.Connection:
    """The damaged file, read-only and immutable: SQLite neither writes it nor needs its locks."""
    if not path.is_file() or path.stat().st_size == 0:
        raise DatabaseError(f"{path}: no database to recover (missing or empty)")
    return sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, isolation_level=None)


def _consumer_of(conn: sqlite3.Connection, path: Path, given: str | None) -> str:
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'consumer'").fetchone()
    except sqlite3.DatabaseError:
        row = None
    if row is not None:
        if given is not None and given != row[0]:
            raise DatabaseError(f"{path}: a database of consumer {row[0]!r}, not {given!r}")
        return str(row[0])
    if given is None:
        raise DatabaseError(f"{path}: its consumer cannot be read (meta is damaged): give --consumer")
    return given


def _first_readable(conn: sqlite3.Connection, table: str, after: int, top: int) -> tuple[int, Any] | None:
    """The first row past rowid *after* that can be read, found by seeking (a seek reads the
    b-tree's interior pages and one leaf): None when nothing past *after* up to *top* can."""

    def seek(x: int) -> list[Any] | None:
        try:
            return conn.execute(f'SELECT rowid, * FROM "{table}" WHERE rowid >= ? ORDER BY rowid LIMIT 1',
                                (x,)).fetchall()
        except sqlite3.DatabaseError:
            return None

    step, low, high = 1, after + 1, None
    while after + step <= top + 1:
        if seek(after + step) is not None:
            high = after + step
            break
        low = after + step
        step *= 2
    if high is None:
        if seek(top + 1) is None:
            return None
        high = top + 1
    while low + 1 < high:  # the least x whose seek succeeds, between a failing low and a working high
        middle = (low + high) // 2
        if seek(middle) is None:
            low = middle
        else:
            high = middle
    found = seek(high)
    return (high, found[0]) if found else None


def _rowid_rows(conn: sqlite3.Connection, table: str, report: TableReport) -> Iterator[tuple[Any, ...]]:
    """Every readable row of a rowid table, rowid first, in rowid order."""
    try:
        top = conn.execute(f'SELECT max(rowid) FROM "{table}"').fetchone()[0]
    except sqlite3.DatabaseError:
        top = None
    if top is None:
        try:  # an empty table, or its last page is damaged: ask the other end
            top = conn.execute(f'SELECT rowid FROM "{table}" ORDER BY rowid DESC LIMIT 1').fetchone()
            top = top[0] if top else None
        except sqlite3.DatabaseError:
            top = 2**62
        if top is None:
            return
    start = -(2**63)  # the next rowid to read from (a seek to it never lands on a page before it)
    while True:
        try:
            batch = conn.execute(f'SELECT rowid, * FROM "{table}" WHERE rowid >= ? ORDER BY rowid LIMIT ?',
                                 (start, _BATCH)).fetchall()
        except sqlite3.DatabaseError:
            try:  # row by row up to the damaged page
                while True:
                    one = conn.execute(f'SELECT rowid, * FROM "{table}" WHERE rowid >= ? ORDER BY rowid LIMIT 1',
                                       (start,)).fetchall()
                    if not one:
                        return
                    yield one[0]
                    start = one[0][0] + 1
            except sqlite3.DatabaseError:
                pass
            found = _first_readable(conn, table, max(start - 1, 0), top)
            if found is None:
                report.lost.append(f"rowids from {start}")
                return
            report.lost.append(f"rowids {max(start, 1)}-{found[0] - 1}")
            start = found[0]
            continue
        if not batch:
            return
        yield from batch
        start = batch[-1][0] + 1


def _keyed_rows(conn: sqlite3.Connection, table: str, key: str, report: TableReport) -> Iterator[tuple[Any, ...]]:
    """Every readable row of a table without rowid: from the start in key order, then from the end."""
    seen: list[tuple[Any, ...]] = []
    try:
        for row in conn.execute(f'SELECT * FROM "{table}" ORDER BY "{key}"'):
            seen.append(row)
    except sqlite3.DatabaseError:
        tail: list[tuple[Any, ...]] = []
        try:
            for row in conn.execute(f'SELECT * FROM "{table}" ORDER BY "{key}" DESC'):
                if seen and row == seen[-1]:
                    break
                tail.append(row)
        except sqlite3.DatabaseError:
            pass
        report.lost.append("rows between the ends that could be read")
        seen.extend(reversed(tail))
    yield from seen


def recover(source: Path, target: Path, consumer: str | None = None) -> RecoveryReport:
    """Copy every readable row of the damaged database *source* into a new database *target*
    (which must not exist); the report says what could not be read."""
    if target.exists():
        raise DatabaseError(f"{target}: already exists; recover into a new file")
    old = _open_damaged(source)
    try:
        name = _consumer_of(old, source, consumer)
        new = consumers.open_db(target, name, create=True)
        report = RecoveryReport(str(source), str(target), name)
        try:
            _copy(old, new, report)
        finally:
            new.close()
    finally:
        old.close()
    with sqlite.reading(target) as conn:
        report.integrity = "; ".join(str(r[0]) for r in conn.execute("PRAGMA integrity_check(5)"))
    return report


def _copy(old: sqlite3.Connection, new: ConsumerDB, report: RecoveryReport) -> None:
    conn = new.conn
    tables = conn.execute("SELECT name, sql FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                          " ORDER BY name").fetchall()
    versions = conn.execute("SELECT key, value FROM meta WHERE key IN (?, ?)",
                            (CONSUMER_VERSION_KEY, SCHEMA_BY_KEY)).fetchall()
    with sqlite.transaction(conn):
        for table, sql in tables:
            if table in _NOT_COPIED:
                continue
            columns = [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')]
            part = TableReport(table)
            report.tables.append(part)
            try:
                old_columns = [r[1] for r in old.execute(f'PRAGMA table_info("{table}")')]
            except sqlite3.DatabaseError:
                old_columns = []
            if not old_columns:
                part.unreadable = True
                continue
            wanted = [c for c in columns if c in old_columns]
            without_rowid = "WITHOUT ROWID" in str(sql).upper()
            if without_rowid:
                key = next(r[1] for r in conn.execute(f'PRAGMA table_info("{table}")') if r[5] == 1)
                rows: Iterator[tuple[Any, ...]] = (
                    tuple(row[old_columns.index(c)] for c in wanted)
                    for row in _keyed_rows(old, table, key, part))
                names = wanted
            else:
                rows = (
                    (row[0], *(row[1 + old_columns.index(c)] for c in wanted))
                    for row in _rowid_rows(old, table, part))
                names = ["rowid", *wanted]
            quoted = ", ".join(c if c == "rowid" else f'"{c}"' for c in names)
            statement = f'INSERT OR REPLACE INTO "{table}" ({quoted}) VALUES ({", ".join("?" * len(names))})'
            for row in rows:
                conn.execute(statement, row)
                part.copied += 1
        # The schema is this release's, whatever the old file's meta said of its own.
        conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", versions)
        counters.rebuild(conn)


__all__ = ["RecoveryReport", "TableReport", "recover"]
