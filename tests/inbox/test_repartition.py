"""Changing a partitioned consumer's count, 4 -> 8 -> 2, with a ledger before and after."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace, RunProcess
from partitionkit import Cluster, make_events, wait_until
from support import count_rows, read_rows

from delivery_consumer import consumers
from delivery_consumer.amqp.partitions import Identity, partition_of
from delivery_consumer.ops.partition_databases import split_merge
from delivery_consumer.store.placement import stored_identity

ARTICLES = 300


def ledger(cluster: Cluster) -> tuple[dict[str, tuple[str, str]], dict[str, tuple[int, str]]]:
    """Every receipt (eventId -> result, key) and catalog row (article -> revision, title), all partitions."""
    receipts: dict[str, tuple[str, str]] = {}
    catalog: dict[str, tuple[int, str]] = {}
    for k in range(cluster.count):
        for event_id, result, key in read_rows(cluster.db(k), "inbox", "event_id, result, partition_key"):
            assert event_id not in receipts
            receipts[event_id] = (result, key)
        for article, revision, title in read_rows(cluster.db(k), "catalog", "article_id, revision, title"):
            catalog[article] = (revision, title)
    return receipts, catalog


def consume(cluster: Cluster, events: list[dict[str, object]], expected: int) -> None:
    for k in range(cluster.count):
        cluster.start(k)
    cluster.publish(events)
    wait_until("every receipt", lambda: cluster.receipts() >= expected, 300, cluster.procs)
    cluster.stop()
    cluster.procs.clear()


@pytest.fixture
def cluster(ns: Namespace) -> Iterator[Cluster]:
    c = Cluster(ns, "catalog", 4)
    c.declare()
    yield c
    c.stop()
    c.delete(counts=(8,))


@pytest.mark.broker
def test_repartition_4_8_2_keeps_the_ledger(cluster: Cluster) -> None:
    """4 -> 8 -> 2: refused while a run holds a queue; afterwards every receipt and catalog row is in
    its new partition, the ledger is unchanged, redelivered old events are duplicates, and new
    revisions apply as `updated`."""
    events = make_events(6 * ARTICLES, ARTICLES)
    first, second, third = events[: 2 * ARTICLES], events[2 * ARTICLES: 4 * ARTICLES], events[4 * ARTICLES:]
    consume(cluster, first, len(first))
    before = ledger(cluster)

    holder = cluster.start(2)
    refused = cluster.ns.cli("repartition", "--consumer", "catalog", "--partitions", "8")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "refused: stop every run of catalog first; still consumed: " in refused.stderr
    os.kill(holder.pid, signal.SIGTERM)
    holder.communicate(timeout=60)
    cluster.procs.clear()

    for count, batch, done in ((8, second, first), (2, third, first + second)):
        moved = cluster.ns.cli("repartition", "--consumer", "catalog", "--partitions", str(count))
        assert moved.returncode == 0, moved.stderr
        cluster.count = count
        assert ledger(cluster) == before
        for k in range(count):
            assert stored_identity(cluster.db(k)) == Identity(k, count)
            keys = read_rows(cluster.db(k), "inbox", "DISTINCT partition_key")
            assert all(partition_of(key, count) == k for (key,) in keys)
        again = cluster.ns.cli("repartition", "--consumer", "catalog", "--partitions", str(count))
        assert again.returncode == 0, again.stderr  # idempotent
        consume(cluster, done[:ARTICLES] + batch, len(done) + len(batch))  # old events again: duplicates
        results = cluster.check_exactly_once(done + batch)
        assert results == {"updated": len(done) + len(batch)}
        before = ledger(cluster)
    assert not (cluster.ns.workdir / "state" / "catalog" / "p2").exists()


def test_split_merge_moves_keyless_rows_and_refuses_nothing(tmp_path: Path) -> None:
    """Rows without a key (a rejection of an unparseable body, a receipt from before keys were stored)
    land in a partition the old one's slots go to; a keyless receipt is kept in each of them."""
    root = tmp_path / "state"
    for k in range(2):
        with consumers.open_db(root / "catalog" / f"p{k}" / "inbox.db", "catalog", create=True,
                             partition=Identity(k, 2)) as db:
            db.conn.execute("INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at)"
                            f" VALUES ('old-{k}', 'f', 'updated', 'material.published', 'now')")
            db.conn.execute("INSERT INTO rejected (code, reason, rejected_at) VALUES ('malformed-json', 'x', 'now')")
    moved = split_merge("catalog", 4, root)
    assert moved.old_count == 2 and moved.backup is not None and moved.backup.is_dir()
    receipts = {k: {r[0] for r in read_rows(root / "catalog" / f"p{k}" / "inbox.db", "inbox", "event_id")}
                for k in range(4)}
    assert receipts == {0: {"old-0"}, 1: {"old-1"}, 2: {"old-0"}, 3: {"old-1"}}
    rejected = [count_rows(root / "catalog" / f"p{k}" / "inbox.db", "rejected")
                for k in range(4)]
    assert rejected == [1, 1, 0, 0]


def test_a_fence_not_yet_renamed_follows_its_entity_key(tmp_path: Path) -> None:
    """A webhook database whose fence still keeps the key in ``article_id`` (its first schema) is split:
    each fence row goes to its key's partition, under the column's new name ``entity_key``."""
    import dataclasses

    from delivery_consumer.consumers.webhook import SPEC
    from delivery_consumer.inbox import ConsumerDB, fence

    root = tmp_path / "state"
    old = ConsumerDB.open(root / "webhook" / "inbox.db", dataclasses.replace(SPEC, migrations=(fence.MIGRATION,)),
                          create=True)
    with old.conn:
        for n, key in enumerate(("a-1", "a-2", "a-3", "a-4")):
            old.conn.execute(
                "INSERT INTO fence (article_id, step, revision, key, event_id, payload_sha256, state, claimed_at)"
                f" VALUES (?, 'notify', 1, ?, 'e-{n}', 'sha', 'done', 't0')", (key, f"{key}:1:notify"))
    old.close()
    split_merge("webhook", 2, root)
    placed = {k: read_rows(root / "webhook" / f"p{k}" / "inbox.db", "fence", "entity_key") for k in range(2)}
    assert all(placed.values())
    assert {k: sorted(key for key in ("a-1", "a-2", "a-3", "a-4") if partition_of(key, 2) == k)
            for k in range(2)} == {k: sorted(r[0] for r in rows) for k, rows in placed.items()}


@pytest.fixture
def undeclared(ns: Namespace) -> Iterator[Cluster]:
    """A cluster whose partitions are not declared yet."""
    c = Cluster(ns, "catalog", 4)
    yield c
    c.stop()
    c.delete()


@pytest.mark.broker
def test_an_unpartitioned_consumer_is_split(undeclared: Cluster) -> None:
    """A consumer that outgrew one run: its drained queue and database become 4 partitions (the old queue
    is deleted), its ledger is unchanged, and it goes on with old events as duplicates and new ones `updated`."""
    cluster = undeclared
    ns = cluster.ns
    events = make_events(4 * ARTICLES, ARTICLES)
    first, second = events[: 2 * ARTICLES], events[2 * ARTICLES:]
    plain_db = ns.workdir / "state" / "catalog" / "inbox.db"
    assert ns.cli("topology", "declare", "--consumer", "catalog").returncode == 0
    cluster.publish(first)
    done = ns.cli("run", "--consumer", "catalog", "--exit-when-idle", "1.5")
    assert done.returncode == 0, done.stderr
    before = {r[0]: r[1] for r in read_rows(plain_db, "inbox", "event_id, result")}
    assert len(before) == len(first)

    moved = ns.cli("repartition", "--consumer", "catalog", "--partitions", "4")
    assert moved.returncode == 0, moved.stderr
    assert not plain_db.exists()
    from delivery_consumer.amqp.admin import queue_counts

    assert queue_counts(ns.url, [f"{ns.prefix}.catalog"]) == {f"{ns.prefix}.catalog": None}
    after = {r[0]: r[1] for k in range(4) for r in read_rows(cluster.db(k), "inbox", "event_id, result")}
    assert after == before
    consume(cluster, first[:ARTICLES] + second, len(events))
    assert cluster.check_exactly_once(events) == {"updated": len(events)}


def _repartition_paused(ns: Namespace, count: int) -> RunProcess:
    """``repartition`` started and stopped at its pause point: databases moved, the broker not yet switched."""
    proc = RunProcess([sys.executable, "-m", "delivery_consumer", "repartition", "--consumer", "catalog",
                       "--partitions", str(count)], cwd=ns.workdir,
                      env=ns.env(DELIVERY_PAUSE_AT="repartition-before-switch"))
    ns.started.append(proc)
    proc.wait_for_log("pause point repartition-before-switch reached", timeout=120)
    return proc


def _apply_everything(cluster: Cluster, events: list[dict[str, object]]) -> None:
    """Run every partition until each event has a receipt or a rejection somewhere, then stop."""
    for k in range(cluster.count):
        cluster.start(k)
    settled = lambda: sum(count_rows(cluster.db(k), t) for k in range(cluster.count)  # noqa: E731
                          for t in ("inbox", "rejected")) >= len(events)
    wait_until("every event settled", settled, 300, cluster.procs)
    cluster.stop()
    cluster.procs.clear()


@pytest.mark.broker
@pytest.mark.parametrize("count", [8, 2])
def test_events_published_in_repartitions_window_are_moved_not_stranded(cluster: Cluster, count: int) -> None:
    """Events published after repartition's emptiness check and before its switch are moved to their new
    partitions: it exits 0, no queue of the old count is left, and every event is applied exactly once."""
    ns = cluster.ns
    events = make_events(4 * ARTICLES, ARTICLES, seed=11)
    before, window = events[: 2 * ARTICLES], events[2 * ARTICLES:]
    consume(cluster, before, len(before))

    paused = _repartition_paused(ns, count)
    cluster.publish(window)  # confirmed: every one is in a queue of the old count now
    os.kill(paused.pid, signal.SIGCONT)
    _out, err = paused.communicate(timeout=300)
    assert paused.returncode == 0, err
    assert f"{len(window)} messages of the former layout moved to their partitions by key" in err, err

    from delivery_consumer.amqp.admin import queue_counts

    gone = [q for k in range(count, 4) for q, _ in ns.topology("catalog", partition=k).queues()]
    assert set(queue_counts(ns.url, gone).values()) <= {None}
    cluster.count = count
    _apply_everything(cluster, events)
    assert cluster.check_exactly_once(events) == {"updated": len(events)}
    dead = [ns.topology("catalog", partition=k).dead_queue for k in range(count)]
    assert {q: s.ready for q, s in queue_counts(ns.url, dead).items() if s is not None} == dict.fromkeys(dead, 0)


@pytest.mark.broker
def test_status_reports_a_message_in_a_queue_of_the_former_count_and_repartition_moves_it(
        cluster: Cluster, tmp_path: Path) -> None:
    """After 4 -> 2, a message in a queue of the former 4 partitions makes status red with the fix
    (repartition again), and running it again moves the message to its article's partition (its
    handover queue, which status shows waiting for that partition's run)."""
    from deploykit import dc, write_deployment

    from delivery_consumer.amqp.admin import declare
    from delivery_consumer.amqp.publisher import Publisher
    from delivery_consumer.model.deliveries import OutMessage

    ns = cluster.ns
    assert ns.workdir == tmp_path
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",), partitions={"catalog": 2})
    events = make_events(40, 20, seed=5)
    consume(cluster, events[:20], 20)
    moved = dc(config, "repartition", "--consumer", "catalog", "--partitions", "2")
    assert moved.returncode == 0, moved.stderr
    cluster.count = 2
    healthy = dc(config, "status", "--json")
    assert healthy.returncode == 0, healthy.stdout

    stray = events[20]
    old_p3 = ns.topology("catalog", partition=3)
    declare(ns.url, [old_p3])  # what an old run of p3, say, re-creates
    with Publisher(ns.url) as pub:
        assert all(r.ok for r in pub.publish([OutMessage(old_p3.queue, orjson.dumps(stray), "", stray["eventId"])]))
    shown = dc(config, "status", "--json")
    assert shown.returncode == 1
    problems = orjson.loads(shown.stdout)["problems"]
    assert problems == [f"catalog: 1 message in {old_p3.queue}, a queue of its former 4 partitions, not of its 2 "
                        "partitions: nothing consumes it; delivery-consumer repartition --consumer catalog "
                        "--partitions 2 moves them to their partitions"], problems

    again = dc(config, "repartition", "--consumer", "catalog", "--partitions", "2")
    assert again.returncode == 0, again.stderr
    assert "1 message of the former layout moved to their partitions by key" in again.stderr, again.stderr
    home = ns.topology("catalog", partition=partition_of(str(stray["articleId"]), 2))
    assert ns.count(home.handover_queue) == 1
    after = orjson.loads(dc(config, "status", "--json").stdout)["problems"]
    assert after == [f"catalog/p{home.partition}: 1 message waits in {home.handover_queue} (moved there by "
                     "repartition, applied first) and no consumer is connected"], after


@pytest.mark.broker
def test_an_unpartitioned_consumers_window_is_moved_and_its_queue_unbound(undeclared: Cluster) -> None:
    """Splitting an unpartitioned consumer: events published in the window are moved from its old queue to the
    partitions, the old queue is deleted, and events published after the switch reach the partitions only."""
    cluster = undeclared
    ns = cluster.ns
    events = make_events(6 * 50, 50, seed=13)
    before, window, after = events[:100], events[100:200], events[200:]
    assert ns.cli("topology", "declare", "--consumer", "catalog").returncode == 0
    cluster.publish(before)
    done = ns.cli("run", "--consumer", "catalog", "--exit-when-idle", "1.5")
    assert done.returncode == 0, done.stderr

    paused = _repartition_paused(ns, 4)
    cluster.publish(window)
    os.kill(paused.pid, signal.SIGCONT)
    _out, err = paused.communicate(timeout=300)
    assert paused.returncode == 0, err
    assert f"{len(window)} messages of the former layout moved to their partitions by key" in err, err
    from delivery_consumer.amqp.admin import queue_counts

    assert queue_counts(ns.url, [f"{ns.prefix}.catalog"]) == {f"{ns.prefix}.catalog": None}
    cluster.publish(after)
    _apply_everything(cluster, events)
    assert cluster.check_exactly_once(events) == {"updated": len(events)}


@pytest.mark.broker
def test_a_publisher_that_goes_on_across_repartitions_switch_loses_and_doubles_nothing(cluster: Cluster) -> None:
    """A publisher started inside repartition's window and still publishing across the switch (4 -> 8): every
    event ends with exactly one receipt in its new partition, `updated` (none `stale`: an article's events
    moved from the old queues are applied before those routed after the switch), and the catalog holds each
    article's last revision."""
    ns = cluster.ns
    events = make_events(6 * ARTICLES, ARTICLES, seed=17)
    before, stream = events[: ARTICLES], events[ARTICLES:]
    consume(cluster, before, len(before))

    paused = _repartition_paused(ns, 8)
    publisher = cluster.publish_async(stream)
    old_queues = [ns.topology("catalog", partition=k).queue for k in range(4)]
    wait_until("the stream reaching the old queues", lambda: sum(ns.count(q) for q in old_queues) > 0, 120)
    os.kill(paused.pid, signal.SIGCONT)
    _out, err = paused.communicate(timeout=300)
    assert paused.returncode == 0, err
    _pout, perr = publisher.communicate(timeout=300)
    assert publisher.returncode == 0, perr

    cluster.count = 8
    _apply_everything(cluster, events)
    results = cluster.check_exactly_once(events)
    assert results == {"updated": len(events)}, results


@pytest.mark.broker
def test_an_old_queue_it_cannot_delete_is_named_and_a_second_run_finishes(cluster: Cluster) -> None:
    """4 -> 2 while something consumes an old partition's dead queue: repartition does not report success, it
    names the queue and what to do (exit 2, one line); run again once that consumer is gone, it finishes."""
    ns = cluster.ns
    consume(cluster, make_events(40, 20, seed=19), 40)
    paused = _repartition_paused(ns, 2)
    holder, channel = ns.channel()
    old_dead = ns.topology("catalog", partition=3).dead_queue
    try:
        channel.basic_consume(old_dead, lambda *_: None)
        os.kill(paused.pid, signal.SIGCONT)
        _out, err = paused.communicate(timeout=300)
    finally:
        holder.close()
    assert paused.returncode == 2, err
    line = err.strip().splitlines()[-1]
    assert f"{old_dead} (0 messages, 1 consumer)" in line and "--partitions 2 again" in line, err
    again = ns.cli("repartition", "--consumer", "catalog", "--partitions", "2")
    assert again.returncode == 0, again.stderr
    from delivery_consumer.amqp.admin import queue_counts

    assert queue_counts(ns.url, [old_dead]) == {old_dead: None}


@pytest.mark.broker
def test_an_interrupted_repartition_is_refused_by_run_named_by_status_and_finished_by_a_second(
        cluster: Cluster) -> None:
    """repartition killed after it moved the databases, before it switched the queues (events published
    meanwhile wait in the old ones): run refuses the new databases in one line naming the command that
    finishes, status says the repartition has not finished, and a second repartition finishes it -- every
    event applied once in its new partition, `updated`."""
    from deploykit import dc, write_deployment

    ns = cluster.ns
    events = make_events(4 * ARTICLES, ARTICLES, seed=41)
    before, meanwhile = events[: 2 * ARTICLES], events[2 * ARTICLES:]
    consume(cluster, before, len(before))
    paused = _repartition_paused(ns, 3)
    cluster.publish(meanwhile)
    paused.kill()
    paused.communicate(timeout=60)

    refused = ns.cli("run", "--consumer", "catalog", "--partition", "0", "--partitions", "3")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert ("the repartition of catalog to 3 partitions has not finished (its queues are not switched yet)"
            in refused.stderr
            and "delivery-consumer repartition --consumer catalog --partitions 3 again" in refused.stderr)
    config = write_deployment(ns.workdir, ns=ns, consumers=("catalog",), partitions={"catalog": 3})
    shown = dc(config, "status", "--json")
    assert shown.returncode == 1
    problems = orjson.loads(shown.stdout)["problems"]
    assert any(p.startswith("catalog: its repartition to 3 partitions has not finished") for p in problems), problems

    again = ns.cli("repartition", "--consumer", "catalog", "--partitions", "3")
    assert again.returncode == 0, again.stderr
    assert f"{len(meanwhile)} messages of the former layout moved" in again.stderr, again.stderr
    cluster.count = 3
    _apply_everything(cluster, events)
    assert cluster.check_exactly_once(events) == {"updated": len(events)}
    assert orjson.loads(dc(config, "status", "--json").stdout)["problems"] == []
