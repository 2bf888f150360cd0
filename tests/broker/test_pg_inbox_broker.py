"""``run --db postgresql://...``: a consumer's inbox in PostgreSQL, fed by a real queue. The ledger stays
exact under kill -9 of run's main PID, with two runs of one consumer sharing the database, across a
restart of the PostgreSQL server (a private one: the shared server is never touched), and with a
partitioned consumer whose partitions each keep their inbox in a schema of one database."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, kill
from partitionkit import Cluster, make_events, model
from pgkit import PrivatePostgres, admin, with_database
from support import new_event, wait_until

from delivery_consumer.amqp.partitions import partition_of
from delivery_consumer.model.contract import ConsumerSpec

pytestmark = [pytest.mark.broker, pytest.mark.postgres]

CONSUMER = "counter"


@pytest.fixture(autouse=True)
def registered(counter: ConsumerSpec) -> ConsumerSpec:
    """The counter consumer registered in this process for each test (publish declares its queue by it);
    importing its module registers it only once per session, and another test may have unregistered it."""
    return counter


def stream(n: int, seed: int = 7) -> tuple[list[dict[str, Any]], list[bytes]]:
    """*n* distinct events over 50 articles, and the stream to publish: each once, a fifth twice, shuffled."""
    rng = random.Random(seed)
    events = [new_event(article_id=f"a-{i % 50}", revision=i // 50 + 1) for i in range(n)]
    bodies = [orjson.dumps(e) for e in events] + [orjson.dumps(e) for e in rng.sample(events, n // 5)]
    rng.shuffle(bodies)
    return events, bodies


def receipts(url: str) -> int:
    """Receipts in the counter's inbox (0 before it exists)."""
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        if conn.execute("SELECT to_regclass('dc_counter.inbox')").fetchone()[0] is None:
            return 0
        return int(conn.execute("SELECT count(*) FROM dc_counter.inbox").fetchone()[0])


def ledger(url: str) -> tuple[int, int, int, int, int]:
    """(receipts, events counted by the effect, rejections, deliveries tried twice or more, crashes)."""
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM dc_counter.inbox), (SELECT coalesce(sum(events), 0) FROM dc_counter.counter),"
            " (SELECT count(*) FROM dc_counter.rejected),"
            " (SELECT count(*) FROM dc_counter.deliveries WHERE attempts > 1),"
            " (SELECT coalesce(sum(crashes), 0) FROM dc_counter.deliveries)").fetchone()
    assert row is not None
    return (int(row[0]), int(row[1]), int(row[2]), int(row[3]), int(row[4]))


def consumers_of(ns: Namespace, queue: str) -> int:
    """Consumers attached to *queue* (0 when it does not exist yet)."""
    conn, ch = ns.channel()
    try:
        return int(ch.queue_declare(queue, passive=True).method.consumer_count)
    except Exception:  # not declared yet (the channel is closed by the broker)
        return 0
    finally:
        if conn.is_open:
            conn.close()


def drained(ns: Namespace) -> int:
    topo = ns.topology(CONSUMER)
    return ns.count(topo.queue) + ns.count(topo.dead_queue)


@pytest.fixture
def env(ns: Namespace) -> dict[str, str]:
    return ns.env(DELIVERY_PLUGINS="counter_consumer")


def test_kill_9_of_the_main_pid_then_a_restart_applies_each_event_once(ns: Namespace, pg_url: str,
                                                                      env: dict[str, str]) -> None:
    """Mid-stream, kill -9 of run's main PID alone: nothing of it is alive 5 s later; a restart on the same
    PostgreSQL inbox drains the queue, and each event has one receipt and was counted once. Neither run
    logs the URL's password."""
    events, bodies = stream(2000)
    ns.publish(bodies, declare=[CONSUMER])
    secret = pg_url.replace("postgres@", "postgres:s3cret@", 1)  # the test server trusts: any password does
    proc = ns.start_run(CONSUMER, "--db", secret, "--batch", "50", env=env)
    wait_until("the first receipts", lambda: receipts(pg_url) > 0, procs=[proc])
    kill(proc, main_only=True)
    assert receipts(pg_url) < len(events)
    done = ns.run_until_idle(CONSUMER, "--db", secret, "--log-level", "debug", env=env, idle=2)
    assert 0 == done.returncode, done.stderr
    assert "s3cret" not in done.stderr + done.stdout + proc.output()[1]  # the password is never logged
    received, counted, rejected, _retried, _crashes = ledger(pg_url)
    assert (len(events), len(events), 0) == (received, counted, rejected)
    assert 0 == drained(ns)


def test_two_runs_of_one_consumer_share_its_postgresql_inbox(ns: Namespace, pg_url: str,
                                                           env: dict[str, str]) -> None:
    """Two runs of the counter on one queue and one PostgreSQL inbox at once (redeliveries by the producer
    land on either): each event has one receipt and was counted once, nothing was rejected or retried."""
    events, bodies = stream(1500, seed=11)
    ns.publish([], declare=[CONSUMER])
    first = ns.start_run(CONSUMER, "--db", pg_url, "--batch", "20", "--exit-when-idle", "3", env=env)
    second = ns.start_run(CONSUMER, "--db", pg_url, "--batch", "20", "--exit-when-idle", "3", env=env)
    wait_until("both runs consuming", lambda: consumers_of(ns, ns.topology(CONSUMER).queue) == 2,
               procs=[first, second])
    ns.publish(bodies)
    for proc in (first, second):
        assert 0 == proc.until_idle(120).returncode
    assert (len(events), len(events), 0, 0) == ledger(pg_url)[:4]
    assert 0 == drained(ns)


@pytest.fixture
def private_url(private_pg: PrivatePostgres) -> Iterator[str]:
    """A database of this test's own on the private server (the one a test may restart)."""
    admin(private_pg.url, 'CREATE DATABASE "pg_inbox_restart"')
    try:
        yield with_database(private_pg.url, "pg_inbox_restart")
    finally:
        admin(private_pg.url, 'DROP DATABASE IF EXISTS "pg_inbox_restart" WITH (FORCE)')


def test_a_postgresql_restart_loses_nothing_and_spends_no_attempt(ns: Namespace, private_pg: PrivatePostgres,
                                                                 private_url: str, env: dict[str, str]) -> None:
    """The server restarts (a fast shutdown: connections ended mid-batch) while run consumes: run waits for
    it, holding its deliveries, and goes on; each event has one receipt, was counted once, nothing was
    rejected, dead-lettered or tried a second time."""
    events, bodies = stream(2000, seed=3)
    ns.publish(bodies, declare=[CONSUMER])
    proc = ns.start_run(CONSUMER, "--db", private_url, "--batch", "20", "--exit-when-idle", "3", env=env)
    wait_until("the first receipts", lambda: receipts(private_url) > 0, procs=[proc])
    private_pg.restart()
    done = proc.until_idle(180)
    assert 0 == done.returncode, done.stderr
    assert "database unusable" in done.stderr  # it did meet the restart
    assert (len(events), len(events), 0, 0, 0) == ledger(private_url)
    assert 0 == drained(ns)


#: The partitioned consumer's partitions (the ``cluster`` fixture of tests/partitionkit.py reads it).
PARTITIONS = 2


def test_partitions_on_postgresql_keep_each_key_in_order_in_its_own_schema(cluster: Cluster, pg_url: str) -> None:
    """The catalog in two partitions, each run's inbox a schema of one PostgreSQL database: each event is
    applied once, in the partition of its article (its own schema), in its article's order (every receipt
    ``updated``, none stale), and the merged catalog is the model's."""
    import psycopg

    events = make_events(3000, 300)
    for k in range(PARTITIONS):
        cluster.start(k, "--db", pg_url)

    def receipts_pg() -> int:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            return sum(int(conn.execute(f"SELECT count(*) FROM dc_catalog_p{k}of{PARTITIONS}.inbox").fetchone()[0])
                       for k in range(PARTITIONS)
                       if conn.execute(f"SELECT to_regclass('dc_catalog_p{k}of{PARTITIONS}.inbox')").fetchone()[0])

    cluster.publish(events)
    wait_until("every receipt", lambda: receipts_pg() >= len(events), 300, cluster.procs)
    cluster.stop()
    seen: dict[str, int] = {}
    catalog: dict[str, tuple[int, str, int]] = {}
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for k in range(PARTITIONS):
            schema = f"dc_catalog_p{k}of{PARTITIONS}"
            for event_id, result, key in conn.execute(f"SELECT event_id, result, partition_key FROM {schema}.inbox"):
                assert (event_id not in seen, "updated", k) == (True, result, partition_of(key, PARTITIONS))
                seen[event_id] = k
            for article, revision, title, published in conn.execute(
                    f"SELECT article_id, revision, title, published FROM {schema}.catalog"):
                assert article not in catalog and partition_of(article, PARTITIONS) == k
                catalog[article] = (revision, title, published)
    assert {e["eventId"] for e in events} == set(seen)
    assert model(events) == catalog
