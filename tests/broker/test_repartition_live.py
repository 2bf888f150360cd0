"""repartition with events waiting (20,000) and a producer that never stops -- growing, shrinking, to and from one
unpartitioned consumer -- with a ledger: every published event applied exactly once, in revision order per key,
nothing dead-lettered."""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orders_consumer  # noqa: F401  (registers the orders consumer in this process: its topology)
import pytest
from brokerkit import Namespace, RunProcess
from partitionkit import Cluster, LivePublisher, make_events, wait_until
from support import count_rows, read_rows

from delivery_consumer.amqp.admin import queue_counts
from delivery_consumer.amqp.partitions import partition_of
from delivery_consumer.amqp.topology import Topology

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
    publisher = LivePublisher(ns, keys=ARTICLES)
    yield cluster, publisher
    try:
        publisher.finish()
    finally:
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
    order, the catalog holds each article's last revision, nothing was dead-lettered or rejected, and no
    run received an event of another partition."""
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

    _check_ledger(cluster, events)


def _check_ledger(cluster: Cluster, events: list[dict[str, Any]]) -> None:
    """Every event one receipt in its article's partition, `updated`, in revision order per article; the
    catalog the model's; nothing rejected, dead-lettered or misplaced; no queue of a former layout left."""
    ns = cluster.ns
    results = cluster.check_exactly_once(events)
    assert results == {"updated": len(events)}, results
    revision = {e["eventId"]: e["revision"] for e in events}
    for k in range(cluster.count):
        seen: dict[str, int] = {}
        for _rowid, event_id, key in read_rows(cluster.db(k), "inbox", "rowid, event_id, partition_key"):
            assert revision[event_id] > seen.get(key, 0), f"{key}: revision {revision[event_id]} after {seen[key]}"
            seen[key] = revision[event_id]
        assert count_rows(cluster.db(k), "rejected") == 0
        assert count_rows(cluster.db(k), "deliveries", "last_outcome LIKE 'forwarded:%'") == 0  # none misplaced
    final = [ns.topology("catalog", partition=k) for k in range(cluster.count)]
    states = queue_counts(ns.url, [q for t in final for q in (t.queue, t.dead_queue)])
    assert {q: s.ready for q, s in states.items() if s is not None} == dict.fromkeys(states, 0)
    assert _left(ns, range(cluster.count, 4), handovers=range(4)) == []
    assert ns.count(f"{ns.prefix}.catalog.unrouted") == 0


@pytest.mark.broker
def test_repartition_killed_while_moving_is_finished_by_a_second_with_nothing_lost_or_out_of_order(
        live: tuple[Cluster, LivePublisher]) -> None:
    """2 -> 3 with 6,000 events waiting and the producer going on: repartition is killed (SIGKILL) right after
    the copies of its third window are confirmed, before their originals are acked. The runs refuse to
    start; a second repartition finishes; the ledger holds as above (the copies made twice are answered
    `duplicate`, never applied twice nor out of order)."""
    cluster, publisher = live
    ns = cluster.ns
    for k in range(cluster.count):
        cluster.start(k)
    publisher.rate = STEADY
    publisher.start()
    wait_until("the runs applying the producer's events", lambda: cluster.receipts() >= 500, 120, cluster.procs)
    cluster.stop()
    cluster.procs.clear()
    publisher.rate = None
    wait_until("6,000 events waiting", lambda: _waiting(cluster) >= 6_000, 300)
    publisher.rate = STEADY
    killed = ns.cli("repartition", "--consumer", "catalog", "--partitions", "3",
                    env=ns.env(DELIVERY_CRASH_AT="repartition-copied:3"), timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "crash point repartition-copied reached" in killed.stderr
    refused = ns.cli("run", "--consumer", "catalog", "--partition", "0", "--partitions", "3")
    assert refused.returncode == 2 and "has not finished" in refused.stderr, refused.stderr
    again = ns.cli("repartition", "--consumer", "catalog", "--partitions", "3", timeout=600)
    assert again.returncode == 0, again.stderr
    cluster.count = 3
    for k in range(cluster.count):
        cluster.start(k)
    wanted = len(publisher.confirmed) + 2 * STEADY
    wait_until("the producer publishing to the new runs", lambda: len(publisher.confirmed) >= wanted, 120,
               cluster.procs)
    events = publisher.finish()
    wait_until("every confirmed event applied", lambda: cluster.receipts() >= len(events), 600, cluster.procs)
    cluster.stop()
    cluster.procs.clear()
    _check_ledger(cluster, events)


# -- shrinking, and to and from one unpartitioned consumer, with the orders consumer's own types ----------

#: More than a quorum queue hands a reader without a prefetch limit (2,000): what stranded messages before.
SHRINK_WAITING = 3_000
ORDERS = 150


def _layout(ns: Namespace, count: int | None) -> list[Topology]:
    return [ns.topology("orders")] if count is None else [ns.topology("orders", partition=k) for k in range(count)]


def _dbs(ns: Namespace, count: int | None) -> list[Path]:
    root = ns.workdir / "state" / "orders"
    return [root / "inbox.db"] if count is None else [root / f"p{k}" / "inbox.db" for k in range(count)]


def _start(ns: Namespace, count: int | None) -> list[RunProcess]:
    """A run per partition (one for the unpartitioned consumer), each consuming."""
    procs = []
    for k in range(count or 1):
        where = [] if count is None else ["--partition", str(k), "--partitions", str(count)]
        proc = RunProcess([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "orders", *where],
                          cwd=ns.workdir, env=ns.env())
        ns.started.append(proc)
        procs.append(proc)
    for proc in procs:
        proc.wait_for_log("consuming ", timeout=120)
    return procs


def _stop(procs: list[RunProcess]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]


def _receipts(ns: Namespace, count: int | None) -> int:
    return sum(count_rows(path, "inbox") for path in _dbs(ns, count))


@pytest.fixture
def orders(ns: Namespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[LivePublisher]:
    """Every CLI process loads the orders consumer; a producer of order events, not started yet;
    afterwards it is stopped and every queue of the layouts a test goes through is deleted."""
    monkeypatch.setenv("DELIVERY_PLUGINS", "orders_consumer")
    publisher = LivePublisher(ns, keys=ORDERS, kind="order")
    yield publisher
    try:
        publisher.finish()
    finally:
        Cluster(ns, "orders", 4).delete()


@pytest.mark.broker
@pytest.mark.parametrize("counts", [(4, 2, 1), (None, 3, None)], ids=["4-2-1", "unpartitioned-3-unpartitioned"])
def test_shrinking_and_to_and_from_unpartitioned_strand_nothing_under_a_live_producer(
        ns: Namespace, orders: LivePublisher, counts: tuple[int | None, ...]) -> None:
    """The orders consumer (its own types, keyed by orderId) shrunk step by step, or split and merged back
    into one unpartitioned consumer, each time with the runs stopped, more than 2,000 events waiting in
    each layout and the producer going on: repartition finishes every time (exit 0) and leaves no queue of
    the former layout; in the end every confirmed event has exactly one receipt, `updated`, in revision
    order per order, the orders table holds each order's last revision, and nothing was rejected."""
    publisher = orders
    first, *steps = counts
    declared = ns.cli("topology", "declare", "--consumer", "orders",
                      *([] if first is None else ["--partitions", str(first)]))
    assert declared.returncode == 0, declared.stderr
    procs = _start(ns, first)
    publisher.rate = STEADY
    publisher.start()
    wait_until("the runs applying the producer's events", lambda: _receipts(ns, first) >= 500, 120, procs)
    current = first
    for target in steps:
        _stop(procs)
        publisher.rate = None
        queues = [t.queue for t in _layout(ns, current)]
        wait_until(f"{SHRINK_WAITING} events waiting", lambda q=queues: sum(  # type: ignore[misc]
            s.ready for s in queue_counts(ns.url, q).values() if s is not None) >= SHRINK_WAITING, 300)
        publisher.rate = STEADY
        done = ns.cli("repartition", "--consumer", "orders",
                      *(["--unpartitioned"] if target is None else ["--partitions", str(target)]), timeout=600)
        assert done.returncode == 0, done.stderr
        kept = {q for t in _layout(ns, target) for q in (*(n for n, _ in t.queues()), t.handover_queue)}
        former = [q for t in _layout(ns, current) for q in (*(n for n, _ in t.queues()), t.handover_queue)]
        former += [f"{ns.prefix}.orders.unrouted"] if target is None else []
        assert [q for q, s in queue_counts(ns.url, former).items() if s is not None and q not in kept] == []
        current = target
        procs = _start(ns, current)
        wanted = len(publisher.confirmed) + 2 * STEADY
        wait_until("the producer publishing to the new runs", lambda n=wanted: len(publisher.confirmed) >= n,  # type: ignore[misc]
                   120, procs)
    events = publisher.finish()
    wait_until("every confirmed event applied", lambda: _receipts(ns, current) >= len(events), 600, procs)
    _stop(procs)

    revision = {e["eventId"]: e["revision"] for e in events}
    last = {e["orderId"]: e for e in events}
    results: Counter[str] = Counter()
    table: dict[str, tuple[int, str, int]] = {}
    for k, path in enumerate(_dbs(ns, current)):
        seen: dict[str, int] = {}
        for _rowid, event_id, key, result in read_rows(path, "inbox", "rowid, event_id, partition_key, result"):
            assert current is None or partition_of(key, current) == k, f"{key} in p{k}"
            assert revision[event_id] > seen.get(key, 0), f"{key}: revision {revision[event_id]} after {seen[key]}"
            seen[key] = revision[event_id]
            results[result] += 1
        table.update({order: (rev, status, cents) for order, rev, status, cents in read_rows(
            path, "orders", "order_id, revision, status, total_cents")})
        assert count_rows(path, "rejected") == 0
        assert count_rows(path, "deliveries", "last_outcome LIKE 'forwarded:%'") == 0  # none reached a run misplaced
    assert results == {"updated": len(events)}, results
    assert sum(results.values()) == len(revision)  # one receipt per event: eventIds are unique in the inbox
    assert table == {o: (e["revision"], e["data"]["status"], e["data"]["totalCents"]) for o, e in last.items()}
    final = _layout(ns, current)
    states = queue_counts(ns.url, [q for t in final for q in (t.queue, t.dead_queue, t.handover_queue)])
    assert {q: s.ready for q, s in states.items() if s is not None} == {q: 0 for t in final
                                                                        for q in (t.queue, t.dead_queue)}


@pytest.mark.broker
def test_a_run_that_dies_while_applying_its_handover_queue_is_followed_by_one_that_finishes_it_first(
        live: tuple[Cluster, LivePublisher]) -> None:
    """2 -> 4 with 8,000 events waiting, then 2,000 newer ones published to the new queues before any run
    starts; partition 0's first run dies (SIGKILL) right after its second commit, inside its handover queue,
    nothing acked. The next run of partition 0 applies the rest of the handover queue before its queue: every
    event exactly once, `updated` (none `stale`), in revision order per article."""
    cluster, _publisher = live
    ns = cluster.ns
    events = make_events(10_000, ARTICLES, seed=43)
    early, late = events[:8_000], events[8_000:]
    for k in range(cluster.count):  # the databases
        cluster.start(k)
    cluster.stop()
    cluster.procs.clear()
    cluster.publish(early)
    done = ns.cli("repartition", "--consumer", "catalog", "--partitions", "4", timeout=600)
    assert done.returncode == 0, done.stderr
    cluster.count = 4
    cluster.publish(late)
    handover = ns.topology("catalog", partition=0).handover_queue
    assert ns.count(handover) > 500
    dying = RunProcess([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "catalog", "--partition", "0",
                        "--partitions", "4"], cwd=ns.workdir, env=ns.env(DELIVERY_CRASH_AT="after-commit:2"))
    ns.started.append(dying)
    _out, err = dying.communicate(timeout=120)
    assert dying.returncode == -signal.SIGKILL and "crash point after-commit reached" in err, err[-2000:]
    assert f"consuming {handover} first" in err
    assert ns.count(handover) > 0  # what it had not acked went back
    for k in range(cluster.count):
        cluster.start(k)
    wait_until("every event applied", lambda: cluster.receipts() >= len(events), 300, cluster.procs)
    cluster.stop()
    cluster.procs.clear()
    _check_ledger(cluster, events)
