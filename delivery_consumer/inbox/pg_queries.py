"""The operator's reads of a PostgreSQL inbox: what :mod:`delivery_consumer.inbox.reports` and
:mod:`delivery_consumer.inbox.views` answer for a SQLite file, in PostgreSQL's words.

Each runs in one read-only transaction (``REPEATABLE READ``: several SELECTs see one
state) on the inbox's connection; the answers have the shapes of the SQLite ones. What
differs: receipts are ordered by their ``seq`` (SQLite's rowid), the receipt counts come
from the receipts' ``received_at`` index (no counters are kept), ``rowid`` in a view's
order is the row's physical place (``ctid``: insertion order for an append-only table),
and ``query`` is guarded by the transaction's ``READ ONLY`` and a ``statement_timeout``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..model.contract import View
from ..model.errors import QueryError
from ..store.sqlite import age_s, now_iso
from .pg import PgInboxDB, psycopg_module, translate

Row = dict[str, Any]
HOUR_S, DAY_S = 3600.0, 86400.0
_RECEIPT = "SELECT event_id, event_type, result, received_at, fingerprint FROM inbox"


@contextmanager
def snapshot(db: PgInboxDB) -> Iterator[Any]:
    """A read-only REPEATABLE READ transaction on the inbox's connection; psycopg's errors as the project's."""
    psycopg = psycopg_module()
    raw = db.raw()
    try:
        raw.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            yield raw
        finally:
            raw.execute("ROLLBACK")
    except psycopg.Error as exc:
        db.rollback()
        raise translate(exc, db.label) from None


def _camel(column: str) -> str:
    head, *rest = column.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _receipt(row: Any) -> Row:
    return {"eventId": row[0], "type": row[1], "result": row[2], "receivedAt": row[3], "fingerprint": row[4]}


def dict_rows(cursor: Any) -> list[Row]:
    """All rows of *cursor* as dicts keyed by camelCase column names (as ``queries.dict_rows``)."""
    names = [_camel(column.name) for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def inbox_list(db: PgInboxDB, *, result: str | None = None, limit: int | None = 50) -> list[Row]:
    where, params = ("WHERE result = %s", [result]) if result is not None else ("", [])
    with snapshot(db) as raw:
        rows = raw.execute(f"{_RECEIPT} {where} ORDER BY seq DESC LIMIT %s", [*params, limit or None]).fetchall()
    return [_receipt(row) for row in rows]


def inbox_stats(db: PgInboxDB, *, now: float | None = None) -> Row:
    now = time.time() if now is None else now
    hour, day = now_iso(now - HOUR_S), now_iso(now - DAY_S)
    with snapshot(db) as raw:
        by_result = raw.execute(
            "SELECT result, count(*), count(*) FILTER (WHERE received_at >= %s),"
            " count(*) FILTER (WHERE received_at >= %s) FROM inbox GROUP BY result ORDER BY result",
            (hour, day)).fetchall()
        oldest, newest = raw.execute("SELECT min(received_at), max(received_at) FROM inbox").fetchone()
        by_code = raw.execute(
            "SELECT code, count(*), count(*) - count(resolved_at) FROM rejected GROUP BY code ORDER BY code").fetchall()
    return {
        "consumer": db.consumer, "database": str(db.path), "now": now_iso(now),
        "receipts": sum(row[1] for row in by_result),
        "byResult": {row[0]: row[1] for row in by_result},
        "lastHour": {row[0]: row[2] for row in by_result if row[2]},
        "lastDay": {row[0]: row[3] for row in by_result if row[3]},
        "oldestReceivedAt": oldest, "oldestAgeSeconds": age_s(oldest, now), "newestReceivedAt": newest,
        "rejected": sum(row[1] for row in by_code),
        "rejectedByCode": {row[0]: row[1] for row in by_code},
        "unresolvedByCode": {row[0]: row[2] for row in by_code},
    }


def rejected_list(db: PgInboxDB, *, code: str | None = None, limit: int | None = 50) -> list[Row]:
    where, params = ("WHERE code = %s", [code]) if code is not None else ("", [])
    with snapshot(db) as raw:
        return dict_rows(raw.execute(f"SELECT * FROM rejected {where} ORDER BY id DESC LIMIT %s",
                                     [*params, limit or None]))


def view_select(db: PgInboxDB, view: View, where: Mapping[str, Any], limit: int) -> list[Any]:
    """The rows of a view's SELECT (its columns, then its order's), in its order, at most *limit* (0: all)."""
    terms = [(term.lstrip("-"), term.startswith("-")) for term in view.order]
    place = {"rowid": "ctid"}
    picks = [*view.columns, *(place.get(c, c) for c, _ in terms)]
    conds = " AND ".join(f"{column} = %s" for column in where)
    order = ", ".join(f"{place.get(c, c)} DESC" if desc else place.get(c, c) for c, desc in terms)
    sql = (f"SELECT {', '.join(picks)} FROM {view.table}" + (f" WHERE {conds}" if conds else "")
           + (f" ORDER BY {order}" if order else "") + " LIMIT %s")
    with snapshot(db) as raw:
        rows = raw.execute(sql, [*where.values(), limit or None]).fetchall()
    # ctid orders as (page, item): the sort in Python keeps the same order.
    return [tuple(_sortable(v) for v in row) for row in rows]


def _sortable(value: Any) -> Any:
    if isinstance(value, str) and value.startswith("(") and value.endswith(")") and "," in value:
        page, _, item = value[1:-1].partition(",")
        if page.isdigit() and item.isdigit():
            return (int(page), int(item))
    return value


def query(db: PgInboxDB, sql: str, *, timeout_s: float, max_bytes: int) -> Row:
    """One read-only statement in a ``READ ONLY`` transaction with a ``statement_timeout``:
    ``{"columns", "rows"}``; a write, a second statement or a timeout is a QueryError."""
    psycopg = psycopg_module()
    if not sql.strip():
        raise QueryError("query refused: the SQL is empty")
    raw = db.raw()
    try:
        raw.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            raw.execute(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}")
            cursor = raw.cursor()
            # Prepared: one statement only (a second, such as "COMMIT; DELETE ...", is refused by the server).
            cursor.execute(sql.encode("utf-8"), prepare=True)
            columns = [column.name for column in cursor.description or ()]
            rows: list[list[Any]] = []
            size = 0
            for row in cursor:
                values = [f"X'{v.hex().upper()}'" if isinstance(v, bytes | memoryview) and not isinstance(v, str)
                          else v for v in row]
                size += sum(len(v) if isinstance(v, str) else 8 for v in values)
                rows.append(values)
                if size > max_bytes:
                    raise QueryError(f"query stopped: its result passed {max_bytes >> 20} MB after {len(rows)} rows"
                                     " (narrow it: LIMIT, WHERE, fewer columns)")
        finally:
            db.rollback()
    except psycopg.errors.QueryCanceled:
        raise QueryError(f"query stopped: still running after {timeout_s:g}s (give a longer --timeout if it is "
                         "meant to take that long)") from None
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        raise QueryError(f"query refused: {str(exc).splitlines()[0]} (the query is read-only)") from None
    except (psycopg.errors.SyntaxError, psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn,
            psycopg.errors.UndefinedFunction, psycopg.ProgrammingError, psycopg.errors.ActiveSqlTransaction,
            psycopg.errors.InsufficientPrivilege) as exc:
        raise QueryError(f"query refused: {' '.join(str(exc).split())}") from None
    except psycopg.Error as exc:
        raise translate(exc, db.label) from None
    return {"columns": columns, "rows": rows}


__all__ = ["inbox_list", "inbox_stats", "query", "rejected_list", "snapshot", "view_select"]
