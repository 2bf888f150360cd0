"""The outbox and its dispatcher on real SQLite files, with a scripted publisher.

The broker side is a fake with the interface of ``amqp.publisher.Publisher``
(connect / publish / idle) whose verdict per message is scripted, and the
clock and sleep are the test's: every lease, backoff and outage decision is
checked exactly, without a broker and without waiting.
"""

from __future__ import annotations

import sqlite3
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from outboxkit import Clock, FakePublisher, add, dispatcher, envelope, row, twin
from support import closed_at_exit

from delivery_consumer import consumers, outbox
from delivery_consumer.amqp.retry import RECONNECT_CAP_S
from delivery_consumer.cli import main
from delivery_consumer.model.deliveries import PublishResult
from delivery_consumer.model.envelope import parse
from delivery_consumer.model.errors import BrokerFatal, ConfigError, DatabaseError, NotFound, Rejection, TransientError
from delivery_consumer.outbox import demo_producer as producer
from delivery_consumer.store import sqlite
from delivery_consumer.store.sqlite import now_iso


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "producer.db"


@pytest.fixture
def conns(db_path: Path) -> Iterator[Callable[[], sqlite3.Connection]]:
    """Open connections to the producer database (each like a separate process)."""
    with closed_at_exit() as keep:
        yield lambda: keep(outbox.connect(db_path))


@pytest.fixture
def conn(conns: Callable[[], sqlite3.Connection]) -> sqlite3.Connection:
    return conns()


# -- install and enqueue -----------------------------------------------------------------


def test_install_is_idempotent_strict_and_leaves_user_version_alone(conn: sqlite3.Connection) -> None:
    """install() twice is a no-op; the tables are STRICT; the producer's user_version stays 0."""
    assert outbox.VERSION == outbox.install(conn)
    assert outbox.VERSION == outbox.installed_version(conn)
    strict = dict(conn.execute("SELECT name, strict FROM pragma_table_list WHERE name LIKE 'outbox%'").fetchall())
    assert {"outbox": 1, "outbox_meta": 1, "outbox_owners": 1} == strict
    assert 0 == conn.execute("PRAGMA user_version").fetchone()[0]
    assert "wal" == conn.execute("PRAGMA journal_mode").fetchone()[0]
    assert 2 == conn.execute("PRAGMA synchronous").fetchone()[0]  # FULL


def test_install_inside_the_callers_transaction_rolls_back_with_it(tmp_path: Path) -> None:
    """install() in an open transaction is part of it: a rollback removes the tables."""
    conn = sqlite3.connect(tmp_path / "p.db", isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    outbox.install(conn)
    conn.execute("ROLLBACK")
    assert 0 == outbox.installed_version(conn)
    conn.close()


def test_a_newer_outbox_is_refused(conn: sqlite3.Connection, db_path: Path) -> None:
    """A database whose outbox is newer than the code is refused, not downgraded."""
    conn.execute("UPDATE outbox_meta SET value = '99' WHERE key = 'version'")
    with pytest.raises(DatabaseError, match="newer"):
        outbox.connect(db_path)
    with pytest.raises(DatabaseError, match="newer"):
        outbox.connect(db_path, readonly=True)


def test_a_consumer_inbox_is_not_a_producer_database(tmp_path: Path) -> None:
    """Pointing --db at a consumer's inbox database is refused without changing it."""
    path = tmp_path / "catalog.db"
    consumers.open_db(path, "catalog", create=True).close()
    with pytest.raises(DatabaseError, match="inbox database"):
        outbox.connect(path)


def test_enqueue_commits_or_rolls_back_with_the_producers_change(conn: sqlite3.Connection) -> None:
    """The producer's row and the outbox row commit together or not at all."""
    conn.execute("CREATE TABLE things (id INTEGER PRIMARY KEY, name TEXT NOT NULL) STRICT")
    kept, lost = envelope("kept"), envelope("lost")
    with outbox.transaction(conn):
        conn.execute("INSERT INTO things (name) VALUES ('kept')")
        assert outbox.enqueue(conn, kept)
    with pytest.raises(RuntimeError), outbox.transaction(conn):
        conn.execute("INSERT INTO things (name) VALUES ('lost')")
        outbox.enqueue(conn, lost)
        raise RuntimeError("the producer fails after enqueue")
    assert [("kept",)] == conn.execute("SELECT name FROM things").fetchall()
    assert [kept["eventId"]] == [r[0] for r in conn.execute("SELECT event_id FROM outbox")]


def test_enqueue_outside_a_transaction_is_refused(conn: sqlite3.Connection) -> None:
    """enqueue() without the caller's open transaction raises and writes nothing."""
    with pytest.raises(outbox.OutboxError, match="transaction"):
        outbox.enqueue(conn, envelope())
    assert 0 == outbox.unpublished(conn)


def test_same_event_id_same_body_is_a_no_op_other_body_is_event_id_reused(conn: sqlite3.Connection) -> None:
    """Re-enqueueing an identical event does nothing; another body under its eventId is event-id-reused."""
    env = envelope()
    with outbox.transaction(conn):
        assert outbox.enqueue(conn, env) is True
        assert outbox.enqueue(conn, dict(reversed(list(env.items())))) is False  # key order is not a difference
    changed = {**env, "revision": 2}
    with pytest.raises(Rejection) as caught, outbox.transaction(conn):
        outbox.enqueue(conn, changed)
    assert "event-id-reused" == caught.value.code
    assert 1 == outbox.unpublished(conn)


def test_an_invalid_envelope_is_rejected_and_nothing_is_written(conn: sqlite3.Connection) -> None:
    """enqueue() validates against the schema: a bad envelope raises its rejection code."""
    bad = envelope()
    del bad["occurredAt"]
    with pytest.raises(Rejection) as caught, outbox.transaction(conn):
        outbox.enqueue(conn, bad)
    assert "invalid-envelope" == caught.value.code
    with pytest.raises(Rejection) as caught, outbox.transaction(conn):
        outbox.enqueue(conn, b"{not json")
    assert "malformed-json" == caught.value.code
    assert 0 == outbox.unpublished(conn)


def test_the_stored_body_is_canonical_and_keeps_the_fingerprint(conn: sqlite3.Connection) -> None:
    """The row holds the canonical bytes; parsing them gives the fingerprint stored beside them."""
    env = envelope()
    raw = orjson.dumps(env, option=orjson.OPT_INDENT_2)
    with outbox.transaction(conn):
        outbox.enqueue(conn, raw)
    body, fp, key, ordering = conn.execute(
        "SELECT body, fingerprint, routing_key, ordering_key FROM outbox").fetchone()
    assert parse(raw).canonical == body
    assert parse(body).fingerprint == fp
    assert ("material.published", "article-1") == (key, ordering)


# -- the dispatcher ------------------------------------------------------------------------


def test_rows_go_out_in_creation_order_and_only_confirmed_ones_are_marked(conn: sqlite3.Connection) -> None:
    """Publication follows creation order; published_at only for confirmed rows; a returned row is quarantined at
    once; a nacked one whose destination confirmed a later row (its own nack) gets a failure and a backoff, a
    nacked one whose destination confirmed nothing after it waits on the outage: no failure, due at once."""
    ids = add(conn, *(envelope(f"a{i}") for i in range(5)), envelope(twin("a4")),
              *(envelope(f"c{i}") for i in range(2)))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = {ids[1]: "returned", ids[4]: "nacked", ids[7]: "nacked"}
    assert 8 == dispatcher(conn, pub, clock).step()
    assert ids == [m.message_id for m in pub.sent]
    assert all(m.exchange == "test.events" and m.routing_key == "material.published" for m in pub.sent)
    for i, event_id in enumerate(ids):
        r = row(conn, event_id)
        assert 1 == r["attempts"]
        assert r["leaseOwner"] is None
        if i == 1:
            assert (None, "quarantined", None) == (r["publishedAt"], r["status"], r["nextAttemptAt"])
            assert r["quarantineReason"] == r["lastError"] == "returned: unroutable: 312 NO_ROUTE"
            assert now_iso(clock.now) == r["quarantinedAt"]
        elif i == 4:
            assert (None, "pending", 1) == (r["publishedAt"], r["status"], r["failures"])
            assert r["nextAttemptAt"] > now_iso(clock.now)
            assert r["lastError"].startswith("nacked")
        elif i == 7:
            assert (None, "pending", 0, now_iso(clock.now)) == (r["publishedAt"], r["status"], r["failures"],
                                                                r["nextAttemptAt"])
            assert r["lastError"].startswith("nacked")
        else:
            assert now_iso(clock.now) == r["publishedAt"]
            assert r["lastError"] is None


def test_the_next_batch_is_sent_before_the_previous_is_marked_but_never_overtakes_its_article(
    conn: sqlite3.Connection,
) -> None:
    """With two batches in flight, an article whose row is in flight is left out of the next batch."""
    a1, b1, a2, c1 = add(conn, envelope("a", 1), envelope("b", 1), envelope("a", 2), envelope("c", 1))
    pub, clock = FakePublisher(), Clock()
    d = dispatcher(conn, pub, clock, batch=2, depth=2)
    assert 2 == d.step()
    assert [("send", [a1, b1]), ("send", [c1]), ("collect", [a1, b1])] == pub.log
    assert 1 == d.step()
    assert 1 == d.step()
    assert [("send", [a2]), ("collect", [c1]), ("collect", [a2])] == pub.log[3:]
    assert 0 == outbox.unpublished(conn)


def test_a_stop_settles_the_batches_in_flight_and_claims_no_more(conn: sqlite3.Connection) -> None:
    """After stop(), run() collects and marks what was sent, leaves the rest unleased, and returns."""
    ids = add(conn, *(envelope(f"a{i}") for i in range(5)))
    pub, clock = FakePublisher(), Clock()
    d = dispatcher(conn, pub, clock, batch=2, depth=2)
    d.step()  # [a0 a1] marked, [a2 a3] in flight
    d.stop()
    d.run()
    assert ids[:4] == [r["eventId"] for r in reversed(outbox.list_rows(conn, state="published"))]
    assert (None, 0) == (row(conn, ids[4])["leaseOwner"], row(conn, ids[4])["attempts"])


def test_a_failing_row_holds_back_its_article_but_not_the_others(conn: sqlite3.Connection) -> None:
    """While a row waits for its backoff, later rows of its article wait too; other articles go on; the retry goes
    out alone, and the later rows only once it is confirmed."""
    first, _ = add(conn, envelope("a", 1), envelope(twin("a")))  # its twin confirmed behind it: its own nack
    pub, clock = FakePublisher(), Clock()
    d = dispatcher(conn, pub, clock, retry_base_s=10)
    pub.verdicts[first] = "nacked"
    d.step()
    assert 1 == row(conn, first)["failures"]
    later_a, other = add(conn, envelope("a", 2), envelope("b", 1))
    pub.sent.clear()
    d.step()
    assert [other] == [m.message_id for m in pub.sent]  # a/2 waits behind a/1
    assert row(conn, later_a)["attempts"] == 0
    del pub.verdicts[first]
    clock.now += 10.01  # past the first backoff (at most retry_base_s)
    pub.log.clear()
    d.step()
    d.step()
    assert [("send", [first]), ("collect", [first]), ("send", [later_a]), ("collect", [later_a])] == pub.log
    assert 0 == outbox.unpublished(conn)


def test_a_claim_stops_at_its_byte_budget_but_takes_at_least_one_row(conn: sqlite3.Connection) -> None:
    """batch_bytes bounds the memory of a batch; a single row larger than the budget still goes alone."""
    big = {**envelope("big"), "data": {"title": "t", "url": "u", "blob": "x" * 5000}}
    add(conn, big, envelope("a"), envelope("b"), envelope("c"))
    clock = Clock()
    d = dispatcher(conn, FakePublisher(), clock, batch_bytes=1000)
    assert [1] == [r.seq for r in d.claim()]  # alone: over the budget by itself
    assert [2, 3, 4] == [r.seq for r in d.claim()]  # about 200 bytes each: all fit
    d2 = dispatcher(conn, FakePublisher(), clock, batch_bytes=500, owner="other")
    clock.now += 61  # both leases expired
    assert [1] == [r.seq for r in d2.claim()]
    assert [2, 3] == [r.seq for r in d2.claim()]


def test_a_row_backoff_grows_with_its_attempts(conn: sqlite3.Connection) -> None:
    """A row nacked while its destination confirms others (its own nack) is retried after base*2^(n-1)
    (jittered into its upper half), capped."""
    event_id = add(conn, envelope())[0]
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[event_id] = "nacked"
    d = dispatcher(conn, pub, clock, retry_base_s=1, retry_cap_s=4)
    for attempt, ceiling in enumerate([1, 2, 4, 4, 4], start=1):
        add(conn, envelope(twin("article-1"), attempt))  # confirmed behind it, to its destination
        assert 2 == d.step()
        assert 0 == d.step()  # not before its time
        due = row(conn, event_id)["nextAttemptAt"]
        assert now_iso(clock.now + ceiling / 2 - 0.002) <= due <= now_iso(clock.now + ceiling)
        assert attempt == row(conn, event_id)["attempts"]
        clock.now += ceiling + 0.01
    assert row(conn, event_id)["publishedAt"] is None


def test_a_broker_outage_is_waited_out_with_backoff_and_touches_no_row(conn: sqlite3.Connection) -> None:
    """While the broker is down nothing is claimed; the waits grow; afterwards every row goes out."""
    ids = add(conn, envelope("a"), envelope("b"))
    pub, clock = FakePublisher(), Clock()
    pub.down = 5
    d = dispatcher(conn, pub, clock)
    for _ in range(5):
        assert 0 == d.step()
        assert all(row(conn, i)["attempts"] == 0 and row(conn, i)["leaseOwner"] is None for i in ids)
    assert 5 == len(clock.slept)
    for n, waited in enumerate(clock.slept, start=1):
        ceiling = min(RECONNECT_CAP_S, 0.5 * 2 ** (n - 1))
        assert ceiling / 2 - 0.05 <= waited <= ceiling  # less what the (instant) connect took, on a busy machine
    assert 2 == d.step()
    assert 0 == outbox.unpublished(conn)
    assert 1 == d.stats.outages  # one outage, however many attempts it took


def test_unconfirmed_rows_are_released_and_the_dispatcher_backs_off(conn: sqlite3.Connection) -> None:
    """A connection lost: both batches in flight keep published_at empty, release their leases, no per-row
    backoff, one pause before reconnecting."""
    ids = add(conn, envelope("a"), envelope("b"))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = {ids[0]: "unconfirmed", ids[1]: "unconfirmed"}
    d = dispatcher(conn, pub, clock, batch=1, depth=2)
    d.step()
    assert [("send", ids[:1]), ("send", ids[1:]), ("collect", ids[:1]), ("collect", ids[1:])] == pub.log
    for event_id in ids:
        r = row(conn, event_id)
        assert (None, None, None, 1) == (r["publishedAt"], r["leaseOwner"], r["nextAttemptAt"], r["attempts"])
        assert r["lastError"].startswith("unconfirmed")
    assert 1 == len(clock.slept)
    pub.verdicts.clear()
    assert [1, 1] == [d.step(), d.step()]
    assert 2 == pub.connects  # it reconnected before claiming again
    assert 0 == outbox.unpublished(conn)


def test_a_mark_that_fails_during_a_connection_loss_is_recovered(conn: sqlite3.Connection) -> None:
    """If the database refuses a mark while the connection is lost, the next round marks that batch first
    (its lease released at once, not at its end), settles what was left in flight, reconnects, and every
    row is published in the end without waiting for a lease."""
    ids = add(conn, envelope("a"), envelope("b"))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = dict.fromkeys(ids, "unconfirmed")
    d = dispatcher(conn, pub, clock, batch=1, depth=2, lease_s=30)
    mark, calls = d.mark, []

    def flaky_mark(rows: Sequence[outbox.Claimed], results: Sequence[PublishResult]) -> None:
        calls.append(rows)
        if len(calls) == 1:
            raise TransientError("database is locked", code=sqlite.DATABASE_BUSY)
        mark(rows, results)

    d.mark = flaky_mark  # type: ignore[method-assign]
    with pytest.raises(TransientError):
        d.step()  # batch [a] unmarked (kept to be marked first), batch [b] still in flight
    pub.verdicts.clear()
    assert 1 == d.step()  # [a] marked, [b] settled as unconfirmed, reconnected, [a] claimed again and published
    assert 2 == pub.connects
    assert row(conn, ids[0])["publishedAt"] is not None
    assert 1 == d.step()  # no lease to wait for
    assert 0 == outbox.unpublished(conn)


def test_two_dispatchers_never_claim_the_same_row_nor_the_same_article(
    conns: Callable[[], sqlite3.Connection],
) -> None:
    """Leases split the rows between dispatchers; an article leased by one is skipped by the other."""
    first, second = conns(), conns()
    add(first, *(envelope(f"a{i % 4}", i) for i in range(1, 13)))
    clock = Clock()
    d1 = dispatcher(first, FakePublisher(), clock, batch=3, owner="d1")
    d2 = dispatcher(second, FakePublisher(), clock, batch=100, owner="d2")
    one, two = d1.claim(), d2.claim()
    assert [1, 2, 3] == [r.seq for r in one]
    assert [4, 8, 12] == [r.seq for r in two]  # only article a0 (seq 4, 8, 12) is free
    assert not {r.seq for r in one} & {r.seq for r in two}
    owners = dict(first.execute("SELECT seq, lease_owner FROM outbox").fetchall())
    assert {"d1"} == {owners[s] for s in (1, 2, 3)}
    assert {"d2"} == {owners[s] for s in (4, 8, 12)}
    assert [] == d2.claim()


def test_a_dead_dispatchers_lease_expires_and_another_takes_its_rows(
    conns: Callable[[], sqlite3.Connection],
) -> None:
    """Rows leased by a dispatcher that died wait for the lease to end, then are claimed again, with a note."""
    first, second = conns(), conns()
    event_id = add(first, envelope())[0]
    clock = Clock()
    dead = dispatcher(first, FakePublisher(), clock, lease_s=30, owner="dead")
    assert 1 == len(dead.claim())  # ... and it dies here
    alive = dispatcher(second, FakePublisher(), clock, lease_s=30, owner="alive")
    assert 0 == alive.step()
    clock.now += 29.9
    assert 0 == alive.step()
    clock.now += 0.2
    assert 1 == alive.step()
    r = row(second, event_id)
    assert r["publishedAt"] is not None
    assert "lease of dead expired" in r["lastError"]


def test_late_marks_of_a_stalled_dispatcher_never_undo_the_others(conns: Callable[[], sqlite3.Connection]) -> None:
    """A dispatcher that outlived its lease cannot unpublish a row nor overwrite its published_at."""
    first, second = conns(), conns()
    a, b = add(first, envelope("a"), envelope("b"))
    clock = Clock()
    stalled = dispatcher(first, FakePublisher(), clock, lease_s=10, owner="stalled")
    claimed = stalled.claim()
    clock.now += 11
    taker = dispatcher(second, FakePublisher(), clock, lease_s=10, owner="taker")
    assert 2 == taker.step()
    published = {i: row(second, i)["publishedAt"] for i in (a, b)}
    clock.now += 5
    stalled.mark(claimed, [PublishResult("returned", "unroutable"), PublishResult("confirmed")])
    for event_id in (a, b):
        r = row(second, event_id)
        assert published[event_id] == r["publishedAt"]
        assert r["nextAttemptAt"] is None
    assert 2 == row(second, b)["attempts"]  # its publication was still an attempt


def test_a_fatal_broker_error_releases_the_leases(conn: sqlite3.Connection) -> None:
    """BrokerFatal while publishing propagates, and the claimed rows are free for the next dispatcher."""
    event_id = add(conn, envelope())[0]
    pub, clock = FakePublisher(), Clock()
    pub.raise_on_collect = BrokerFatal("access refused")
    with pytest.raises(BrokerFatal):
        dispatcher(conn, pub, clock).step()
    r = row(conn, event_id)
    assert (None, None, 0) == (r["leaseOwner"], r["publishedAt"], r["attempts"])


def test_run_publishes_everything_in_batches_and_exits_when_idle(conn: sqlite3.Connection) -> None:
    """run() with exit_when_idle_s drains the outbox batch by batch, keeps the connection alive, then returns."""
    add(conn, *(envelope(f"a{i}") for i in range(25)))
    pub, clock = FakePublisher(), Clock()
    stats = dispatcher(conn, pub, clock, batch=10, exit_when_idle_s=0.05, poll_s=0.01).run()
    assert (25, 3) == (stats.published, stats.batches)
    assert 0 == outbox.unpublished(conn)
    assert pub.idled  # idle waits service the connection instead of sleeping blind
    assert "25 published in 3 batches" in stats.line()


class SpinGuard(FakePublisher):
    """Its idle() returns at once, like a dead connection's; a dispatcher that called it in a
    loop without sleeping would never move the test's clock: it fails instead of hanging."""

    def idle(self, seconds: float, wake: int | None = None) -> None:
        super().idle(seconds)
        assert len(self.idled) < 1000, "idle() called over and over with no sleep between: a spin"


def test_a_connection_lost_while_idle_is_not_spun_on(conn: sqlite3.Connection) -> None:
    """When idle() returns at once (connection gone), the dispatcher sleeps the rest of each poll
    and reconnects before the next pass: one sleep and one reconnect per poll, never a spin."""
    pub, clock = SpinGuard(), Clock()
    stats = dispatcher(conn, pub, clock, poll_s=0.5, exit_when_idle_s=5).run()
    assert 0 == stats.batches
    polls = [s for s in clock.slept if s > 0.1]  # the last pause is what is left of the 5 s
    assert 10 == len(polls)
    assert all(s == pytest.approx(0.5, abs=0.01) for s in polls)
    assert len(pub.idled) == len(clock.slept)  # each idle that returned at once: the rest slept
    assert len(pub.idled) + 1 == pub.connects  # and a reconnect for each next pass


def test_a_busy_database_is_waited_out(db_path: Path, conn: sqlite3.Connection) -> None:
    """A write lock held past busy_timeout makes the dispatcher back off and retry, not exit."""
    add(conn, envelope())
    mine = outbox.connect(db_path, busy_timeout_ms=20)
    conn.execute("BEGIN IMMEDIATE")  # the producer holds the write lock
    clock = Clock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if conn.in_transaction:
            conn.execute("COMMIT")  # the producer finishes

    try:
        d = outbox.Dispatcher(mine, FakePublisher(), outbox.DispatchConfig(exchange="x", exit_when_idle_s=1),
                              clock=clock.time, sleep=sleep)
        assert 1 == d.run().published
        assert 0.25 <= clock.slept[0] <= 0.5  # the first backoff of reconnect_delay_s
    finally:
        mine.close()


def test_a_stop_interrupts_a_long_backoff(conn: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() (what SIGTERM calls) ends a 30 s outage backoff within a fraction of a second: the
    backoff sleeps in slices of at most 0.2 s and sleeps no further slice once stopped."""
    d = outbox.Dispatcher(conn, FakePublisher(), outbox.DispatchConfig(exchange="x"))
    slices: list[float] = []

    class Time:
        """The dispatcher module's clock: a stop arrives during the first slice."""

        now = 1000.0

        def monotonic(self) -> float:
            return self.now

        def sleep(self, seconds: float) -> None:
            slices.append(seconds)
            self.now += seconds
            if len(slices) == 1:
                d.stop()

    monkeypatch.setattr(sys.modules[outbox.Dispatcher.__module__], "time", Time())
    d.sleep(30)
    assert 1 == len(slices) and 0 < slices[0] <= 0.2


# -- list / stats / show / prune --------------------------------------------------------------


def test_list_stats_show_and_prune(conn: sqlite3.Connection) -> None:
    """The read queries classify rows by state (list --state due lists what stats counts as due); prune
    deletes only old published rows."""
    ids = add(conn, *(envelope(f"a{i}") for i in range(4)))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[ids[2]] = "returned"
    d = dispatcher(conn, pub, clock, batch=3, depth=1)
    d.step()  # a0, a1 published, a2 returned; a3 untouched
    states = {r["eventId"]: r["state"] for r in outbox.list_rows(conn, now=clock.now)}
    assert {ids[0]: "published", ids[1]: "published", ids[2]: "quarantined", ids[3]: "pending"} == states
    assert [ids[2], ids[3]] == [r["eventId"] for r in outbox.list_rows(conn, state="unpublished")]
    assert [ids[2]] == [r["eventId"] for r in outbox.list_rows(conn, state="failed")]
    assert [ids[2]] == [r["eventId"] for r in outbox.list_rows(conn, state="quarantined")]
    assert [ids[1], ids[0]] == [r["eventId"] for r in outbox.list_rows(conn, state="published")]
    assert [ids[3]] == [r["eventId"] for r in outbox.list_rows(conn, state="due", now=clock.now)]  # as stats counts
    assert 1 == len(outbox.list_rows(conn, limit=1))
    stats = outbox.stats(conn, now=clock.now)
    assert (4, 2, 2, 0, 1, 0) == (stats["rows"], stats["published"], stats["unpublished"], stats["failed"],
                                  stats["quarantined"], stats["leased"])
    assert {"returned: unroutable: 312 NO_ROUTE": 1} == stats["quarantineReasons"]
    assert 1 == stats["due"]
    shown = outbox.show(conn, ids[0])
    assert ids[0] == shown["body"]["eventId"]
    with pytest.raises(NotFound):
        outbox.show(conn, str(uuid.uuid4()))
    assert 0 == outbox.prune(conn, older_than_s=3600, now=clock.now)
    assert 2 == outbox.prune(conn, older_than_s=3600, now=clock.now + 7200)
    assert {ids[2], ids[3]} == {r["eventId"] for r in outbox.list_rows(conn)}


# -- the demo producer ---------------------------------------------------------------------------


def test_produce_writes_the_next_revision_and_its_event_together(tmp_path: Path) -> None:
    """Each produce is the next revision, in material and in the outbox; withdraw keeps title and url."""
    conn = producer.open_db(tmp_path / "p.db")
    first = producer.produce(conn, "a", title="T", url="https://e/a").envelope
    second = producer.produce(conn, "a", title="T2", url="https://e/a2").envelope
    gone = producer.produce(conn, "a", withdraw=True).envelope
    assert [1, 2, 3] == [first.revision, second.revision, gone.revision]
    assert ("material.withdrawn", "T2", "https://e/a2") == (gone.type, gone.data["title"], gone.data["url"])
    assert [("a", 3, "T2", "https://e/a2", 0, gone.event_id)] == conn.execute(
        "SELECT article_id, revision, title, url, published, event_id FROM material").fetchall()
    assert [first.event_id, second.event_id, gone.event_id] == [
        r["eventId"] for r in outbox.list_rows(conn, state="unpublished")]
    with pytest.raises(ConfigError):
        producer.produce(conn, "new")
    conn.close()


def test_produce_changes_nothing_when_the_event_cannot_be_enqueued(tmp_path: Path) -> None:
    """An event refused by the outbox rolls the material change back with it."""
    conn = producer.open_db(tmp_path / "p.db")
    done = producer.produce(conn, "a", title="T", url="https://e/a")
    with pytest.raises(Rejection, match="event-id-reused"):
        producer.produce(conn, "a", title="T2", url="https://e/a", event_id=done.envelope.event_id)
    assert [(1, "T")] == conn.execute("SELECT revision, title FROM material").fetchall()
    assert 1 == outbox.unpublished(conn)
    conn.close()


def test_cli_produce_and_outbox_read_commands(tmp_path: Path) -> None:
    """produce --json, outbox list/stats/show --json and prune through the CLI; an unknown eventId exits 1."""
    runner = CliRunner()
    db = str(tmp_path / "p.db")
    made = runner.invoke(main, ["produce", "--db", db, "--article", "a", "--title", "T", "--url", "u", "--json"])
    assert 0 == made.exit_code, made.output
    event_id = orjson.loads(made.output)["eventId"]
    listed = runner.invoke(main, ["outbox", "list", "--db", db, "--json"])
    assert [event_id] == [r["eventId"] for r in orjson.loads(listed.output)]
    stats = orjson.loads(runner.invoke(main, ["outbox", "stats", "--db", db, "--json"]).output)
    assert (1, 1) == (stats["rows"], stats["unpublished"])
    shown = orjson.loads(runner.invoke(main, ["outbox", "show", "--db", db, event_id, "--json"]).output)
    assert "a" == shown["body"]["articleId"]
    assert 1 == runner.invoke(main, ["outbox", "show", "--db", db, str(uuid.uuid4())]).exit_code
    pruned = runner.invoke(main, ["outbox", "prune", "--db", db, "--older-than", "0s", "--json"])
    assert {"deleted": 0, "unpublished": 1} == orjson.loads(pruned.output)
    text = runner.invoke(main, ["outbox", "list", "--db", db])
    assert event_id in text.output and "pending" in text.output
    missing = runner.invoke(main, ["outbox", "list", "--db", str(tmp_path / "none.db")])
    assert 2 == missing.exit_code
