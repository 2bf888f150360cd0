"""The read-only query library behind the inspect commands, on real SQLite files."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from delivery_consumer import consumers
from delivery_consumer.consumers.catalog import SPEC as CATALOG_SPEC
from delivery_consumer.inbox import ConsumerDB, apply_event, database, views
from delivery_consumer.inbox import apply as inbox_apply
from delivery_consumer.inbox import reports as queries
from delivery_consumer.model.envelope import from_mapping
from delivery_consumer.model.errors import DatabaseError, NotFound, QueryError, Rejection

assert CATALOG_SPEC.view is not None
CATALOG = CATALOG_SPEC.view

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC).timestamp()


def envelope(*, event_id: str | None = None, revision: int = 1, article: str = "article-42", **data: str) -> Any:
    """A validated envelope; a new eventId unless one is given."""
    return from_mapping(
        {
            "eventId": event_id or str(uuid.uuid4()),
            "type": "material.published",
            "articleId": article,
            "revision": revision,
            "occurredAt": "2026-11-29T10:00:00Z",
            "data": {"title": data.get("title", "Доставка без потерь"), "url": "https://example.org/a/42"},
        }
    )


@pytest.fixture
def writer(catalog_db: ConsumerDB) -> ConsumerDB:
    """A writable catalog database in tmp_path."""
    return catalog_db


@pytest.fixture
def reader(writer: ConsumerDB) -> Iterator[ConsumerDB]:
    """The same database opened read-only, as the inspect commands do."""
    db = consumers.open_db(writer.path, readonly=True)
    yield db
    db.close()


@pytest.fixture
def at(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Set the clock the store stamps receipts and rejections with."""
    real_now_iso = inbox_apply.now_iso

    def _at(when: float) -> None:
        monkeypatch.setattr(inbox_apply, "now_iso", lambda _when=None: real_now_iso(when))

    return _at


def test_inbox_stats_counts_by_result_per_window_and_oldest_age(
    writer: ConsumerDB, reader: ConsumerDB, at: Callable[[float], None]
) -> None:
    """Stats count receipts by result overall, in the last hour and day, and give the oldest receipt's age."""
    at(T0 - 3 * 86400)
    apply_event(writer, envelope(article="old", revision=1))
    at(T0 - 5 * 3600)
    apply_event(writer, envelope(revision=2))
    apply_event(writer, envelope(revision=1))  # stale
    at(T0 - 1800)
    apply_event(writer, envelope(article="new-1"))
    apply_event(writer, envelope(article="new-2"))
    with pytest.raises(Rejection):
        apply_event(writer, envelope(article="new-2", title="another"))  # revision-conflict

    stats = queries.inbox_stats(reader, now=T0)

    assert stats["byResult"] == {"stale": 1, "updated": 4}
    assert stats["lastHour"] == {"stale": 0, "updated": 2}
    assert stats["lastDay"] == {"stale": 1, "updated": 3}
    assert stats["receipts"] == 5
    assert stats["oldestReceivedAt"] == "2026-11-27T12:00:00.000Z"
    assert stats["oldestAgeSeconds"] == 3 * 86400.0
    assert stats["newestReceivedAt"] == "2026-11-30T11:30:00.000Z"
    assert stats["rejected"] == 1
    assert stats["rejectedByCode"] == {"revision-conflict": 1}
    assert stats["consumer"] == "catalog"


def test_inbox_stats_of_an_empty_inbox(reader: ConsumerDB) -> None:
    """An empty inbox gives zero counts and no oldest receipt."""
    stats = queries.inbox_stats(reader, now=T0)

    assert (
        stats["receipts"],
        stats["byResult"],
        stats["oldestReceivedAt"],
        stats["oldestAgeSeconds"],
        stats["rejected"],
    ) == (0, {}, None, None, 0)


def test_inbox_list_is_newest_first_and_filters(
    writer: ConsumerDB, reader: ConsumerDB, at: Callable[[float], None]
) -> None:
    """inbox_list orders by receipt time, newest first, and filters by result and limit."""
    ids = [str(uuid.uuid4()) for _ in range(3)]
    at(T0 - 60)
    apply_event(writer, envelope(event_id=ids[0], revision=2))
    at(T0 - 30)
    apply_event(writer, envelope(event_id=ids[1], revision=1))
    at(T0)
    apply_event(writer, envelope(event_id=ids[2], article="b"))

    assert [ids[2], ids[1], ids[0]] == [r["eventId"] for r in queries.inbox_list(reader)]
    assert [ids[1]] == [r["eventId"] for r in queries.inbox_list(reader, result="stale")]
    assert [ids[2]] == [r["eventId"] for r in queries.inbox_list(reader, limit=1)]
    assert len(queries.inbox_list(reader, limit=0)) == 3


def test_inbox_show_of_an_event_only_ever_rejected(writer: ConsumerDB, reader: ConsumerDB) -> None:
    """An eventId known only from `rejected` is shown with no receipt and its rejection."""
    apply_event(writer, envelope())
    conflict = envelope(title="another")
    with pytest.raises(Rejection):
        apply_event(writer, conflict, source="x.ndjson:2")

    shown = queries.inbox_show(reader, conflict.event_id)

    assert None is shown["receipt"]
    assert [(r["code"], r["source"]) for r in shown["rejected"]] == [("revision-conflict", "x.ndjson:2")]
    assert shown["deliveries"] == []


def test_inbox_show_includes_recorded_deliveries(writer: ConsumerDB, reader: ConsumerDB) -> None:
    """Rows of `deliveries` for the eventId are part of inbox_show."""
    env = envelope()
    with writer.transaction() as tx:
        tx.apply(env)
        tx.record_delivery("msg-1", env.event_id, redelivered=False, attempt=1, outcome="updated")

    shown = queries.inbox_show(reader, env.event_id)

    assert [(d["key"], d["deliveries"], d["lastOutcome"]) for d in shown["deliveries"]] == [("msg-1", 1, "updated")]


def test_unknown_keys_raise_not_found(reader: ConsumerDB) -> None:
    """An unknown eventId or articleId raises NotFound naming it."""
    with pytest.raises(NotFound, match="eventId nope not found"):
        queries.inbox_show(reader, "nope")
    with pytest.raises(NotFound, match="articleId nope not found"):
        views.show(reader, CATALOG, "nope")


def test_effect_tables_of_another_consumer_are_refused(tmp_path: Path) -> None:
    """The catalog's view on an audit database is a DatabaseError, not an SQL error."""
    consumers.open_db(tmp_path / "audit.db", "audit", create=True).close()
    with (consumers.open_db(tmp_path / "audit.db", readonly=True) as db,
          pytest.raises(DatabaseError, match="no catalog")):
        views.list_rows([(None, db)], CATALOG)


def test_query_returns_columns_and_rows(writer: ConsumerDB, reader: ConsumerDB) -> None:
    """query returns column names and rows; BLOBs come back as X'..' literals."""
    apply_event(writer, envelope(article="a"))
    result = queries.query(reader, "SELECT article_id, revision, x'00ff' AS blob, NULL AS n FROM catalog")
    assert result == {"columns": ["article_id", "revision", "blob", "n"], "rows": [["a", 1, "X'00FF'", None]]}


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("INSERT INTO meta VALUES ('k', 'v')", "may only read"),
        ("DELETE FROM inbox", "may only read"),
        ("UPDATE catalog SET title = 'x'", "may only read"),
        ("DROP TABLE catalog", "may only read"),
        ("CREATE TEMP TABLE t (x)", "may only read"),
        ("ATTACH 'other.db' AS other", "ATTACH"),
        ("VACUUM INTO 'copy.db'", "ATTACH"),
        ("PRAGMA user_version = 7", "PRAGMA user_version"),
        ("PRAGMA query_only = OFF", "PRAGMA query_only"),
        ("PRAGMA journal_mode = DELETE", "PRAGMA journal_mode"),
        ("PRAGMA wal_checkpoint", "PRAGMA wal_checkpoint"),
        ("BEGIN", "BEGIN"),
        ("SAVEPOINT s", "SAVEPOINT"),
        ("SELECT 1; DELETE FROM inbox", "exactly one SQL statement"),
        ("   ", "empty"),
        ("SELEC 1", "syntax error"),
    ],
)
def test_query_refuses_anything_but_one_read(
    writer: ConsumerDB, reader: ConsumerDB, sql: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """query refuses writes, ATTACH, transactions, setting pragmas and several statements."""
    monkeypatch.chdir(tmp_path)
    apply_event(writer, envelope())
    with pytest.raises(QueryError, match=message):
        queries.query(reader, sql)
    assert writer.conn.execute("SELECT count(*) FROM inbox").fetchall() == [(1,)]
    assert not (tmp_path / "copy.db").exists()
    assert queries.query(reader, "SELECT count(*) AS n FROM inbox") == {"columns": ["n"], "rows": [[1]]}


def test_query_allows_reading_pragmas(reader: ConsumerDB) -> None:
    """Pragmas that only read (with or without a table argument) are allowed."""
    assert queries.query(reader, "PRAGMA user_version")["rows"] == [[database.STORE_VERSION]]
    columns = [row[1] for row in queries.query(reader, "PRAGMA table_info(catalog)")["rows"]]
    assert columns == ["article_id", "revision", "title", "url", "published", "event_id", "occurred_at"]


ENDLESS = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT max(x) FROM n"


def test_an_endless_query_is_stopped_at_its_timeout(writer: ConsumerDB, reader: ConsumerDB) -> None:
    """A statement still running at its timeout stops with a QueryError naming the limit; no snapshot stays
    open, and the connection answers the next statement."""
    apply_event(writer, envelope())
    with pytest.raises(QueryError, match="still running after 200ms"):
        queries.query(reader, ENDLESS, timeout_s=0.2)

    assert not reader.conn.in_transaction
    assert {"columns": ["n"], "rows": [[1]]} == queries.query(reader, "SELECT count(*) AS n FROM inbox")


@pytest.mark.parametrize("function", ["fts3_tokenizer('simple')", "FTS3_TOKENIZER('porter')",
                                      "load_extension('/tmp/x.so')"])
def test_query_refuses_functions_that_hand_out_pointers_or_load_code(reader: ConsumerDB, function: str) -> None:
    """fts3_tokenizer() (a raw pointer) and load_extension() are refused by name, in any case."""
    name = function.split("(")[0].lower()
    with pytest.raises(QueryError, match=rf"query refused: the function {name}\(\) is not allowed"):
        queries.query(reader, f"SELECT {function}")


def test_a_huge_value_is_refused_before_it_is_made(reader: ConsumerDB) -> None:
    """randomblob(1e9) stops at once, naming the size limit, instead of allocating a gigabyte;
    the connection's own limit is restored afterwards."""
    import sqlite3

    before = reader.conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
    with pytest.raises(QueryError, match="makes a value over 32 MB"):
        queries.query(reader, "SELECT randomblob(1000000000)", timeout_s=5)
    assert before == reader.conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
    assert [[4]] == queries.query(reader, "SELECT length(randomblob(4))")["rows"]


def test_a_result_past_its_size_limit_is_stopped_while_fetched(reader: ConsumerDB) -> None:
    """Endless rows of 1 kB each: the fetch stops once the result passes the limit (memory stays bounded),
    long before the timeout."""
    endless_rows = ("WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) "
                    "SELECT x, printf('%.1000c', 'y') FROM n")
    with pytest.raises(QueryError, match=r"result passed 1 MB after \d+ rows"):
        queries.query(reader, endless_rows, timeout_s=600, max_bytes=1 << 20)
    assert not reader.conn.in_transaction


def test_query_needs_a_readonly_database(writer: ConsumerDB) -> None:
    """query refuses a database that was not opened read-only."""
    with pytest.raises(QueryError, match="read-only"):
        queries.query(writer, "SELECT 1")


QUERY_CALLS: list[tuple[str, Callable[[ConsumerDB], object]]] = [
    ("inbox_list", lambda db: queries.inbox_list(db)),
    ("inbox_show", lambda db: queries.inbox_show(db, EVENT_ID)),
    ("inbox_stats", lambda db: queries.inbox_stats(db)),
    ("rejected_list", lambda db: queries.rejected_list(db)),
    ("view_list", lambda db: views.list_rows([(None, db)], CATALOG)),
    ("view_show", lambda db: views.show(db, CATALOG, "article-42")),
    ("query", lambda db: queries.query(db, "SELECT * FROM inbox")),
]
EVENT_ID = "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11"


@pytest.mark.parametrize("call", [c for _, c in QUERY_CALLS], ids=[n for n, _ in QUERY_CALLS])
def test_no_read_snapshot_is_left_open(
    writer: ConsumerDB, reader: ConsumerDB, call: Callable[[ConsumerDB], object]
) -> None:
    """After a query the reader holds no snapshot: a writer commits and fully checkpoints the WAL."""
    for revision in range(1, 4):
        apply_event(writer, envelope(event_id=EVENT_ID if revision == 1 else None, revision=revision))
    call(reader)
    assert not reader.conn.in_transaction
    apply_event(writer, envelope(article="after"))
    # TRUNCATE waits for every reader to leave the WAL; busy=1 would mean a snapshot is still open.
    writer.conn.execute("PRAGMA busy_timeout = 100")
    assert writer.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone() == (0, 0, 0)
    assert len(queries.inbox_list(reader)) == 4


def test_damaged_pages_found_while_reading_are_a_database_error(tmp_path: Path) -> None:
    """A table whose pages are damaged, in a file that opens fine, gives DatabaseError, not sqlite3.Error."""
    path = tmp_path / "catalog.db"
    with consumers.open_db(path, "catalog", create=True) as db:
        apply_event(db, envelope())
        page_size = db.conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = db.conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'catalog'").fetchone()
    data = bytearray(path.read_bytes())
    start = (root - 1) * page_size
    data[start : start + page_size] = b"\xff" * page_size
    path.write_bytes(bytes(data))

    with consumers.open_db(path, readonly=True) as db, pytest.raises(DatabaseError, match="malformed"):
        views.list_rows([(None, db)], CATALOG)
