"""One outbox, two storage backends: the dispatcher's and the operator's scenarios run on SQLite and on
PostgreSQL alike (the ``backend`` fixture), with a publisher and a clock under the test's control."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outboxkit import Clock, FakePublisher, envelope
from support import closed_at_exit

from delivery_consumer import outbox
from delivery_consumer.amqp.publisher import PublishResult
from delivery_consumer.model.errors import Rejection, TransientError
from delivery_consumer.outbox import owners


@dataclasses.dataclass
class Backend:
    """An outbox on one backend: the application's connection and the dispatchers' ones."""

    kind: str
    app: Any  # sqlite3.Connection, or the application's psycopg connection
    open: Callable[[], outbox.OutboxDb]
    _shared: outbox.OutboxDb | None = None

    def add(self, *envs: dict[str, Any]) -> list[str]:
        """Enqueue *envs* in one application transaction."""
        with self.transaction():
            for env in envs:
                outbox.enqueue(self.app, env)
        return [env["eventId"] for env in envs]

    def shared(self) -> outbox.OutboxDb:
        """One dispatcher connection kept for the whole test (the property's examples share it)."""
        if self._shared is None:
            self._shared = self.open()
        return self._shared

    def transaction(self) -> Any:
        return outbox.transaction(self.app) if self.kind == "sqlite" else self.app.transaction()

    def write_app_row(self, name: str) -> None:
        """The application's own change, in its own table."""
        self.app.execute("INSERT INTO material (name) VALUES (" + ("?" if self.kind == "sqlite" else "%s") + ")",
                         (name,))

    def app_rows(self) -> list[str]:
        return [r[0] for r in self.app.execute("SELECT name FROM material ORDER BY name").fetchall()]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    with closed_at_exit() as keep:
        if request.param == "sqlite":
            path = tmp_path / "producer.db"
            app = keep(outbox.connect(path))
            app.execute("CREATE TABLE material (name TEXT NOT NULL)")
            yield Backend("sqlite", app, lambda: keep(outbox.open_db(path)))
        else:
            import psycopg

            url = request.getfixturevalue("pg_url")
            app = keep(psycopg.connect(url, autocommit=True))
            outbox.install(app)
            app.execute("CREATE TABLE material (name text NOT NULL)")
            yield Backend("postgres", app, lambda: keep(outbox.open_db(url)))


def dispatcher(db: outbox.OutboxDb, pub: FakePublisher, clock: Clock, **config: Any) -> outbox.Dispatcher:
    config.setdefault("exchange", "test.events")
    return outbox.Dispatcher(db, pub, outbox.DispatchConfig(**config), clock=clock.time, sleep=clock.sleep)


def test_the_application_change_and_its_event_commit_together_or_not_at_all(backend: Backend) -> None:
    """A committed transaction leaves its change and its row; a rolled-back one leaves neither."""
    kept, lost = envelope("kept"), envelope("lost")
    with backend.transaction():
        backend.write_app_row("kept")
        outbox.enqueue(backend.app, kept)
    with pytest.raises(RuntimeError), backend.transaction():
        backend.write_app_row("lost")
        outbox.enqueue(backend.app, lost)
        raise RuntimeError("the application changes its mind")
    db = backend.open()
    assert ["kept"] == backend.app_rows()
    assert [kept["eventId"]] == [r["eventId"] for r in outbox.list_rows(db)]


def test_enqueue_outside_a_transaction_is_refused(backend: Backend) -> None:
    """Without the application's transaction the row would commit on its own: refused, nothing written."""
    with pytest.raises(outbox.OutboxError, match="open transaction"):
        outbox.enqueue(backend.app, envelope())
    assert 0 == outbox.stats(backend.open())["rows"]


def test_same_validation_event_id_reuse_and_routing_key_rules(backend: Backend) -> None:
    """An invalid envelope is rejected, the same eventId with the same body is a no-op, with another body
    it is event-id-reused, and a routing key AMQP cannot carry is refused."""
    env = envelope("a")
    with backend.transaction():
        assert outbox.enqueue(backend.app, env) is True
        assert outbox.enqueue(backend.app, env) is False
    with pytest.raises(Rejection) as caught, backend.transaction():
        outbox.enqueue(backend.app, {**env, "revision": 2})
    assert "event-id-reused" == caught.value.code
    with pytest.raises(Rejection), backend.transaction():
        outbox.enqueue(backend.app, {**envelope(), "revision": "one"})
    with pytest.raises(outbox.OutboxError, match="255"), backend.transaction():
        outbox.enqueue(backend.app, envelope(), routing_key="k" * 256)
    assert 1 == outbox.stats(backend.open())["rows"]


def test_rows_go_out_in_creation_order_and_are_marked_published(backend: Backend) -> None:
    """Batches follow seq order; confirmed rows are published, the message carries the eventId and slot."""
    ids = backend.add(*(envelope(f"a{i % 3}", i) for i in range(1, 8)))
    pub, clock = FakePublisher(), Clock()
    d = dispatcher(backend.open(), pub, clock, batch=3)
    assert [3, 3, 1] == [d.step(), d.step(), d.step()]
    assert ids == [m.message_id for m in pub.sent]
    assert all(m.headers for m in pub.sent)
    stats = outbox.stats(d.db)
    assert (7, 0) == (stats["published"], stats["unpublished"])


def test_a_nacked_row_retries_alone_and_holds_the_later_rows_of_its_key(backend: Backend) -> None:
    """A nack (its destination confirming nothing after it) makes the row wait on the outage; later rows of its
    key wait behind it, other keys go on; once the probe is due the row goes out and its key follows, in
    order."""
    a1, b1, a2 = backend.add(envelope("a", 1), envelope("b", 1), envelope("a", 2))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[a1] = "nacked"
    d = dispatcher(backend.open(), pub, clock, batch=1, depth=1, retry_base_s=1, retry_cap_s=1)
    assert (1, 1, 0) == (d.step(), d.step(), d.step())
    states = {r["eventId"]: r["state"] for r in outbox.list_rows(d.db)}
    assert {a1: "pending", b1: "published", a2: "held"} == states
    assert (0, 1) == (outbox.show(d.db, a1)["failures"], d.stats.outages)
    pub.verdicts.clear()
    clock.now += 5
    while d.step():
        pass
    sent = [m.message_id for m in pub.sent]
    assert sent.index(a1, 1) < sent.index(a2)
    assert 0 == outbox.unpublished(d.db)


def test_quarantine_keeps_its_reason_and_requeue_drop_prune_act_on_it(backend: Backend) -> None:
    """An unroutable row is quarantined with its reason; drop records who and why; requeue sends it again;
    prune deletes only published and dropped rows older than the cutoff."""
    bad, good = backend.add(envelope("a"), envelope("b"))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[bad] = "returned"
    d = dispatcher(backend.open(), pub, clock)
    d.step()
    shown = outbox.show(d.db, bad)
    assert "quarantined" == shown["state"] and "312 NO_ROUTE" in shown["quarantineReason"]
    assert [bad] == outbox.quarantined_ids(d.db)
    assert "dropped" == outbox.drop(d.db, [bad], by="ops", reason="wrong key")[0]["outcome"]
    assert "wrong key" in outbox.show(d.db, bad)["detail"]
    assert "requeued" == outbox.requeue(d.db, [bad], by="ops")[0]["outcome"]
    pub.verdicts.clear()
    clock.now += 1
    assert 1 == d.step()
    assert 0 == outbox.prune(d.db, older_than_s=3600)
    assert 2 == outbox.prune(d.db, older_than_s=0, now=clock.now + 10)
    assert 0 == outbox.stats(d.db)["rows"]
    assert "not-found" == outbox.requeue(d.db, [good], by="ops")[0]["outcome"]


def test_two_dispatchers_never_claim_the_same_row_nor_the_same_key(backend: Backend) -> None:
    """Leases split the rows between dispatchers; a key leased by one is skipped by the other."""
    backend.add(*(envelope(f"a{i % 4}", i) for i in range(1, 13)))
    clock = Clock()
    d1 = dispatcher(backend.open(), FakePublisher(), clock, batch=3, owner="d1")
    d2 = dispatcher(backend.open(), FakePublisher(), clock, batch=100, owner="d2")
    one, two = d1.claim(), d2.claim()
    assert [1, 2, 3] == [r.seq for r in one]
    assert [4, 8, 12] == [r.seq for r in two]


def test_a_dead_owners_leases_are_taken_back_at_once(backend: Backend) -> None:
    """A registered dispatcher whose process is gone loses its leases at the next claim of another, with a note."""
    event_id = backend.add(envelope())[0]
    clock = Clock()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = dispatcher(backend.open(), FakePublisher(), clock, lease_s=600, owner="dead")
    ghost = dataclasses.replace(owners.Identity.mine("dead"), pid=child.pid, proc_start=None)
    owners.register(dead.db, ghost, 2.0, clock.now)
    assert 1 == len(dead.claim())  # ... and it "dies" here
    alive = dispatcher(backend.open(), FakePublisher(), clock, lease_s=600, owner="alive")
    assert 1 == alive.step()
    assert "lease of dead taken back" in outbox.show(alive.db, event_id)["lastError"]


def test_a_mark_the_database_refused_is_retried_first(backend: Backend) -> None:
    """A batch published while the database failed its mark is marked at the next step, spending no attempt
    beyond the one it made, and its lease is not waited for."""
    (event_id,) = backend.add(envelope())
    pub, clock = FakePublisher(), Clock()
    d = dispatcher(backend.open(), pub, clock, lease_s=600)
    mark, calls = d.mark, []

    def flaky(rows: Sequence[outbox.Claimed], results: Sequence[PublishResult]) -> None:
        calls.append(rows)
        if len(calls) == 1:
            raise TransientError("the database went away", code="database-unavailable")
        mark(rows, results)

    d.mark = flaky  # type: ignore[method-assign]
    with pytest.raises(TransientError):
        d.step()
    d.step()
    row = outbox.show(d.db, event_id)
    assert (1, "published") == (row["attempts"], row["state"])
    assert 1 == len(pub.sent)


def test_run_exits_when_idle_and_leaves_no_lease_nor_owner(backend: Backend) -> None:
    """run() publishes everything, exits after the idle time, gives back its leases and unregisters."""
    backend.add(*(envelope(f"k{i}") for i in range(5)))
    clock = Clock()
    d = dispatcher(backend.open(), FakePublisher(), clock, exit_when_idle_s=1.0, wake=False)
    stats = d.run()
    assert 5 == stats.published
    assert 0 == d.db.execute("SELECT count(*) FROM outbox_owners").fetchone()[0]
    assert 0 == d.db.execute("SELECT count(*) FROM outbox WHERE lease_owner IS NOT NULL").fetchone()[0]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["confirmed", "nacked", "returned"])),
                min_size=1, max_size=12))
def test_every_row_leaves_the_stream_and_each_key_is_published_in_order(
    backend: Backend, plan: list[tuple[str, str]],
) -> None:
    """Whatever the first verdicts, every row ends published or quarantined, and with one row per batch each
    key's published rows went out (for the last time) in creation order."""
    db = backend.shared()  # the examples share one database: empty it
    db.execute("UPDATE outbox SET status = 'dropped', dropped_at = '0', lease_owner = NULL")
    outbox.prune(db, older_than_s=0, now=1e10)
    envs = [envelope(key, i + 1) for i, (key, _) in enumerate(plan)]
    ids = backend.add(*envs)
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = {eid: verdict for eid, (_, verdict) in zip(ids, plan, strict=True) if verdict != "confirmed"}
    # One row per batch: rows of one batch go out together, so a later row of the key may pass a nacked one
    # in the same batch (outbox show's passedBy); across batches a retry holds its key.
    d = dispatcher(db, pub, clock, batch=1, depth=1, retry_base_s=1, retry_cap_s=1)
    for _ in plan:
        d.step()
    pub.verdicts = {eid: v for eid, v in pub.verdicts.items() if v == "returned"}
    for _ in range(3 * len(plan) + 3):
        clock.now += 2
        d.step()
    rows = {r["eventId"]: r for r in outbox.list_rows(d.db, limit=None)}
    assert all(rows[eid]["state"] in ("published", "quarantined") for eid in ids)
    last_sent = {m.message_id: i for i, m in enumerate(pub.sent)}
    for key in "abc":
        published = [eid for eid, env in zip(ids, envs, strict=True)
                     if env["articleId"] == key and rows[eid]["state"] == "published"]
        assert published == sorted(published, key=lambda eid: last_sent[eid])


def test_sqlite_needs_nothing_new() -> None:
    """The SQLite outbox imports no psycopg: the PostgreSQL backend is an optional extra."""
    code = ("import sys; from delivery_consumer import outbox; from delivery_consumer.outbox import dispatcher;"
            " print('psycopg' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert "False" == out.stdout.strip()

