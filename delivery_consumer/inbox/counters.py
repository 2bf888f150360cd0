"""Receipt counters: receipts per (minute, result), (hour, result) and result.

``inbox_minutes`` holds one row per minute and result that has receipts;
triggers on it keep ``inbox_hours`` equal to its sums per hour and, under the
hour ``~`` (after every hour), per result. The writers fold the receipts in
at most every :data:`CATCH_UP_S` seconds, not at every commit: the receipts
above the rowid ``inbox_counted.last_rowid`` (appended since) are not in
the counters yet, and every reader adds them from the inbox (:func:`tail`),
so a read is exact at any moment and costs the minutes and hours of its
window plus the receipts of the last catch-up interval, never the whole
inbox. :func:`catch_up` runs inside a write transaction (the apply
transaction when due, prune before it deletes); prune subtracts what it
deleted, repartition rebuilds the counters of the databases it writes.
Why and at what cost: docs/system-view.md.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterable

#: The counters' tables: derived from the receipts, never copied with them (repartition rebuilds them).
TABLES = ("inbox_minutes", "inbox_hours", "inbox_counted")
#: At most this long (seconds) between two catch-ups of a writer that commits.
CATCH_UP_S = 1.0

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
_COUNTED = "SELECT last_rowid FROM inbox_counted"
#: The receipts not counted yet, per (minute, result).
_TAIL = ("SELECT substr(received_at, 1, 16), result, count(*) FROM inbox"
         " WHERE rowid > (SELECT last_rowid FROM inbox_counted) GROUP BY 1, 2")


def minute_of(received_at: str) -> str:
    """``YYYY-MM-DDTHH:MM`` of a stored time (``YYYY-MM-DDTHH:MM:SS.mmmZ``)."""
    return received_at[:16]


def catch_up(conn: sqlite3.Connection) -> None:
    """Count the receipts appended since the last catch-up (inside the writer's transaction)."""
    ((upto, last),) = conn.execute(
        "SELECT last_rowid, (SELECT coalesce(max(rowid), 0) FROM inbox) FROM inbox_counted").fetchall()
    if last > upto:
        conn.execute(
            "INSERT INTO inbox_minutes (minute, result, n) SELECT substr(received_at, 1, 16), result, count(*)"
            " FROM inbox WHERE rowid > ? AND rowid <= ? GROUP BY 1, 2"
            " ON CONFLICT (minute, result) DO UPDATE SET n = n + excluded.n", (upto, last))
    if last != upto:
        # Below *upto* only when receipts at the end were deleted (all counted, and uncounted by
        # subtract): the next receipt's rowid is then last + 1, which must not count as counted.
        conn.execute("UPDATE inbox_counted SET last_rowid = ?", (last,))


def tail(conn: sqlite3.Connection) -> list[tuple[str, str, int]]:
    """(minute, result, n) of the receipts not counted yet (read it in the snapshot of the counters)."""
    return conn.execute(_TAIL).fetchall()


def subtract(conn: sqlite3.Connection, deleted: Iterable[tuple[str, str]]) -> None:
    """Uncount deleted receipts, given as (received_at or minute, result) pairs.

    The caller deletes them in the transaction of a :func:`catch_up` (before the
    delete): every receipt deleted was counted."""
    counts = Counter((minute_of(at), result) for at, result in deleted)
    if not counts:
        return
    conn.executemany(_SUBTRACT, [(n, minute, result) for (minute, result), n in counts.items()])
    conn.executemany(_EMPTY, list(counts))
    catch_up(conn)  # the newest receipts deleted: the counted rowid comes down to the newest left


def rebuild(conn: sqlite3.Connection) -> None:
    """Recount everything from the receipts (inside the caller's transaction)."""
    conn.execute("DELETE FROM inbox_minutes")
    conn.execute("DELETE FROM inbox_hours")
    conn.execute(f"INSERT INTO inbox_minutes (minute, result, n) {RECOUNT}")
    conn.execute("UPDATE inbox_counted SET last_rowid = (SELECT coalesce(max(rowid), 0) FROM inbox)")


def totals(conn: sqlite3.Connection) -> dict[str, int]:
    """Receipts per result, in result order."""
    out: Counter[str] = Counter(dict(conn.execute(
        "SELECT result, n FROM inbox_hours WHERE hour = ? AND n > 0", (TOTAL,)).fetchall()))
    for _minute, result, n in tail(conn):
        out[result] += n
    return {result: n for result, n in sorted(out.items()) if n}


def inbox_rowid_before(conn: sqlite3.Connection, cutoff: str) -> int:
    """A rowid bound: the receipts at or below it are those received before *cutoff*.

    Receipts are appended in time order, so ``received_at < cutoff`` holds
    for a prefix of the rowids: a binary search over the rowid finds its end
    in ~log2(n) lookups, with no index on ``received_at``. Callers keep
    testing ``received_at`` too: if the clock ever went back, the prefix
    found may be off by the receipts written meanwhile (prune then keeps some
    old receipts longer and never deletes a younger one; a count of recent
    receipts may miss some written while the clock was behind).
    """
    # Two subqueries: SQLite reads one end of the b-tree for a lone min() or max(), all of it for both.
    ((low, high),) = conn.execute("SELECT (SELECT min(rowid) FROM inbox), (SELECT max(rowid) FROM inbox)").fetchall()
    if low is None:
        return 0
    high += 1  # the first rowid whose next receipt is not older than cutoff
    while low < high:
        middle = (low + high) // 2
        row = conn.execute(
            "SELECT rowid, received_at FROM inbox WHERE rowid >= ? ORDER BY rowid LIMIT 1", (middle,)
        ).fetchone()
        if row is None or row[1] >= cutoff:
            high = middle
        else:
            low = row[0] + 1
    return int(low) - 1


def since(conn: sqlite3.Connection, cutoff: str) -> dict[str, int]:
    """Receipts per result received at or after *cutoff* (a stored time), exactly.

    The hours after *cutoff*'s own and the minutes after *cutoff*'s own in
    its hour come from the counters; the counted receipts of that minute
    itself from the inbox, found by the rowid (receipts are appended in time
    order: :func:`inbox_rowid_before`), and the receipts not counted yet from
    the inbox's end.
    """
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
    ((counted,),) = conn.execute(_COUNTED).fetchall()
    low, high = inbox_rowid_before(conn, cutoff), min(inbox_rowid_before(conn, after), counted)
    if high > low:
        for result, n in conn.execute(
                "SELECT result, count(*) FROM inbox WHERE rowid > ? AND rowid <= ? AND received_at >= ?"
                " AND received_at < ? GROUP BY result", (low, high, cutoff, after)):
            out[result] += n
    for result, n in conn.execute(
            "SELECT result, count(*) FROM inbox WHERE rowid > ? AND received_at >= ? GROUP BY result",
            (counted, cutoff)):
        out[result] += n
    return {result: n for result, n in sorted(out.items()) if n}


def per_minute(conn: sqlite3.Connection, first: str, until: str | None = None) -> list[tuple[str, str, int]]:
    """(minute, result, n) of the whole minutes from *first* up to (not including) *until*."""
    low, high = minute_of(first), minute_of(until) if until else "9999"
    out: Counter[tuple[str, str]] = Counter()
    for minute, result, n in conn.execute(
            "SELECT minute, result, n FROM inbox_minutes WHERE minute >= ? AND minute < ? AND n > 0", (low, high)):
        out[minute, result] += n
    for minute, result, n in tail(conn):
        if low <= minute < high:
            out[minute, result] += n
    return [(minute, result, n) for (minute, result), n in out.items()]


__all__ = ["CATCH_UP_S", "RECOUNT", "TABLES", "TOTAL", "catch_up", "inbox_rowid_before", "minute_of", "per_minute",
           "rebuild", "since", "subtract", "tail", "totals"]
