"""The store: apply_event results, rejections, batches, pragmas, opening."""

from __future__ import annotations

import os
import re
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import (
    EVENT_ID,
    TITLE,
    URL,
    WITHDRAWN,
    OpenDB,
    effect_and_inbox,
    env,
    make_envelope,
    new_event,
    read_rows,
    rows,
)

from delivery_consumer import consumers
from delivery_consumer.inbox import ConsumerDB, apply_batch, apply_event, database
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.envelope import Envelope, from_mapping
from delivery_consumer.model.errors import (
    EVENT_ID_REUSED,
    MALFORMED_JSON,
    REVISION_CONFLICT,
    DatabaseError,
    Rejection,
    TransientError,
)
from delivery_consumer.store import sqlite

SECOND_ID = "5d2f8a61-9c3e-4b7a-8e15-2a6c0f4d9b83"
THIRD_ID = "9a7c3e15-2b4d-4f6a-b8e9-1c0d5f7a3e26"

CATALOG_STATE = "article_id, revision, title, url, published"


def rejected_rows(db: ConsumerDB) -> list[tuple[Any, ...]]:
    """(code, reason, event_id, fingerprint) of every rejection, read as another process would."""
    return read_rows(db.path, "rejected", "code, reason, event_id, fingerprint")


def status_of(db: ConsumerDB, envelope: Envelope) -> str:
    """apply_event's result, or the rejection code it raised."""
    try:
        return apply_event(db, envelope)
    except Rejection as rej:
        return rej.code


def assert_recorded_alone(db: ConsumerDB, before: dict[str, list[tuple[Any, ...]]], code: str, refused: Envelope,
                          quoted: str) -> None:
    """Since *before* only ``rejected`` changed: one row, *refused*'s with *code*, whose reason
    does not quote *quoted* (a value of its body)."""
    assert before == effect_and_inbox(db)
    [(got, reason, event_id, fingerprint)] = rejected_rows(db)
    assert (code, refused.event_id, refused.fingerprint) == (got, event_id, fingerprint)
    assert reason and quoted not in reason


# -- results of apply_event ------------------------------------------------------------


def test_first_event_is_updated_with_effect_and_receipt(catalog_db: ConsumerDB) -> None:
    """A first event writes the catalog row and the receipt together and returns updated."""
    event = env()

    assert "updated" == apply_event(catalog_db, event)

    assert [("article-42", 1, TITLE, URL, 1, EVENT_ID, "2026-11-29T10:00:00Z")] == rows(catalog_db, "catalog")
    assert [(EVENT_ID, event.fingerprint, "updated", "material.published")] == rows(
        catalog_db, "inbox", "event_id, fingerprint, result, event_type"
    )
    assert [(EVENT_ID, "updated")] == read_rows(catalog_db.path, "inbox", "event_id, result")
    assert not catalog_db.conn.in_transaction


def test_redelivery_returns_duplicate_and_changes_nothing(catalog_db: ConsumerDB) -> None:
    """The same eventId and body (in any key order) returns duplicate:updated and writes nothing."""
    apply_event(catalog_db, env())
    before = effect_and_inbox(catalog_db)
    reordered = from_mapping({k: v for k, v in reversed(make_envelope().items())})

    assert "duplicate:updated" == apply_event(catalog_db, env())
    assert "duplicate:updated" == apply_event(catalog_db, reordered)
    assert before == effect_and_inbox(catalog_db)
    assert [] == rejected_rows(catalog_db)


def test_withdrawn_higher_revision_unpublishes_and_keeps_title_and_url(catalog_db: ConsumerDB) -> None:
    """material.withdrawn at a higher revision writes published = 0 and keeps that revision's title and url."""
    apply_event(catalog_db, env())

    assert "updated" == apply_event(catalog_db, env(event_id=SECOND_ID, type=WITHDRAWN, revision=2))
    assert [("article-42", 2, TITLE, URL, 0)] == rows(catalog_db, "catalog", CATALOG_STATE)


def test_lower_revision_is_stale_and_still_gets_a_receipt(catalog_db: ConsumerDB) -> None:
    """An older revision changes nothing in the catalog, but its receipt says stale."""
    apply_event(catalog_db, env(event_id=SECOND_ID, type=WITHDRAWN, revision=2))
    catalog_before = rows(catalog_db, "catalog")

    assert "stale" == apply_event(catalog_db, env(event_id=THIRD_ID, revision=1))
    assert "duplicate:stale" == apply_event(catalog_db, env(event_id=THIRD_ID, revision=1))
    assert catalog_before == rows(catalog_db, "catalog")
    assert (THIRD_ID, "stale") in rows(catalog_db, "inbox", "event_id, result")


def test_equal_revision_with_same_state_is_same_state(catalog_db: ConsumerDB) -> None:
    """Another event for the stored revision with the same title, url and published flag is same-state."""
    apply_event(catalog_db, env())
    catalog_before = rows(catalog_db, "catalog")
    # Another eventId, occurredAt and an extra data field: none is domain state.
    twin = from_mapping({**make_envelope(event_id=SECOND_ID, occurred_at="2026-11-29T10:00:05Z"),
                         "data": {"title": TITLE, "url": URL, "lang": "ru"}})

    assert "same-state" == apply_event(catalog_db, twin)
    assert "duplicate:same-state" == apply_event(catalog_db, twin)
    assert catalog_before == rows(catalog_db, "catalog")


def test_audit_records_each_envelope_once(audit_db: ConsumerDB) -> None:
    """audit stores the canonical envelope once: recorded, then duplicate:recorded and no second row."""
    event = env()

    assert "recorded" == apply_event(audit_db, event)
    assert "duplicate:recorded" == apply_event(audit_db, event)
    assert [(EVENT_ID, event.fingerprint, event.canonical.decode())] == rows(
        audit_db, "audit", "event_id, fingerprint, envelope"
    )


# -- rejections in the store -------------------------------------------------------------


@pytest.mark.parametrize("consumer", ["catalog", "audit"])
def test_event_id_reused_changes_nothing_and_is_recorded(open_db: OpenDB, consumer: str) -> None:
    """The first eventId with another title is rejected; only the rejected table changes, committed."""
    db = open_db(consumer)
    apply_event(db, env())
    before = effect_and_inbox(db)
    reused = env(title="Доставка без потерь и без дублей")

    with pytest.raises(Rejection) as info:
        apply_event(db, reused)

    assert EVENT_ID_REUSED == info.value.code
    assert EVENT_ID == reused.event_id
    assert_recorded_alone(db, before, EVENT_ID_REUSED, reused, "дублей")


def test_revision_conflict_changes_nothing_and_is_recorded(catalog_db: ConsumerDB) -> None:
    """Two states for one revision: the second is rejected revision-conflict and recorded, nothing else changes."""
    apply_event(catalog_db, env())
    before = effect_and_inbox(catalog_db)
    conflicting = env(event_id=SECOND_ID, title="Черновик")

    assert REVISION_CONFLICT == status_of(catalog_db, conflicting)
    assert_recorded_alone(catalog_db, before, REVISION_CONFLICT, conflicting, "Черновик")


def test_withdrawn_at_the_published_revision_is_a_conflict(catalog_db: ConsumerDB) -> None:
    """published and withdrawn at the same revision are different states: revision-conflict."""
    apply_event(catalog_db, env())

    assert REVISION_CONFLICT == status_of(catalog_db, env(event_id=SECOND_ID, type=WITHDRAWN))


def test_a_rejected_event_can_be_followed_by_its_valid_redelivery(catalog_db: ConsumerDB) -> None:
    """A rejection leaves no receipt: it does not poison its eventId for a later valid event."""
    apply_event(catalog_db, env())
    assert REVISION_CONFLICT == status_of(catalog_db, env(event_id=SECOND_ID, title="Черновик"))

    assert "updated" == apply_event(catalog_db, env(event_id=SECOND_ID, title="Черновик", revision=2))


# -- batches -------------------------------------------------------------------------------


def lesson_batch() -> list[Envelope | Rejection]:
    """The lesson's sequence plus a conflict, a pre-store rejection and a few neighbours."""
    return [
        env(),
        env(),
        env(event_id=SECOND_ID, type=WITHDRAWN, revision=2),
        env(event_id=THIRD_ID, revision=1),
        env(title="Доставка без потерь и без дублей"),
        Rejection(MALFORMED_JSON, "body is not JSON"),
        env(event_id="f6c458b5-8ab4-4003-89df-0f1cccf60f0f", article_id="article-7", title="Очередь"),
        env(event_id="63f6ac0f-b620-4e45-892f-2f101f222687", article_id="article-7", title="Другая"),
        env(event_id="d6132dc6-f721-4813-8d08-f3d9e3737f20", article_id="article-7", title="Очередь",
            occurred_at="2026-11-29T11:00:00Z"),
        env(event_id=THIRD_ID, revision=1),
    ]


def test_batch_results_equal_one_event_per_transaction(open_db: OpenDB) -> None:
    """apply_batch gives the same results and the same tables as apply_event one by one."""
    items = lesson_batch()
    one_by_one = open_db("catalog", "single.db")
    batched = open_db("catalog", "batched.db")
    expected = [
        item.code if isinstance(item, Rejection) else status_of(one_by_one, item) for item in items
    ]

    outcomes = apply_batch(batched, items)

    assert [
        "updated", "duplicate:updated", "updated", "stale", EVENT_ID_REUSED, MALFORMED_JSON,
        "updated", REVISION_CONFLICT, "same-state", "duplicate:stale",
    ] == expected
    assert expected == [outcome.status for outcome in outcomes]
    assert rows(one_by_one, "catalog") == rows(batched, "catalog")
    inbox = "event_id, fingerprint, result, event_type"
    assert rows(one_by_one, "inbox", inbox) == rows(batched, "inbox", inbox)


def test_batch_records_every_rejection_with_its_source(catalog_db: ConsumerDB) -> None:
    """Rejections in a batch (from the store or from parsing) go to rejected with source and body digest."""
    items = lesson_batch()
    sources = [f"events.ndjson:{n}" for n in range(1, len(items) + 1)]
    digests = [None] * 5 + ["ab" * 32] + [None] * 4

    apply_batch(catalog_db, items, sources=sources, body_digests=digests)

    assert [
        (EVENT_ID_REUSED, EVENT_ID, "events.ndjson:5", None),
        (MALFORMED_JSON, None, "events.ndjson:6", "ab" * 32),
        (REVISION_CONFLICT, "63f6ac0f-b620-4e45-892f-2f101f222687", "events.ndjson:8", None),
    ] == read_rows(catalog_db.path, "rejected", "code, event_id, source, body_sha256")


def test_rejected_event_never_undoes_its_neighbours(catalog_db: ConsumerDB) -> None:
    """In one batch, the events before and after a rejected one are committed."""
    before, after = env(), env(event_id=SECOND_ID, article_id="article-7")

    outcomes = apply_batch(catalog_db, [before, env(title="другое"), after])

    assert ["updated", EVENT_ID_REUSED, "updated"] == [o.status for o in outcomes]
    assert [(EVENT_ID,), (SECOND_ID,)] == read_rows(catalog_db.path, "inbox", "event_id")
    assert [("article-42",), ("article-7",)] == read_rows(catalog_db.path, "catalog", "article_id")


def test_exception_inside_a_transaction_rolls_everything_back(catalog_db: ConsumerDB) -> None:
    """An exception before COMMIT (a crash between effect and commit) leaves neither effect nor receipt."""
    with pytest.raises(RuntimeError), catalog_db.transaction() as tx:
        assert "updated" == tx.apply(env()).status
        raise RuntimeError("power cut")

    assert {"inbox": [], "catalog": []} == effect_and_inbox(catalog_db)
    assert not catalog_db.conn.in_transaction
    assert "updated" == apply_event(catalog_db, env())


# -- an effect that fails ------------------------------------------------------------------

FLAKY_MIGRATIONS = ("CREATE TABLE effects (event_id TEXT PRIMARY KEY, title TEXT NOT NULL) STRICT;",)


def flaky_apply(conn: sqlite3.Connection, envelope: Envelope) -> str:
    """Write a row, then fail as the title says."""
    conn.execute("INSERT INTO effects VALUES (?, ?)", (envelope.event_id, envelope.data["title"]))
    if envelope.data["title"] == "transient":
        raise TransientError("search index timed out")
    if envelope.data["title"] == "bug":
        raise KeyError("a bug in the effect")
    if envelope.data["title"] == "refuse":
        raise Rejection("flaky-refused", "refused by the effect", event_id=envelope.event_id)
    if envelope.data["title"] == "constraint":  # a bug that breaks a constraint of the effect's own table
        conn.execute("INSERT INTO effects VALUES (?, ?)", (envelope.event_id, "again"))
    if envelope.data["title"] == "no-result":  # a bug: the receipt cannot be written without a result
        return None  # type: ignore[return-value]
    return "done"


@pytest.fixture
def flaky_db(open_db: OpenDB, register: Callable[[ConsumerSpec], ConsumerSpec]) -> ConsumerDB:
    """A database of a test consumer whose effect writes a row and then may fail."""
    register(ConsumerSpec(name="failing-effect", apply=flaky_apply, migrations=FLAKY_MIGRATIONS, tables=("effects",)))
    return open_db("failing-effect")


@pytest.mark.parametrize(
    ("title", "status"),
    [
        ("transient", "transient:transient"),
        ("bug", "transient:handler-error"),
        ("constraint", "transient:handler-error"),
        ("no-result", "transient:handler-error"),
        ("refuse", "flaky-refused"),
    ],
)
def test_failing_effect_rolls_back_only_its_event(flaky_db: ConsumerDB, title: str, status: str) -> None:
    """An effect raising TransientError, any exception (a broken constraint too) or a Rejection
    loses its own writes only; the events around it in the batch are committed."""
    ok_before, failing, ok_after = new_event(), new_event(title=title), new_event(article_id="article-7")

    outcomes = apply_batch(flaky_db, [from_mapping(e) for e in (ok_before, failing, ok_after)])

    assert ["done", status, "done"] == [o.status for o in outcomes]
    kept = sorted([(ok_before["eventId"],), (ok_after["eventId"],)])
    assert kept == read_rows(flaky_db.path, "effects", "event_id")
    assert kept == read_rows(flaky_db.path, "inbox", "event_id")


def test_transient_failure_leaves_the_event_retryable(flaky_db: ConsumerDB) -> None:
    """apply_event raises TransientError, records no receipt and no rejection, so a retry can apply it."""
    event = from_mapping(new_event(title="bug"))

    with pytest.raises(TransientError) as info:
        apply_event(flaky_db, event)

    assert "handler-error" == info.value.code
    assert "KeyError" in info.value.reason
    assert ([], [], []) == (rows(flaky_db, "inbox"), rows(flaky_db, "effects"), rejected_rows(flaky_db))


# -- connections, pragmas, locking ----------------------------------------------------------


def test_writable_connection_pragmas(catalog_db: ConsumerDB) -> None:
    """WAL, synchronous=FULL (2) and a 5 s busy_timeout are set on a writable connection."""
    pragma = catalog_db.conn.execute

    assert ("wal", 2, 5000) == (
        pragma("PRAGMA journal_mode").fetchone()[0],
        pragma("PRAGMA synchronous").fetchone()[0],
        pragma("PRAGMA busy_timeout").fetchone()[0],
    )


def test_readonly_connection_pragmas(catalog_db: ConsumerDB) -> None:
    """A read-only connection also waits for writers (busy_timeout) and sees the WAL file."""
    with consumers.open_db(catalog_db.path, readonly=True) as ro:
        assert ("wal", 5000) == (
            ro.conn.execute("PRAGMA journal_mode").fetchone()[0],
            ro.conn.execute("PRAGMA busy_timeout").fetchone()[0],
        )


def test_busy_timeout_is_configurable(open_db: OpenDB) -> None:
    """busy_timeout_ms reaches the connection."""
    db = open_db("catalog", busy_timeout_ms=1234)

    assert 1234 == db.conn.execute("PRAGMA busy_timeout").fetchone()[0]


def test_second_writer_waits_instead_of_failing(catalog_db: ConsumerDB) -> None:
    """While another connection holds the write lock, apply_event waits for it (still running, nothing
    committed) and then succeeds."""
    opened, locked, began = threading.Event(), threading.Event(), threading.Event()
    result: list[str] = []
    with consumers.open_db(catalog_db.path, "catalog") as other:
        worker = threading.Thread(
            target=lambda: result.append(_apply_in_thread(catalog_db.path, opened, locked, began)))
        worker.start()
        assert opened.wait(10), "the second writer could not open the database"
        other.conn.execute("BEGIN IMMEDIATE")
        locked.set()
        assert began.wait(10), "the second writer never began its transaction"
        worker.join(0.2)  # a writer that did not wait would be done (failed) by now
        waiting, committed = worker.is_alive(), read_rows(catalog_db.path, "inbox")
        other.conn.execute("COMMIT")
        worker.join(10)

    assert (True, []) == (waiting, committed)
    assert ["updated"] == result


def _apply_in_thread(path: Path, opened: threading.Event, locked: threading.Event, began: threading.Event) -> str:
    # Each thread opens its own connection: connections are never shared.
    with consumers.open_db(path, "catalog") as db:
        opened.set()
        locked.wait(10)
        # The trace callback runs as a statement starts: from then on BEGIN
        # IMMEDIATE is asking for the lock the test holds.
        db.conn.set_trace_callback(lambda sql: began.set() if sql.startswith("BEGIN") else None)
        return apply_event(db, env())


def test_busy_past_the_timeout_is_transient(catalog_db: ConsumerDB) -> None:
    """A writer still blocked after busy_timeout gets TransientError database-busy, not a crash."""
    with consumers.open_db(catalog_db.path, "catalog", busy_timeout_ms=50) as impatient:
        catalog_db.conn.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(TransientError) as info:
                apply_event(impatient, env())
        finally:
            catalog_db.conn.execute("ROLLBACK")

    assert sqlite.DATABASE_BUSY == info.value.code
    assert [] == rows(catalog_db, "inbox")


def test_connection_is_not_shared_between_threads(catalog_db: ConsumerDB) -> None:
    """Using a connection from another thread is refused (sqlite3's check_same_thread), nothing is written."""
    errors: list[BaseException] = []

    def use() -> None:
        try:
            apply_event(catalog_db, env())
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()

    assert [DatabaseError] == [type(e) for e in errors]
    assert "thread" in str(errors[0])
    assert [] == rows(catalog_db, "inbox")


# -- opening: identity, versions, broken files ----------------------------------------------


@pytest.mark.parametrize("readonly", [False, True])
def test_database_of_another_consumer_is_refused(catalog_db: ConsumerDB, readonly: bool) -> None:
    """A catalog database cannot be opened as audit."""
    with pytest.raises(DatabaseError, match="belongs to consumer 'catalog', not 'audit'"):
        consumers.open_db(catalog_db.path, "audit", readonly=readonly)


def test_consumer_defaults_to_the_recorded_one(catalog_db: ConsumerDB) -> None:
    """Opening by path alone uses the consumer the database records."""
    with consumers.open_db(catalog_db.path) as db:
        assert "catalog" == db.consumer


def _journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.parametrize("readonly", [False, True])
def test_foreign_sqlite_file_is_refused_and_left_unchanged(tmp_path: Path, readonly: bool) -> None:
    """Another application's SQLite file is refused without being modified (it stays in its journal mode)."""
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.commit()
    conn.close()
    content = path.read_bytes()

    with pytest.raises(DatabaseError, match="not a delivery-consumer database"):
        consumers.open_db(path, "catalog", create=True, readonly=readonly)

    assert content == path.read_bytes()
    assert "delete" == _journal_mode(path)
    assert ["app.db"] == sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("readonly", [False, True])
def test_corrupt_file_is_refused(tmp_path: Path, readonly: bool) -> None:
    """Random bytes are refused with a message naming the file and the cause, and left unchanged."""
    path = tmp_path / "inbox.db"
    path.write_bytes(os.urandom(8192))
    content = path.read_bytes()

    with pytest.raises(DatabaseError, match=r"inbox\.db: .*file is not a database"):
        consumers.open_db(path, "catalog", readonly=readonly)

    assert content == path.read_bytes()


@pytest.mark.parametrize("readonly", [False, True])
def test_newer_schema_version_is_refused(catalog_db: ConsumerDB, readonly: bool) -> None:
    """A database written by a newer delivery-consumer (higher user_version) is refused."""
    catalog_db.conn.execute(f"PRAGMA user_version = {database.STORE_VERSION + 1}")
    catalog_db.close()

    with pytest.raises(DatabaseError, match="newer"):
        consumers.open_db(catalog_db.path, "catalog", readonly=readonly)


@pytest.mark.parametrize("readonly", [False, True])
def test_directory_is_refused(tmp_path: Path, readonly: bool) -> None:
    """A directory given as the database is refused with a clear message."""
    with pytest.raises(DatabaseError, match="is a directory"):
        consumers.open_db(tmp_path, "catalog", create=True, readonly=readonly)


def test_path_under_a_regular_file_is_refused(tmp_path: Path) -> None:
    """A database path whose parent is a regular file says so, with or without create."""
    parent = tmp_path / "state"
    parent.write_text("not a directory")

    with pytest.raises(DatabaseError, match=r"(?i)not a directory"):
        consumers.open_db(parent / "inbox.db", "catalog", create=True)
    with pytest.raises(DatabaseError, match=r"(?i)not a directory"):
        consumers.open_db(parent / "catalog" / "inbox.db", "catalog", create=True)
    with pytest.raises(DatabaseError, match="no such database"):
        consumers.open_db(parent / "inbox.db", "catalog")


@pytest.mark.parametrize("readonly", [False, True])
def test_missing_database_is_not_created_without_create(tmp_path: Path, readonly: bool) -> None:
    """Without create, a missing database is an error naming the init command, and no file appears."""
    with pytest.raises(DatabaseError, match=r"no such database.*delivery-consumer init"):
        consumers.open_db(tmp_path / "inbox.db", "catalog", readonly=readonly)

    assert [] == list(tmp_path.iterdir())


def test_a_database_of_the_first_schema_is_migrated_forward(tmp_path: Path) -> None:
    """A database made by the first store schema (with the received_at index) opens,
    loses that index, reaches the current version and keeps its receipts."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for statement in sqlite.statements(database.CORE_MIGRATIONS[0]):
        conn.execute(statement)
    conn.execute("INSERT INTO meta (key, value) VALUES ('consumer', 'catalog'), ('consumer_schema_version', '0')")
    conn.execute("INSERT INTO inbox VALUES ('e', 'f', 'updated', 'material.published', '2026-11-29T10:00:00.000Z')")
    conn.execute("PRAGMA user_version = 1")
    conn.close()

    db = consumers.open_db(path, "catalog", create=True)

    assert database.STORE_VERSION == db.conn.execute("PRAGMA user_version").fetchone()[0]
    assert [] == db.conn.execute("SELECT name FROM sqlite_schema WHERE name = 'inbox_received_at'").fetchall()
    assert 1 == len(rows(db, "inbox"))
    db.close()


def test_reopening_is_idempotent(catalog_db: ConsumerDB) -> None:
    """Opening an up-to-date database again changes neither its schema, its meta nor its data."""
    apply_event(catalog_db, env())
    conn = catalog_db.conn
    schema = rows(conn, "sqlite_schema", "type, name, sql")
    meta = catalog_db.meta()

    for _ in range(2):
        consumers.open_db(catalog_db.path, "catalog", create=True).close()

    assert schema == rows(conn, "sqlite_schema", "type, name, sql")
    assert meta == catalog_db.meta()
    assert database.STORE_VERSION == conn.execute("PRAGMA user_version").fetchone()[0]
    assert {"consumer": "catalog", "consumer_schema_version": "1"}.items() <= meta.items()
    assert 1 == len(rows(catalog_db, "inbox"))


NOTES_V1 = ("CREATE TABLE notes (event_id TEXT PRIMARY KEY) STRICT;",)
NOTES_V2 = (*NOTES_V1, "ALTER TABLE notes ADD COLUMN title TEXT NOT NULL DEFAULT '';")


def _notes_apply(conn: sqlite3.Connection, envelope: Envelope) -> str:
    conn.execute("INSERT INTO notes (event_id) VALUES (?)", (envelope.event_id,))
    return "noted"


def test_consumer_migrations_are_forward_only(
    open_db: OpenDB, register: Callable[[ConsumerSpec], ConsumerSpec]
) -> None:
    """A new migration is applied once on open and keeps the data; older code refuses to write the newer
    tables, and reads them (a view after the package was downgraded) with a note saying so."""
    v1 = ConsumerSpec(name="notes", apply=_notes_apply, migrations=NOTES_V1, tables=("notes",))
    v2 = ConsumerSpec(name="notes", apply=_notes_apply, migrations=NOTES_V2, tables=("notes",))
    register(v1)
    db = open_db("notes")
    apply_event(db, env())
    db.close()

    register(v2)
    with consumers.open_db(db.path, "notes") as upgraded:
        assert "2" == upgraded.meta()["consumer_schema_version"]
        assert [(EVENT_ID, "")] == rows(upgraded, "notes")
    with consumers.open_db(db.path, "notes") as again:
        assert [(EVENT_ID, "")] == rows(again, "notes")

    register(v1)  # the consumer's package downgraded: its tables are newer than its migrations
    with pytest.raises(DatabaseError, match="newer"):
        consumers.open_db(db.path, "notes")  # never written by the older consumer
    with consumers.open_db(db.path, "notes", readonly=True) as read:  # read as this release knows them, with a note
        assert read.note is not None
        assert "notes tables are at version 2, newer than the 1 migrations of the notes consumer installed here" in (
            read.note)
        assert [(EVENT_ID,)] == read.conn.execute("SELECT event_id FROM notes").fetchall()


def test_readonly_open_of_an_outdated_consumer_schema_asks_for_init(
    open_db: OpenDB, register: Callable[[ConsumerSpec], ConsumerSpec]
) -> None:
    """Read-only opening never migrates: older consumer tables are an error that says to run init."""
    register(ConsumerSpec(name="notes", apply=_notes_apply, migrations=NOTES_V1, tables=("notes",)))
    db = open_db("notes")
    db.close()
    register(ConsumerSpec(name="notes", apply=_notes_apply, migrations=NOTES_V2, tables=("notes",)))

    with pytest.raises(DatabaseError, match=r"older.*run init"):
        consumers.open_db(db.path, "notes", readonly=True)


@pytest.mark.parametrize("consumer", ["catalog", "audit"])
def test_every_table_is_strict(open_db: OpenDB, consumer: str) -> None:
    """Every table of a consumer database is STRICT."""
    db = open_db(consumer)
    tables = db.conn.execute(
        "SELECT name, strict FROM pragma_table_list WHERE schema = 'main' AND name NOT LIKE 'sqlite_%'"
    ).fetchall()

    store = {"meta", "inbox", "rejected", "deliveries", "in_flight", "inbox_minutes", "inbox_hours", "inbox_counted",
             "ce_sources"}
    assert {*store, *db.spec.tables} == {name for name, _ in tables}
    assert all(strict == 1 for _, strict in tables)


@pytest.mark.parametrize(
    ("consumer", "sql"),
    [
        ("catalog", "INSERT INTO catalog VALUES ('a', 'two', 't', 'u', 1, 'e', 'o')"),
        ("catalog", "INSERT INTO rejected (code, reason, attempts, rejected_at) VALUES ('c', 'r', 'many', 'now')"),
        ("audit", "INSERT INTO audit VALUES ('e', 't', 'a', x'01', 'o', 'f', '{}')"),
    ],
)
def test_strict_tables_refuse_wrong_types(open_db: OpenDB, consumer: str, sql: str) -> None:
    """Inserting a value of the wrong type into a STRICT table fails instead of being stored."""
    db = open_db(consumer)

    with pytest.raises(sqlite3.IntegrityError, match="cannot store"):
        db.conn.execute(sql)


def test_readonly_open_cannot_write(catalog_db: ConsumerDB) -> None:
    """A read-only database refuses transactions, apply_event and raw writes."""
    apply_event(catalog_db, env())

    with consumers.open_db(catalog_db.path, "catalog", readonly=True) as ro:
        assert [(EVENT_ID,)] == rows(ro, "inbox", "event_id")
        with pytest.raises(DatabaseError, match="read-only"):
            apply_event(ro, env(event_id=SECOND_ID, revision=2))
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            ro.conn.execute("DELETE FROM inbox")

    assert [(EVENT_ID,)] == rows(catalog_db, "inbox", "event_id")


def test_sqlite_reading_neither_creates_nor_keeps_open(tmp_path: Path) -> None:
    """sqlite.reading refuses a missing file without creating it, names the file when a query
    fails, and closes the connection after the block."""
    missing = tmp_path / "missing.db"
    with pytest.raises(DatabaseError, match="cannot open database"), sqlite.reading(missing):
        pass
    assert not missing.exists()

    path = tmp_path / "plain.db"
    sqlite3.connect(path).close()
    with pytest.raises(DatabaseError, match=re.escape(f"{path}: cannot read meta: no such table")), \
            sqlite.reading(path, what="read meta") as conn:
        conn.execute("SELECT * FROM meta")
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        conn.execute("SELECT 1")
