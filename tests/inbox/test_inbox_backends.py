"""One inbox, two storage backends: the applier's scenarios run on SQLite and on PostgreSQL alike
(the ``backend`` fixture), through the one path (``apply_batch``) and the same consumers' effects."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import closed_at_exit, env, new_event
from test_event_failures import MIGRATIONS as CAPTURES
from test_event_failures import TYPES as PAYMENT_TYPES
from test_event_failures import _capture, payment

from delivery_consumer.consumers import audit, catalog
from delivery_consumer.inbox import ConsumerDB, InFlight, apply_batch, apply_event
from delivery_consumer.inbox.apply import Store
from delivery_consumer.inbox.pg import PgInboxDB, portable_ddl, rewrite
from delivery_consumer.model.cloudevents import parse_body
from delivery_consumer.model.contract import Connection, ConsumerSpec, DeliveryMark, dialect
from delivery_consumer.model.envelope import Envelope, from_mapping
from delivery_consumer.model.errors import (
    EVENT_ID_REUSED,
    REVISION_CONFLICT,
    UNSTORABLE_VALUE,
    ConfigError,
    Rejection,
    WrongDatabase,
)
from delivery_consumer.model.state import RevisionTable

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Backend:
    """Opens a consumer's inbox on one backend (a file of the test's, or the test's own PostgreSQL database)."""

    kind: str
    open: Callable[[ConsumerSpec], Store]

    def rows(self, db: Store, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return sorted(tuple(row) for row in db.conn.execute(sql, params).fetchall())


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    with closed_at_exit() as keep:
        if request.param == "sqlite":
            yield Backend("sqlite", lambda spec: keep(ConsumerDB.open(tmp_path / f"{spec.name}.db", spec,
                                                                      create=True)))
        else:
            url = request.getfixturevalue("pg_url")
            yield Backend("postgres", lambda spec: keep(PgInboxDB.open(url, spec, create=True)))


def statuses(outcomes: Sequence[Any]) -> list[str]:
    return [outcome.status for outcome in outcomes]


def test_a_duplicate_answers_the_stored_result(backend: Backend) -> None:
    """A redelivered event is answered ``duplicate:<result>`` and changes nothing."""
    db = backend.open(catalog.SPEC)
    first = env()
    assert "updated" == apply_event(db, first)
    before = backend.rows(db, "SELECT article_id, revision, title FROM catalog")
    assert "duplicate:updated" == apply_event(db, first)
    assert before == backend.rows(db, "SELECT article_id, revision, title FROM catalog")
    assert [(first.event_id, "updated")] == backend.rows(db, "SELECT event_id, result FROM inbox")


def test_stale_same_state_and_conflict_are_told_apart(backend: Backend) -> None:
    """A lower revision is stale, the same state at the same revision same-state, another state a
    revision-conflict recorded in ``rejected`` with the event's key."""
    db = backend.open(catalog.SPEC)
    assert "updated" == apply_event(db, from_mapping(new_event(revision=3)))
    assert "stale" == apply_event(db, from_mapping(new_event(revision=2)))
    assert "same-state" == apply_event(db, from_mapping(new_event(revision=3)))
    other = from_mapping(new_event(revision=3, title="Another title"))
    with pytest.raises(Rejection) as raised:
        apply_event(db, other)
    assert REVISION_CONFLICT == raised.value.code
    assert [(REVISION_CONFLICT, other.event_id, "article-42")] == backend.rows(
        db, "SELECT code, event_id, partition_key FROM rejected")
    assert [(3,)] == backend.rows(db, "SELECT revision FROM catalog")


def test_an_event_id_reused_with_another_body_is_rejected(backend: Backend) -> None:
    """A second body under a known eventId is rejected event-id-reused; the first stays."""
    db = backend.open(audit.SPEC)
    assert "recorded" == apply_event(db, env(revision=1))
    with pytest.raises(Rejection) as raised:
        apply_event(db, env(revision=2))
    assert EVENT_ID_REUSED == raised.value.code
    assert [(1,)] == backend.rows(db, "SELECT revision FROM audit")


def test_a_batch_with_a_bad_event_applies_the_others(backend: Backend) -> None:
    """One conflicting event in a batch is rejected alone: the events before and after it are applied,
    in one commit, and the outcomes are those of the events applied one by one."""
    db = backend.open(catalog.SPEC)
    apply_event(db, from_mapping(new_event(article_id="a", revision=2)))
    batch = [from_mapping(new_event(article_id="b")), from_mapping(new_event(article_id="a", revision=2,
                                                                              title="clash")),
             from_mapping(new_event(article_id="c")), Rejection("malformed-json", "not JSON")]
    assert ["updated", REVISION_CONFLICT, "updated", "malformed-json"] == statuses(apply_batch(db, batch))
    assert [("a", 2), ("b", 1), ("c", 1)] == backend.rows(db, "SELECT article_id, revision FROM catalog")
    assert [("malformed-json",), (REVISION_CONFLICT,)] == backend.rows(db, "SELECT code FROM rejected")


@pytest.mark.parametrize("amount", ["9223372036854775808", "1e20"])
def test_a_value_never_storable_is_rejected_at_once(backend: Backend, amount: str) -> None:
    """An integer past 64 bits, or a float where an integer column is, is unstorable-value on both (the same
    bytes fail every time: never retried); the events beside it are applied."""
    db = backend.open(ConsumerSpec("payments", _capture, CAPTURES, event_types=PAYMENT_TYPES))
    outcomes = apply_batch(db, [payment("pay-1", 1), payment("pay-9", amount), payment("pay-2", 2)])
    assert ["captured", UNSTORABLE_VALUE, "captured"] == statuses(outcomes)
    assert [("pay-1",), ("pay-2",)] == backend.rows(db, "SELECT payment_id FROM captures")


def test_an_effect_bug_is_a_transient_and_writes_nothing(backend: Backend) -> None:
    """An effect that raises (a bug) is retried (handler-error), its writes and its receipt rolled back."""

    def apply(conn: Connection, env: Envelope) -> str:
        conn.execute("INSERT INTO notes (event_id) VALUES (?)", (env.event_id,))
        raise ZeroDivisionError("a bug")

    spec = ConsumerSpec("buggy", apply, ("CREATE TABLE notes (event_id TEXT PRIMARY KEY) STRICT;",))
    db = backend.open(spec)
    (outcome,) = apply_batch(db, [env()])
    assert outcome.transient is not None and "handler-error" == outcome.transient.code
    assert [] == backend.rows(db, "SELECT * FROM notes") == backend.rows(db, "SELECT event_id FROM inbox")


def test_deliveries_and_in_flight_notes_are_counted(backend: Backend) -> None:
    """run's bookkeeping in the batch's transaction: a delivery counted with its outcome, a note of
    work under way that the batch's commit clears, a dead owner's note settled as a crash."""
    db = backend.open(catalog.SPEC)
    first = env()
    notes = InFlight(db, owner="x:1:-")
    notes.mark(["k1"])
    assert [("x:1:-",)] == backend.rows(db, "SELECT owner FROM in_flight")

    def count(tx: Any, outcomes: list[Any]) -> None:
        DeliveryMark("k1", redelivered=True, attempt=1, delivered_hint=2).record(tx, first.event_id, "updated")
        notes.clear(tx)

    apply_batch(db, [first], before_commit=count)
    assert [("k1", 2, 1, "updated")] == backend.rows(
        db, "SELECT key, deliveries, redeliveries, last_outcome FROM deliveries")
    assert [] == backend.rows(db, "SELECT owner FROM in_flight")
    notes.mark(["k1"])
    assert 1 == InFlight(db).reap()  # owner x:1 is no process of this boot
    assert {"k1": 1} == InFlight(db).open_keys(["k1", "k2"])


def payments(open_db: Callable[[ConsumerSpec], Store], root: Path, name: str) -> tuple[list[str], list[Any]]:
    """The manual's payments consumer (docs/adding-a-consumer.md, as printed) fed its sample events twice,
    in batches of 3, then all at once: the results of both passes and the payments table."""
    text = (REPO / "docs" / "adding-a-consumer.md").read_text("utf-8")
    files = dict(re.findall(r"`([\w.]+)`:?\n\n```\w+\n(.*?)```", text, re.S))
    (root / f"{name}.py").write_text(files["delivery_payments.py"], "utf-8")
    found = importlib.util.spec_from_file_location(name, root / f"{name}.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    spec: ConsumerSpec = module.SPEC
    db = open_db(spec)
    parsed = [parse_body(line.encode(), types=spec.event_types)
              for line in files["payments.ndjson"].splitlines() if line.strip()]
    results = [status for i in range(0, len(parsed), 3) for status in statuses(apply_batch(db, parsed[i:i + 3]))]
    results += statuses(apply_batch(db, parsed))  # a redelivery of them all
    rows = sorted(tuple(r) for r in db.conn.execute(
        "SELECT payment_id, revision, status, captured_cents, refunded_cents FROM payments").fetchall())
    return results, rows


def test_the_docs_example_consumer_keeps_the_same_table(backend: Backend, tmp_path: Path) -> None:
    """The manual's payments consumer, unchanged, answers the same results and keeps the same rows on
    this backend as on SQLite."""
    with closed_at_exit() as keep:
        expected = payments(lambda spec: keep(ConsumerDB.open(tmp_path / "ref.db", spec, create=True)), tmp_path,
                            "payments_ref")
    results, rows = payments(backend.open, tmp_path, f"payments_{backend.kind}")
    assert expected == (results, rows)
    assert ("pay-1", 3, "refunded", 2500, 500) == rows[0]
    assert "capture-exceeds-authorization" in results


def test_revision_table_checks_its_table_on_both(backend: Backend) -> None:
    """RevisionTable.check refuses, at open, a table whose key is not unique (PostgreSQL's catalog read too)."""
    table = RevisionTable("things", key="thing_id", state=("name",))
    spec = ConsumerSpec("things", lambda conn, env: "x", (
        "CREATE TABLE things (thing_id TEXT NOT NULL, revision INTEGER NOT NULL, name TEXT NOT NULL,"
        " event_id TEXT, occurred_at TEXT) STRICT;",), checks=(table.check,))
    with pytest.raises(ConfigError, match="must be its PRIMARY KEY or UNIQUE"):
        backend.open(spec)


def test_another_consumers_inbox_is_refused(backend: Backend, request: pytest.FixtureRequest) -> None:
    """An inbox records its consumer: opened for another, it is refused (WrongDatabase)."""
    db = backend.open(catalog.SPEC)
    if backend.kind == "sqlite":
        with pytest.raises(WrongDatabase):
            ConsumerDB.open(Path(str(db.path)), audit.SPEC, create=True)
    else:
        with pytest.raises(WrongDatabase):
            PgInboxDB.open(request.getfixturevalue("pg_url"), audit.SPEC, create=True, schema="dc_catalog")


def test_the_effect_is_handed_its_dialect(backend: Backend) -> None:
    """An effect reads the dialect of its connection: one written for both can word its few differences."""
    seen: list[str] = []

    def apply(conn: Connection, env: Envelope) -> str:
        seen.append(dialect(conn))
        return "seen"

    db = backend.open(ConsumerSpec("dialects", apply, ()))
    apply_event(db, env())
    assert [backend.kind] == seen


# -- PostgreSQL's own ------------------------------------------------------------------


def test_sqlite_parameters_become_psycopgs_once() -> None:
    """``?`` becomes ``%s``, ``?N`` picks its parameter, a ``%`` is doubled."""
    assert ("SELECT %s, %s WHERE a LIKE 'x%%'", None) == rewrite("SELECT ?, ? WHERE a LIKE 'x%'")
    assert ("VALUES (%s, %s, %s)", (1, 0, 1)) == rewrite("VALUES (?2, ?1, ?2)")


def test_sqlite_table_options_and_types_are_translated() -> None:
    """A consumer's SQLite DDL runs on PostgreSQL: STRICT and WITHOUT ROWID dropped, 64-bit integers."""
    ddl = portable_ddl("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER NOT NULL, r REAL, b BLOB) STRICT,"
                       " WITHOUT ROWID;")
    assert ("CREATE TABLE t (id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, n BIGINT NOT NULL,"
            " r DOUBLE PRECISION, b BYTEA);") == ddl


def counting_spec() -> ConsumerSpec:
    """An effect that counts how often each event was applied: any double effect shows as a 2."""

    def apply(conn: Connection, env: Envelope) -> str:
        conn.execute("INSERT INTO applied AS a (event_id, n) VALUES (?, 1)"
                     " ON CONFLICT (event_id) DO UPDATE SET n = a.n + 1", (env.event_id,))
        return "counted"

    return ConsumerSpec("counting", apply, ("CREATE TABLE applied (event_id TEXT PRIMARY KEY, n INTEGER NOT NULL);",))


@pytest.mark.postgres
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=8), min_size=2, max_size=6))
def test_two_appliers_never_apply_one_event_twice(pg_url: str, batches: list[list[int]]) -> None:
    """Two processes' transactions applying overlapping batches of the same eventIds at once: each event's
    effect is applied exactly once, and every outcome is its result or ``duplicate:<result>`` (a waiting
    batch reads the first's receipt; no attempt is spent, nothing is a conflict)."""
    spec = counting_spec()
    events = [from_mapping(new_event()) for _ in range(12)]
    ids = [event.event_id for event in events]
    halves = [batches[0::2], batches[1::2]]
    barrier = threading.Barrier(2)
    seen: list[list[str]] = [[], []]
    errors: list[BaseException] = []

    def applier(n: int) -> None:
        try:
            with PgInboxDB.open(pg_url, spec, create=True) as db:
                barrier.wait()
                for batch in halves[n]:
                    seen[n] += statuses(apply_batch(db, [events[i] for i in batch]))
        except BaseException as exc:  # the test thread reports it
            errors.append(exc)

    threads = [threading.Thread(target=applier, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [] == errors
    assert {"counted", "duplicate:counted"} >= set(seen[0] + seen[1])
    with PgInboxDB.open(pg_url, spec) as db:
        applied = dict(db.conn.execute("SELECT event_id, n FROM applied").fetchall())
    wanted = {ids[i] for batch in batches for i in batch}
    assert {i: 1 for i in wanted} == {i: n for i, n in applied.items() if i in wanted}
    assert seen[0].count("counted") + seen[1].count("counted") == len(wanted)


@pytest.mark.postgres
def test_consumers_share_a_database_one_schema_each(pg_url: str) -> None:
    """Two consumers in one PostgreSQL database: each its own schema, tables and receipts."""
    with closed_at_exit() as keep:
        cat = keep(PgInboxDB.open(pg_url, catalog.SPEC, create=True))
        aud = keep(PgInboxDB.open(pg_url, audit.SPEC, create=True))
        event = env()
        assert ("updated", "recorded") == (apply_event(cat, event), apply_event(aud, event))
        assert (cat.schema, aud.schema) == ("dc_catalog", "dc_audit")
        assert [(1,)] == cat.conn.execute("SELECT count(*) FROM inbox").fetchall()
        assert [(1,)] == aud.conn.execute("SELECT count(*) FROM dc_audit.inbox").fetchall()


@pytest.mark.postgres
def test_the_password_is_never_in_the_label(pg_url: str) -> None:
    """What messages and logs name of a PostgreSQL inbox has no password."""
    secret = pg_url.replace("postgres@", "postgres:s3cret@", 1)
    with PgInboxDB.open(secret, catalog.SPEC, create=True) as db:
        assert "s3cret" not in str(db.path)


@pytest.mark.postgres
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.booleans(), st.integers(0, 1)), min_size=1,
                max_size=25),
       st.integers(1, 6), st.randoms(use_true_random=False))
def test_postgresql_answers_as_sqlite_does(pg_url: str, tmp_path_factory: pytest.TempPathFactory,
                                          facts: list[tuple[int, int, bool, int]], batch: int, rng: Any) -> None:
    """Any stream of catalog events (keys, revisions, withdrawals, two titles per revision: conflicts), with
    redeliveries, in any batches: PostgreSQL gives every event the outcome SQLite gives it, and keeps the
    same catalog, receipts and rejections."""
    events = [from_mapping(new_event(article_id=f"k{key}", revision=revision, title=f"t{title}",
                                     type="material.withdrawn" if withdrawn else "material.published"))
              for key, revision, withdrawn, title in facts]
    stream = events + rng.sample(events, len(events) // 2)
    rng.shuffle(stream)
    batches = [stream[i:i + batch] for i in range(0, len(stream), batch)]
    schema = f"h{secrets.token_hex(6)}"  # a fresh inbox for each example
    seen = {}
    with closed_at_exit() as keep:
        for kind, db in (("sqlite", keep(ConsumerDB.open(tmp_path_factory.mktemp("h") / "c.db", catalog.SPEC,
                                                         create=True))),
                         ("postgres", keep(PgInboxDB.open(pg_url, catalog.SPEC, create=True, schema=schema)))):
            outcomes = [status for chunk in batches for status in statuses(apply_batch(db, chunk))]
            tables = [sorted(tuple(r) for r in db.conn.execute(sql).fetchall()) for sql in (
                "SELECT article_id, revision, title, published, event_id FROM catalog",
                "SELECT event_id, result FROM inbox", "SELECT code, event_id FROM rejected")]
            seen[kind] = (outcomes, tables)
    assert seen["sqlite"] == seen["postgres"]


@pytest.mark.postgres
def test_a_consumer_may_give_postgresql_its_own_effect_and_migrations(pg_url: str) -> None:
    """``postgres_migrations`` and ``postgres_apply`` replace the SQLite ones on PostgreSQL (and
    ``apply_many`` is not used there); SQLite keeps its own."""

    def sqlite_only(conn: Connection, env: Envelope) -> str:
        raise AssertionError("the SQLite effect ran on PostgreSQL")

    def on_postgres(conn: Connection, env: Envelope) -> str:
        conn.execute("INSERT INTO seen (event_id, at) VALUES (?, now())", (env.event_id,))
        return "seen"

    spec = ConsumerSpec("own", sqlite_only, ("CREATE TABLE seen (event_id TEXT PRIMARY KEY) STRICT;",),
                        apply_many=lambda conn, envs: [sqlite_only(conn, env) for env in envs],
                        postgres_migrations=("CREATE TABLE seen (event_id text PRIMARY KEY, at timestamptz NOT NULL)",),
                        postgres_apply=on_postgres)
    with PgInboxDB.open(pg_url, spec, create=True) as db:
        assert ["seen", "seen"] == statuses(apply_batch(db, [env(), from_mapping(new_event())]))
        assert [(2,)] == db.conn.execute("SELECT count(at) FROM seen").fetchall()


def test_a_batchs_receipts_keep_its_order_and_every_column(backend: Backend) -> None:
    """The optimistic batch's receipts (one statement on PostgreSQL) hold, in the batch's order, each event's
    eventId, fingerprint, result, type, key and meta (NULL without one), all received at one time."""
    db = backend.open(catalog.SPEC)
    batch = [env(event_id=None, article_id=f"article-{i}",
                 **({"meta": {"correlationId": f"é \"q\" \\ {i}", "causationId": "c"}} if i % 2 else {}))
             for i in range(7)]
    assert ["updated"] * 7 == statuses(apply_batch(db, batch))
    order = "rowid" if backend.kind == "sqlite" else "seq"
    rows = db.conn.execute("SELECT event_id, fingerprint, result, event_type, partition_key, meta, origin,"
                           f" received_at FROM inbox ORDER BY {order}").fetchall()
    assert [(e.event_id, e.fingerprint, "updated", e.type, e.key,
             None if "meta" not in e.fields else f'{{"causationId":"c","correlationId":"é \\"q\\" \\\\ {i}"}}', None)
            for i, e in enumerate(batch)] == [tuple(row[:7]) for row in rows]
    assert len({row[7] for row in rows}) == 1
