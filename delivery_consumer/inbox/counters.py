"""Receipt counters: receipts per (minute, result), (hour, result) and result, kept by the writers.

``inbox_minutes`` holds one row per minute and result that has receipts;
triggers on it keep ``inbox_hours`` equal to its sums per hour and, under the
hour ``~`` (after every hour), per result. The
writers of ``inbox`` change the minutes, a batch at a time: the apply
transaction adds its receipts before COMMIT (all stamped with one time, so
one row per result), prune subtracts what it deleted, repartition rebuilds
the counters of the databases it writes. Reads (status, ``inbox stats``, the
console's chart) then cost the number of minutes and hours in a window, not
the number of receipts. Why and at what cost: docs/system-view.md.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterable

_ADD = (
    "INSERT INTO inbox_minutes (minute, result, n) VALUES (?, ?, ?)"
    " ON CONFLICT (minute, result) DO UPDATE SET n = n + excluded.n"
)
_SUBTRACT = "UPDATE inbox_minutes SET n = n - ? WHERE minute = ? AND result = ?"
_EMPTY = "DELETE FROM inbox_minutes WHERE minute = ? AND result = ? AND n <= 0"
#: The hour of the totals per result in ``inbox_hours``: it sorts after every hour.
TOTAL = "~"
#: A full recount from the receipts (the migration's backfill, repartition).
RECOUNT = "SELECT substr(received_at, 1, 16), result, count(*) FROM inbox GROUP BY 1, 2"


def minute_of(received_at: str) -> str:
    """``YYYY-MM-DDTHH:MM`` of a stored time (``YYYY-MM-DDTHH:MM:SS.mmmZ``)."""
    return received_at[:16]


def add(conn: sqlite3.Connection, minute: str, results: Iterable[str]) -> None:
    """Count receipts written at *minute* with *results* (inside the writer's transaction)."""
    counts = Counter(results)
    if len(counts) == 1:
        ((result, n),) = counts.items()
        conn.execute(_ADD, (minute, result, n))
    elif counts:
        conn.executemany(_ADD, [(minute, result, n) for result, n in counts.items()])


def subtract(conn: sqlite3.Connection, deleted: Iterable[tuple[str, str]]) -> None:
    """Uncount deleted receipts, given as (received_at or minute, result) pairs."""
    counts = Counter((minute_of(at), result) for at, result in deleted)
    if not counts:
        return
    conn.executemany(_SUBTRACT, [(n, minute, result) for (minute, result), n in counts.items()])
    conn.executemany(_EMPTY, list(counts))


def rebuild(conn: sqlite3.Connection) -> None:
    """Recount everything from the receipts (inside the caller's transaction)."""
    conn.execute("DELETE FROM inbox_minutes")
    conn.execute("DELETE FROM inbox_hours")
    conn.execute(f"INSERT INTO inbox_minutes (minute, result, n) {RECOUNT}")


def totals(conn: sqlite3.Connection) -> dict[str, int]:
    """Receipts per result, in result order."""
    return dict(conn.execute(
        "SELECT result, n FROM inbox_hours WHERE hour = ? AND n > 0 ORDER BY result", (TOTAL,)).fetchall())


def since(conn: sqlite3.Connection, cutoff: str) -> dict[str, int]:
    """Receipts per result received at or after *cutoff* (a stored time), exactly.

    The hours after *cutoff*'s own and the minutes after *cutoff*'s own in
    its hour come from the counters; the receipts of that minute itself from
    the inbox, found by the rowid (receipts are appended in time order:
    :func:`inbox_rowid_before`).
    """
    from .database import inbox_rowid_before  # database imports apply, which imports this module

    minute = minute_of(cutoff)
    hour = minute[:13]
    out: Counter[str] = Counter()
    for result, n in conn.execute(
            "SELECT result, sum(n) FROM inbox_hours WHERE hour > ? AND hour < ? GROUP BY result", (hour, TOTAL)):
        out[result] += n
    for result, n in conn.execute(
            "SELECT result, sum(n) FROM inbox_minutes WHERE minute > ? AND minute < ? GROUP BY result",
            (minute, hour + "~")):
        out[result] += n
    after = minute + "~"  # sorts after every time within the minute
    low, high = inbox_rowid_before(conn, cutoff), inbox_rowid_before(conn, after)
    if high > low:
        for result, n in conn.execute(
                "SELECT result, count(*) FROM inbox WHERE rowid > ? AND rowid <= ? AND received_at >= ?"
                " AND received_at < ? GROUP BY result", (low, high, cutoff, after)):
            out[result] += n
    return {result: n for result, n in sorted(out.items()) if n}


def per_minute(conn: sqlite3.Connection, first: str, until: str | None = None) -> list[tuple[str, str, int]]:
    """(minute, result, n) of the whole minutes from *first* up to (not including) *until*."""
    return conn.execute(
        "SELECT minute, result, n FROM inbox_minutes WHERE minute >= ? AND minute < ? AND n > 0",
        (minute_of(first), minute_of(until) if until else "9999")).fetchall()


__all__ = ["RECOUNT", "TOTAL", "add", "minute_of", "per_minute", "rebuild", "since", "subtract", "totals"]
