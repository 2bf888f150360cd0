"""Read-only queries behind the inspect commands.

Every function takes an open :class:`~delivery_consumer.inbox.ConsumerDB`
(the inspect commands open it with ``readonly=True``, i.e. ``mode=ro``) and
returns plain dicts and lists, ready for ``orjson.dumps``: keys are the
envelope's camelCase names, times the store's ISO-8601 UTC text.

Reads are kept short so that a running consumer is never held up: the
connection is in autocommit mode, every statement is read to the end with ``fetchall`` (an
unfinished SELECT keeps its WAL snapshot open and stops checkpoints), and
the functions that need several statements to agree run them in one
deferred read transaction that ends before they return.

Errors: :class:`NotFound` for an unknown key, :class:`QueryError` for SQL
that ``query`` refuses or that fails, :class:`~delivery_consumer.model.errors.DatabaseError`
when the file itself is unusable (corrupt, of a consumer without the table).
"""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

import orjson

from ..model.durations import format as format_duration
from ..model.errors import FORWARDED, NotFound, QueryError
from ..store.sqlite import age_s, now_iso, read_snapshot, translate
from . import ConsumerDB, counters
from .dialect import words_for

if TYPE_CHECKING:
    from ..model.contract import Connection
    from .pg import PgInboxDB
    from .seam import InboxReader

P = ParamSpec("P")
T = TypeVar("T")

#: How long one ad-hoc statement may run, the fetch of its result included, before it is stopped.
QUERY_TIMEOUT_S: Final = 10.0
#: The largest result of an ad-hoc statement (bytes of its values as shown),
#: and the largest string or BLOB SQLite may make while running it.
QUERY_MAX_BYTES: Final = 32 << 20
#: Rows fetched at a time (the clock and the size are checked between).
_FETCH_ROWS: Final = 500
#: SQLite virtual-machine steps between two looks at the clock (a few hundred
#: microseconds of work).
_CLOCK_EVERY: Final = 10_000

#: Windows of ``inbox_stats``, in seconds.
HOUR_S = 3600
DAY_S = 86400

#: Pragmas that take an argument and still only read (a table or index name,
#: or a row limit); any other pragma with an argument sets something.
READ_PRAGMAS_WITH_ARGUMENT = frozenset(
    {
        "table_info",
        "table_xinfo",
        "table_list",
        "index_list",
        "index_info",
        "index_xinfo",
        "foreign_key_list",
        "foreign_key_check",
        "integrity_check",
        "quick_check",
    }
)

#: Pragmas that write (or try to) even without an argument.
WRITING_PRAGMAS = frozenset({"wal_checkpoint", "optimize", "incremental_vacuum"})

Row = dict[str, Any]


def reads(fn: Callable[P, T]) -> Callable[P, T]:
    """Map sqlite3 errors met while reading to the project's own errors.

    A file can pass the checks of ``ConsumerDB.open`` and still have damaged
    pages, which only a read discovers.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except sqlite3.Error as exc:
            db = args[0]
            path = db.path if isinstance(db, ConsumerDB) else "database"
            raise translate(exc, path) from None

    return wrapper


def pg_inbox(db: object) -> PgInboxDB | None:
    """*db* when it is a PostgreSQL inbox (whose reads are ``inbox/pg_queries.py``), else None."""
    if getattr(getattr(db, "conn", None), "dialect", "sqlite") != "postgres":
        return None
    from .pg import PgInboxDB

    return db if isinstance(db, PgInboxDB) else None


def snapshot(db: InboxReader) -> AbstractContextManager[Any]:
    """One read transaction on *db*'s connection, SQLite's or PostgreSQL's."""
    if (pg := pg_inbox(db)) is not None:
        from . import pg_queries

        return pg_queries.snapshot(pg)
    return read_snapshot(sqlite_db(db).conn)


def sqlite_db(db: InboxReader) -> ConsumerDB:
    """*db* as the SQLite inbox it is, where a read words SQLite's own (pragmas, its counters)."""
    if not isinstance(db, ConsumerDB):
        raise TypeError(f"{db.path}: not a SQLite inbox")
    return db


def sql_limit(limit: int | None) -> int:
    """SQLite's LIMIT value: None or 0 mean no limit."""
    return limit if limit else -1


# -- inbox ---------------------------------------------------------------------

_RECEIPT = "SELECT event_id, event_type, result, received_at, fingerprint FROM inbox"


def _receipt(row: tuple[Any, ...]) -> Row:
    return {
        "eventId": row[0],
        "type": row[1],
        "result": row[2],
        "receivedAt": row[3],
        "fingerprint": row[4],
    }


@reads
def inbox_list(db: InboxReader, *, result: str | None = None, limit: int | None = 50) -> list[Row]:
    """Receipts, newest first, optionally only those with *result*.

    Newest is the last written: receipts are appended in the order they were
    received (the rowid), which reads from the end of the table without an
    index on ``receivedAt``. ``limit`` None or 0 lists them all.
    """
    if (pg := pg_inbox(db)) is not None:
        from . import pg_queries

        return pg_queries.inbox_list(pg, result=result, limit=limit)
    where, params = ("WHERE result = ?", [result]) if result is not None else ("", [])
    rows = db.conn.execute(
        f"{_RECEIPT} {where} ORDER BY rowid DESC LIMIT ?",
        [*params, sql_limit(limit)],
    ).fetchall()
    return [_receipt(row) for row in rows]


def receipt_row(conn: Connection, event_id: str) -> Row | None:
    """The receipt of *event_id* with its key, the envelope's ``meta`` (a dict, or None)
    and, for an event that came as a CloudEvent, its ``cloudEvent`` (``{"id", "source"}``)."""
    rows = conn.execute(f"{_RECEIPT.replace(' FROM', ', partition_key, meta, origin FROM')} WHERE event_id = ?",
                        (event_id,)).fetchall()
    if not rows:
        return None
    receipt = _receipt(rows[0])
    receipt["key"], meta, origin = rows[0][5:]
    receipt["meta"] = orjson.loads(meta) if meta is not None else None
    if origin is not None:
        receipt["cloudEvent"] = origin_of(origin)
    return receipt


def origin_of(column: str | None) -> Row | None:
    """A receipt's or a rejection's ``origin`` column: the CloudEvent's ``{"id", "source"}``, or None."""
    if column is None:
        return None
    value = orjson.loads(column)
    return value if isinstance(value, dict) else None


def camel(column: str) -> str:
    head, *rest = column.split("_")
    return head + "".join(part.capitalize() for part in rest)


def dict_rows(cursor: Any) -> list[Row]:
    """All rows of *cursor* as dicts keyed by camelCase column names.

    For the store's bookkeeping tables (``rejected``, ``deliveries``), whose
    columns grow with later migrations: a new column shows up without a change here.
    """
    names = [camel(column[0]) for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def deliveries_summary(records: list[Row], receipt: Row | None) -> Row:
    """Totals of the ``deliveries`` rows, completed by the receipt.

    ``run`` writes no row for the common case -- a first delivery, first
    attempt, applied -- because the receipt records it (one delivery at
    ``received_at``). So a receipt newer than every row stands for one more
    delivery, the one that applied the event (after a retry or a requeue the
    copy may again be a "first" delivery); ``fromReceipt`` says so.
    """
    summary: Row = {"deliveries": 0, "redeliveries": 0, "attempts": 0, "crashes": 0, "firstAt": None,
                    "lastAt": None, "lastOutcome": None, "fromReceipt": False, "records": records}
    if records:
        last = max(records, key=lambda r: r["lastAt"])
        summary.update({
            "deliveries": sum(r["deliveries"] for r in records),
            "redeliveries": sum(r["redeliveries"] for r in records),
            "attempts": max(r["attempts"] for r in records),
            "crashes": sum(r["crashes"] for r in records),
            "firstAt": min(r["firstAt"] for r in records),
            "lastAt": last["lastAt"],
            "lastOutcome": last["lastOutcome"],
        })
    if receipt is not None and summary["firstAt"] is not None and receipt["receivedAt"] < summary["firstAt"]:
        # A row a duplicate began (0.1.0 stamped it with the duplicate's time): the receipt is older.
        summary["firstAt"] = receipt["receivedAt"]
    if receipt is not None and (summary["lastAt"] is None or receipt["receivedAt"] > summary["lastAt"]):
        summary.update({
            "deliveries": summary["deliveries"] + 1,
            "attempts": max(summary["attempts"], 1),
            "firstAt": summary["firstAt"] or receipt["receivedAt"],
            "lastAt": receipt["receivedAt"],
            "lastOutcome": receipt["result"],
            "fromReceipt": True,
        })
    return summary


@reads
def inbox_show(db: InboxReader, event_id: str) -> Row:
    """Everything the database knows about one eventId.

    ``receipt`` is None when the event was only ever rejected; NotFound when
    the eventId appears nowhere (receipt, rejections, deliveries).
    """
    conn = db.conn
    with snapshot(db):
        receipt = receipt_row(conn, event_id)
        rejected = dict_rows(conn.execute("SELECT * FROM rejected WHERE event_id = ? ORDER BY id", (event_id,)))
        for row in rejected:
            row["origin"] = origin_of(row.get("origin"))
        deliveries = dict_rows(
            conn.execute("SELECT * FROM deliveries WHERE event_id = ? ORDER BY first_at, key", (event_id,))
        )
    if receipt is None and not rejected and not deliveries:
        raise NotFound(f"eventId {event_id} not found in {db.path}")
    counted = deliveries_summary(deliveries, receipt)
    return {
        "eventId": event_id,
        "receipt": receipt,
        "rejected": rejected,
        "deliveries": deliveries,
        # as trace counts them: a first delivery applied at once has no row, its receipt stands for it
        "deliveryCount": counted["deliveries"],
        "deliveryFromReceipt": counted["fromReceipt"],
    }


@reads
def inbox_stats(db: InboxReader, *, now: float | None = None) -> Row:
    """Receipts by result (overall, last hour, last day), their age, rejections by code.

    *now* (a Unix time) fixes the clock for the windows and the age.
    """
    if (pg := pg_inbox(db)) is not None:
        from . import pg_queries

        return pg_queries.inbox_stats(pg, now=now)
    now = time.time() if now is None else now
    conn = sqlite_db(db).conn
    with read_snapshot(conn):
        # The counters kept by the writers (inbox/counters.py), not a scan of the receipts.
        totals = counters.totals(conn)
        hour, day = counters.since(conn, now_iso(now - HOUR_S)), counters.since(conn, now_iso(now - DAY_S))
        by_result = [(result, n, hour.get(result, 0), day.get(result, 0)) for result, n in totals.items()]
        # Receipts are appended in time order: the oldest and newest are at the ends of the rowid.
        (oldest,) = conn.execute(
            "SELECT min(received_at) FROM (SELECT received_at FROM inbox ORDER BY rowid LIMIT 1000)").fetchone()
        (newest,) = conn.execute(
            "SELECT max(received_at) FROM (SELECT received_at FROM inbox ORDER BY rowid DESC LIMIT 1000)").fetchone()
        by_code = conn.execute(
            "SELECT code, count(*), count(*) - count(resolved_at) FROM rejected GROUP BY code ORDER BY code"
        ).fetchall()
    return {
        "consumer": db.consumer,
        "database": str(db.path),
        "now": now_iso(now),
        "receipts": sum(row[1] for row in by_result),
        "byResult": {row[0]: row[1] for row in by_result},
        "lastHour": {row[0]: row[2] for row in by_result},
        "lastDay": {row[0]: row[3] for row in by_result},
        "oldestReceivedAt": oldest,
        "oldestAgeSeconds": age_s(oldest, now),
        "newestReceivedAt": newest,
        "rejected": sum(row[1] for row in by_code),
        "rejectedByCode": {row[0]: row[1] for row in by_code},
        "unresolvedByCode": {row[0]: row[2] for row in by_code},
    }


# -- rejected ------------------------------------------------------------------


@reads
def rejected_list(db: InboxReader, *, code: str | None = None, limit: int | None = 50) -> list[Row]:
    """Rejections, newest first, optionally only those with *code*."""
    if (pg := pg_inbox(db)) is not None:
        from . import pg_queries

        return pg_queries.rejected_list(pg, code=code, limit=limit)
    where, params = ("WHERE code = ?", [code]) if code is not None else ("", [])
    return dict_rows(
        db.conn.execute(f"SELECT * FROM rejected {where} ORDER BY id DESC LIMIT ?", [*params, sql_limit(limit)])
    )


# -- across a deployment (status, trace of a key) ---------------------------------

#: Receipt windows of ``status``, in seconds.
MINUTE_S = 60


def status_figures(db: Any, now: float) -> Row:
    """What ``status`` shows of one inbox, on either backend (one read snapshot): receipts in the
    last minute and hour, the newest receipt, the last progress (a receipt or a rejection),
    unresolved rejections by code, and the events of other partitions sent on in the last hour."""
    words = words_for(db)
    with snapshot(db):
        conn = db.conn
        last_minute = words.receipts_since(conn, now_iso(now - MINUTE_S))
        last_hour = words.receipts_since(conn, now_iso(now - HOUR_S))
        newest = words.newest_received(conn)
        (rejected,) = conn.execute("SELECT rejected_at FROM rejected ORDER BY id DESC LIMIT 1").fetchone() or (None,)
        unresolved = conn.execute(
            "SELECT code, count(*) FROM rejected WHERE resolved_at IS NULL GROUP BY code ORDER BY code").fetchall()
        # Events of other partitions this one's run sent on to theirs (misplaced: run records forwarded:p<k>).
        forwarded, last_forwarded = conn.execute(
            "SELECT count(*), max(last_at) FROM deliveries WHERE last_at >= ? AND last_outcome LIKE ?",
            (now_iso(now - HOUR_S), f"{FORWARDED}:%")).fetchone()
    progress = max((t for t in (newest, rejected) if t), default=None)
    return {"receiptsLastMinute": last_minute, "receiptsLastHour": last_hour, "newestReceivedAt": newest,
            "newestAgeSeconds": age_s(newest, now), "lastProgressAgeSeconds": age_s(progress, now),
            "unresolvedRejections": {str(code): int(n) for code, n in unresolved},
            "forwardedLastHour": int(forwarded), "lastForwardedAt": last_forwarded}


def outcomes_per_minute(db: Any, since: str, until: str | None = None,
                        ) -> tuple[list[tuple[str, str, int]], list[tuple[str, int]]]:
    """(minute, result, n) of the receipts and (minute, n) of the rejections of the minutes in
    [*since*, *until*) (``YYYY-MM-DDTHH:MM``; None: up to now): on SQLite from the writers'
    counters per minute (inbox/counters.py), on PostgreSQL over the receipts' index."""
    with snapshot(db):
        out = words_for(db).per_minute(db.conn, since, until)
        rows = db.conn.execute(
            "SELECT substr(rejected_at, 1, 16), count(*) FROM rejected"
            " WHERE rejected_at >= ? AND rejected_at < ? GROUP BY 1", (since, until or "9999")).fetchall()
    return out, [(str(minute), int(n)) for minute, n in rows]


def key_rows(db: Any, key: str) -> dict[str, Row]:
    """eventId -> {revision, type} from every effect table with a key column (the
    view's ``key_column``, else ``entity_key`` (the fence) or ``article_id``) and an ``event_id`` column."""
    out: dict[str, Row] = {}
    words = words_for(db)
    view = db.spec.view
    with snapshot(db):
        for table in dict.fromkeys([*db.spec.tables, *([view.table] if view is not None else [])]):
            columns = words.columns(db.conn, table)
            key_column = (view.key_column if view is not None and view.table == table and view.key_column
                          else "entity_key" if "entity_key" in columns else "article_id")
            if not {key_column, "event_id"} <= columns:
                continue
            picks = ["event_id", "revision" if "revision" in columns else "NULL",
                     "event_type" if "event_type" in columns else "NULL"]
            for event_id, revision, event_type in db.conn.execute(
                    f'SELECT {", ".join(picks)} FROM "{table}" WHERE "{key_column}" = ?', (key,)).fetchall():
                seen = out.setdefault(event_id, {})
                seen.setdefault("revision", revision)
                if event_type:
                    seen["type"] = event_type
    return out


def receipts_by_id(db: Any, event_ids: list[str]) -> dict[str, Row]:
    """eventId -> {result, receivedAt} of each of *event_ids* that has a receipt."""
    if not event_ids:
        return {}
    rows = db.conn.execute(
        f"SELECT event_id, result, received_at FROM inbox WHERE event_id IN ({words_for(db).texts_table})",
        (orjson.dumps(event_ids).decode(),)).fetchall()
    return {r[0]: {"result": r[1], "receivedAt": r[2]} for r in rows}


# -- ad-hoc SQL ----------------------------------------------------------------


def _json_value(value: Any) -> Any:
    """BLOBs as SQL hex literals (JSON has no bytes); the rest as they are."""
    if isinstance(value, bytes):
        return f"X'{value.hex().upper()}'"
    return value


#: Authorizer actions refused in ad-hoc SQL, with the name the user is shown.
_DENIED_ACTIONS: Final[Mapping[int, str]] = {
    sqlite3.SQLITE_ATTACH: "ATTACH (and VACUUM INTO)",
    sqlite3.SQLITE_DETACH: "DETACH",
    sqlite3.SQLITE_TRANSACTION: "BEGIN/COMMIT/ROLLBACK",
    sqlite3.SQLITE_SAVEPOINT: "SAVEPOINT",
}
#: SQL functions refused in ad-hoc SQL: ``fts3_tokenizer`` hands out (and
#: takes) raw pointers; the others load code or touch files, where a build
#: or a shell extension provides them.
DENIED_FUNCTIONS: Final = frozenset({"fts3_tokenizer", "load_extension", "readfile", "writefile", "edit"})


class _ReadOnlyAuthorizer:
    """SQLite authorizer for ad-hoc SQL: refuses what ``mode=ro`` lets through.

    A read-only connection still accepts ATTACH (and so ``VACUUM INTO``, which
    attaches its target: it would write a new file), BEGIN (a snapshot left
    open would stop checkpoints) and pragmas that change the connection, such
    as ``query_only = OFF``. Writes to the database itself are refused by
    SQLite (``mode=ro`` and ``query_only``). https://sqlite.org/c3ref/set_authorizer.html
    """

    def __init__(self) -> None:
        self.denied: str | None = None

    def __call__(self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _src: str | None) -> int:
        what = _DENIED_ACTIONS.get(action)
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in DENIED_FUNCTIONS:
            what = f"the function {(arg2 or '').lower()}()"
        if action == sqlite3.SQLITE_PRAGMA:
            if arg1 in WRITING_PRAGMAS:
                what = f"PRAGMA {arg1}"
            elif arg2 is not None and arg1 not in READ_PRAGMAS_WITH_ARGUMENT:
                what = f"PRAGMA {arg1} with a value"
        if what is None:
            return sqlite3.SQLITE_OK
        self.denied = self.denied or what
        return sqlite3.SQLITE_DENY


def _query_error(exc: Exception, auth: _ReadOnlyAuthorizer) -> QueryError:
    message = str(exc)
    if auth.denied is not None:
        return QueryError(f"query refused: {auth.denied} is not allowed, the query may only read")
    if "one statement" in message:
        return QueryError("query refused: give exactly one SQL statement")
    if "readonly" in message or "query_only" in message:
        return QueryError(f"query refused: the query may only read ({message})")
    return QueryError(f"query failed: {message}")


class _Deadline:
    """SQLite progress handler that stops the statement once time is up
    (https://sqlite.org/c3ref/progress_handler.html): an endless recursive
    CTE would otherwise burn a core and hold its read snapshot forever."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.passed = False

    def __call__(self) -> int:
        self.passed = time.monotonic() >= self.at
        return self.passed


@reads
def query(db: InboxReader, sql: str, *, timeout_s: float = QUERY_TIMEOUT_S, max_bytes: int = QUERY_MAX_BYTES) -> Row:
    """Run one read-only SQL statement; ``{"columns": [...], "rows": [[...], ...]}``.

    Needs a database opened read-only. Refuses several statements, writes,
    ATTACH, transactions, pragmas that set a value and :data:`DENIED_FUNCTIONS`;
    stops a statement still running -- or still being fetched -- after
    *timeout_s* seconds, and one whose result (or any value it makes) passes
    *max_bytes* (:class:`QueryError`).
    """
    if not db.readonly:
        raise QueryError("query needs a database opened read-only")
    if (pg := pg_inbox(db)) is not None:
        from . import pg_queries

        return pg_queries.query(pg, sql, timeout_s=timeout_s, max_bytes=max_bytes)
    if not sql.strip():
        raise QueryError("query refused: the SQL is empty")
    conn = sqlite_db(db).conn
    conn.execute("PRAGMA query_only = ON")
    auth = _ReadOnlyAuthorizer()
    conn.set_authorizer(auth)
    deadline = _Deadline(timeout_s)
    conn.set_progress_handler(deadline, _CLOCK_EVERY)
    length = conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_bytes)  # randomblob(1e9) fails instead of allocating
    cursor: sqlite3.Cursor | None = None
    try:
        cursor = conn.execute(sql)
        columns = [column[0] for column in cursor.description or ()]
        rows: list[list[Any]] = []
        size = 0
        while batch := cursor.fetchmany(_FETCH_ROWS):
            for row in batch:
                values = [_json_value(value) for value in row]
                size += sum(len(v) if isinstance(v, str) else 8 for v in values)
                rows.append(values)
            if size > max_bytes:
                raise QueryError(f"query stopped: its result passed {max_bytes >> 20} MB after {len(rows)} rows "
                                 "(narrow it: LIMIT, WHERE, fewer columns)")
            if deadline():
                raise sqlite3.OperationalError("interrupted")  # as SQLite says it: handled below
    except sqlite3.DatabaseError as exc:
        if "too big" in str(exc):
            raise QueryError(f"query stopped: it makes a value over {max_bytes >> 20} MB "
                             "(the most a query may show)") from None
        if deadline.passed:
            raise QueryError(f"query stopped: still running after {format_duration(timeout_s)} "
                             "(give a longer --timeout if it is meant to take that long)") from None
        # A denial by the authorizer is SQLITE_AUTH, a plain DatabaseError.
        if auth.denied is not None or isinstance(exc, sqlite3.OperationalError | sqlite3.ProgrammingError):
            raise _query_error(exc, auth) from None
        raise  # a damaged page and the like: the file, not the query (see reads)
    finally:
        if cursor is not None:
            cursor.close()  # resets the statement: no read snapshot stays open
        conn.set_authorizer(None)
        conn.set_progress_handler(None, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, length)
    return {"columns": columns, "rows": rows}


__all__ = [
    "DENIED_FUNCTIONS",
    "QUERY_MAX_BYTES",
    "QUERY_TIMEOUT_S",
    "camel",
    "deliveries_summary",
    "dict_rows",
    "inbox_list",
    "inbox_show",
    "inbox_stats",
    "key_rows",
    "origin_of",
    "outcomes_per_minute",
    "pg_inbox",
    "query",
    "reads",
    "receipt_row",
    "receipts_by_id",
    "rejected_list",
    "snapshot",
    "sql_limit",
    "sqlite_db",
    "status_figures",
]
