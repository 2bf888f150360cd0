"""repartition with 20,000 events waiting and a producer that never stops, growing then shrinking, with a
ledger: every published event applied exactly once, in revision order per article, nothing dead-lettered."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest
from brokerkit import Namespace
from partitionkit import Cluster, LivePublisher, wait_until
from support import count_rows, read_rows

from delivery_consumer.amqp.admin import queue_counts

#: Events waiting in the partition queues when repartition starts.
WAITING = 20_000
ARTICLES = 400
#: Events per second the producer publishes while repartition and the new runs work.
STEADY = 400


@pytest.fixture
def live(ns: Namespace) -> Iterator[tuple[Cluster, LivePublisher]]:
    """The catalog in 2 partitions, declared, and a producer not started yet; afterwards both stopped and
    the broker objects of every count the test goes through deleted."""
    cluster = Cluster(ns, "catalog", 2)
    cluster.declare()
    publisher = LivePublisher(ns, articles=ARTICLES)
    yield cluster, publisher
    publisher.finish()
    cluster.stop()
    cluster.delete(counts=(4,))


def _waiting(cluster: Cluster) -> int:
    names = [cluster.ns.topology("catalog", partition=k).queue for k in range(cluster.count)]
    return sum(state.ready for state in queue_counts(cluster.ns.url, names).values() if state is not None)


def _left(ns: Namespace, gone: range, handovers: range = range(0)) -> list[str]:
    """The queues of partitions *gone* and the handover queues of *handovers* that still exist."""
    names = [q for k in gone for q, _ in ns.topology("catalog", partition=k).queues()]
    names += [ns.topology("catalog", partition=k).handover_queue for k in handovers]
    return [q for q, state in queue_counts(ns.url, names).items() if state is not None]


@pytest.mark.broker
def test_repartition_with_20000_waiting_under_a_live_producer_keeps_every_article_in_order(
        live: tuple[Cluster, LivePublisher]) -> None:
    """2 -> 4 -> 3 while a producer goes on publishing: each time the runs are stopped until 20,000 events
    wait in the partition queues, repartition finishes (exit 0, nothing left in a queue of the former
    layout), the new runs start. In the end every confirmed event has exactly one receipt, in its
    article's partition, answered `updated` (none `stale`: each was the newest of its article when
    published, so none was applied after a newer one), the receipts of each article are in revision
    order, the catalog holds each article's last revision, and nothing was dead-lettered or rejected."""
    cluster, publisher = live
    ns = cluster.ns
    for k in range(cluster.count):
        cluster.start(k)
    publisher.rate = STEADY
    publisher.start()
    wait_until("the runs applying the producer's events", lambda: cluster.receipts() >= 1_000, 120, cluster.procs)
    took = {}
    for count in (4, 3):
        cluster.stop()  # SIGTERM, the producer going on
        cluster.procs.clear()
        publisher.rate = None
        wait_until(f"{WAITING} events waiting", lambda: _waiting(cluster) >= WAITING, 300)
        publisher.rate = STEADY
        before = len(publisher.confirmed)
        started = time.monotonic()
        done = ns.cli("repartition", "--consumer", "catalog", "--partitions", str(count), timeout=900)
        took[f"{cluster.count}->{count}"] = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        assert len(publisher.confirmed) > before, "the producer did not publish during repartition"
        assert "moved to their partitions by key" in done.stderr, done.stderr
        assert _left(ns, range(count, cluster.count)) == []
        cluster.count = count
        for k in range(count):
            cluster.start(k)
        wanted = len(publisher.confirmed) + 2 * STEADY
        wait_until("the producer publishing to the new runs", lambda n=wanted: len(publisher.confirmed) >= n,  # type: ignore[misc]
                   120, cluster.procs)
    events = publisher.finish()
    wait_until("every confirmed event applied", lambda: cluster.receipts() >= len(events), 600, cluster.procs)
    cluster.stop()
    cluster.procs.clear()
    sys.stdout.write(f"repartition with {WAITING} waiting: " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items())
                     + f"; {len(events)} events\n")

    results = cluster.check_exactly_once(events)
    assert results == {"updated": len(events)}, results
    revision = {e["eventId"]: e["revision"] for e in events}
    for k in range(cluster.count):
        seen: dict[str, int] = {}
        for _rowid, event_id, key in read_rows(cluster.db(k), "inbox", "rowid, event_id, partition_key"):
            assert revision[event_id] > seen.get(key, 0), f"{key}: revision {revision[event_id]} after {seen[key]}"
            seen[key] = revision[event_id]
        assert count_rows(cluster.db(k), "rejected") == 0
    final = [ns.topology("catalog", partition=k) for k in range(cluster.count)]
    states = queue_counts(ns.url, [q for t in final for q in (t.queue, t.dead_queue)])
    assert {q: s.ready for q, s in states.items() if s is not None} == dict.fromkeys(states, 0)
    assert _left(ns, range(cluster.count, 4), handovers=range(4)) == []
    assert ns.count(f"{ns.prefix}.catalog.unrouted") == 0
