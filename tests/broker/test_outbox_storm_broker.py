"""A nack storm on the real broker: a quorum queue of the test's own, full with ``x-overflow: reject-publish``,
nacks every row the dispatcher sends; once it is drained the broker confirms again. The dispatcher must log
one outage, publish every row exactly once, each key in creation order, and let every waiting row go as
soon as the queue takes them (on the SQLite outbox and on the PostgreSQL one: the same code path)."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import pytest
from brokerkit import Namespace, RunProcess, kill
from outboxkit import envelope
from support import wait_until
from tcpproxy import Proxy
from test_outbox_broker import make_events, queued_ids

from delivery_consumer import outbox

pytestmark = pytest.mark.broker

ROUTING_KEY = "storm.x"
#: The queue's x-max-length: more than the rows, so that once drained it takes them all.
CAPACITY = 400


@contextlib.contextmanager
def full_queue(ns: Namespace) -> Iterator[str]:
    """A quorum queue bound to the namespace's exchange for ROUTING_KEY, filled until the broker nacks."""
    queue = f"{ns.prefix}.storm"
    conn, ch = ns.channel()
    try:
        ch.exchange_declare(ns.exchange, exchange_type="topic", durable=True)
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum", "x-max-length": CAPACITY,
                                                         "x-overflow": "reject-publish"})
        ch.queue_bind(queue, ns.exchange, routing_key=ROUTING_KEY)
        ch.confirm_delivery()
        for i in range(CAPACITY + 10):
            try:
                ch.basic_publish("", queue, b"filler", pika.BasicProperties(delivery_mode=2, message_id=f"filler-{i}"))
            except pika.exceptions.NackError:
                break
        else:
            raise AssertionError(f"{queue} took {CAPACITY + 10} messages: it never refused")
    finally:
        conn.close()
    try:
        yield queue
    finally:
        conn, ch = ns.channel()
        ch.queue_delete(queue)
        conn.close()


def enqueue_rows(db: str, keys: list[str]) -> list[str]:
    """One row per key, in this order (revision: its rank within the key), routed to ROUTING_KEY."""
    envs, rank = [], Counter[str]()
    for key in keys:
        rank[key] += 1
        envs.append(envelope(key, rank[key]))
    if db.startswith("postgresql"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as pg:
            outbox.install(pg)
            with pg.transaction():
                for env in envs:
                    outbox.enqueue(pg, env, routing_key=ROUTING_KEY)
    else:
        with contextlib.closing(outbox.connect(db)) as conn, outbox.transaction(conn):
            for env in envs:
                outbox.enqueue(conn, env, routing_key=ROUTING_KEY)
    return [env["eventId"] for env in envs]


def outbox_stats(db: str) -> dict[str, Any]:
    with contextlib.closing(outbox.open_db(db, readonly=True)) as conn:
        return outbox.stats(conn)


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, ns: Namespace) -> str:
    """The producer's outbox: a SQLite file, or a PostgreSQL database of the test's own."""
    if request.param == "sqlite":
        return str(ns.workdir / "producer.db")
    return str(request.getfixturevalue("pg_url"))


def test_a_nack_storm_is_one_outage_and_the_rows_go_once_each_in_order_when_the_queue_takes_them(
    ns: Namespace, db: str,
) -> None:
    """While the queue is full every row is nacked: the dispatcher logs one outage (no line per row), probes,
    spends no row's failure; once the queue is drained every row is published exactly once, each key in
    creation order, the outage's end is logged with its counts, and the exit line counts one outage."""
    keys = [f"k{i % 12}" for i in range(300)]
    with full_queue(ns) as queue:
        ids = enqueue_rows(db, keys)
        key_of = dict(zip(ids, keys, strict=True))
        cmd = [sys.executable, "-m", "delivery_consumer", "dispatch", "--db", db, "--poll", "50ms", "--batch", "50"]
        proc = RunProcess(cmd, cwd=ns.workdir, env=ns.env())
        ns.started.append(proc)
        try:
            proc.wait_for_log("one outage;")
            # The outage has outlived a probe: some row went out again, and was nacked again.
            wait_until("a probe nacked", lambda: outbox_stats(db)["maxAttemptsUnpublished"] >= 2, procs=[proc])
            assert 0 == outbox_stats(db)["published"]
            conn, ch = ns.channel()
            ch.queue_purge(queue)  # room again: the broker confirms
            conn.close()
            wait_until("every row published", lambda: outbox_stats(db)["published"] == len(ids), procs=[proc])
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                kill(proc)
        assert 0 == proc.returncode, err[-3000:]
        got = [props.message_id for props, _ in ns.drain(queue)]
    assert Counter(dict.fromkeys(ids, 1)) == Counter(got), "every row exactly once"
    for key in set(keys):
        assert [e for e in ids if key_of[e] == key] == [e for e in got if key_of[e] == key], f"order of {key}"
    lines = err.splitlines()
    starts = [line for line in lines if "one outage;" in line]
    ends = [line for line in lines if "broker confirms again after" in line]
    assert (1, 1) == (len(starts), len(ends)), err[-3000:]
    assert "nacks of" in ends[0] and "probe" in ends[0]
    assert not [line for line in lines if "not published" in line], err[-3000:]
    assert "; 1 broker outage;" in err
    assert 0 == outbox_stats(db)["quarantined"]
    with contextlib.closing(outbox.open_db(db, readonly=True)) as conn:
        assert {0} == {r["failures"] for r in outbox.list_rows(conn, limit=0)}


def test_confirms_that_never_come_are_one_outage_probed_with_few_rows(ns: Namespace) -> None:
    """The broker takes the messages but its confirms never reach the dispatcher (as a queue without quorum
    keeps them): the confirms time out, the dispatcher reconnects and sends a 10-row probe each time, not
    whole batches; once confirms come through again every row is published, the queue holding each row at
    least once and no more copies than the first batches plus the probes; one outage logged and counted."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 200, articles=10)
    proxy = Proxy(ns.url)
    try:
        proxy("noconfirm")
        cmd = [sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(db), "--consumer", "catalog",
               "--batch", "50", "--depth", "2", "--lease", "4s", "--poll", "50ms"]
        proc = RunProcess(cmd, cwd=ns.workdir, env=ns.env(DELIVERY_AMQP_URL=proxy.url))
        ns.started.append(proc)
        try:
            proc.wait_for_log("retrying in")
            wait_until("two probes without a confirm", lambda: proxy.accepted() >= 3, procs=[proc])
            proxy("forward")
            wait_until("every row published", lambda: outbox_stats(str(db))["published"] == len(ids), procs=[proc])
            connections = proxy.accepted()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                kill(proc)
    finally:
        proxy.close()
    assert 0 == proc.returncode, err[-3000:]
    copies = queued_ids(ns)
    assert set(ids) == set(copies)
    # Before the outage: depth * batch rows whose confirms were lost; during it: one probe per connection.
    assert sum(copies.values()) - len(ids) <= 2 * 50 + 10 * (connections - 1), copies.most_common(3)
    assert 1 == sum("retrying in" in line for line in err.splitlines()), err[-3000:]
    assert 1 == sum("broker reachable again after" in line for line in err.splitlines()), err[-3000:]
    assert "; 1 broker outage;" in err
