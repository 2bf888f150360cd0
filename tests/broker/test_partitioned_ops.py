"""The operator's commands on a partitioned consumer: inspect, trace, dead, prune, metrics."""

from __future__ import annotations

import orjson
import pytest
from partitionkit import Cluster, make_events, wait_until
from support import count_rows, json_lines, read_rows
from test_broker_metrics import free_port, scrape

from delivery_consumer.amqp.partitions import partition_of
from delivery_consumer.model.contract import ConsumerSpec

pytestmark = pytest.mark.broker

PARTITIONS = 2


def test_inspect_trace_dead_prune_and_metrics_of_a_partitioned_consumer(cluster: Cluster) -> None:
    """catalog list merges the partitions, catalog show and trace find the article's partition, dead and
    prune work per partition (and refuse, in one line, without --partition), metrics carry the partition."""
    events = make_events(40, 8)
    # the last revision of an article again, with another state: a conflict, dead-lettered
    conflict = {**events[-1], "eventId": "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11",
                "data": {"title": "another title", "url": "https://example.org/x"}}
    home = partition_of(conflict["articleId"], PARTITIONS)
    port = free_port()
    runs = [cluster.start(k, *(["--metrics-port", str(port)] if k == home else [])) for k in range(PARTITIONS)]
    cluster.publish([*events, conflict])
    wait_until("every receipt", lambda: cluster.receipts() >= len(events), 120, runs)
    wait_until("the conflict dead-lettered", lambda: cluster.ns.count(
        f"{cluster.ns.prefix}.catalog.p{home}.dead") == 1, 60, runs)
    def conflict_counted() -> dict[str, float] | None:
        m = scrape(port)
        return m if any("revision-conflict" in k for k in m) else None

    m = wait_until("the conflict on /metrics", conflict_counted, 60, runs)
    assert m[f'delivery_dead_letters_total{{code="revision-conflict",consumer="catalog",partition="{home}"}}'] == 1
    cluster.stop()

    ns = cluster.ns
    listed = ns.cli("catalog", "list", "--consumer", "catalog", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = orjson.loads(listed.stdout)
    assert sorted(r["articleId"] for r in rows) == sorted({e["articleId"] for e in events})
    assert all(r["partition"] == partition_of(r["articleId"], PARTITIONS) for r in rows)

    shown = ns.cli("catalog", "show", "--consumer", "catalog", "--json", events[1]["articleId"])
    assert orjson.loads(shown.stdout)["partition"] == partition_of(events[1]["articleId"], PARTITIONS)

    traced = ns.cli("trace", "--consumer", "catalog", conflict["eventId"])
    assert traced.returncode == 0, traced.stderr
    assert f"catalog, partition {home} (" in traced.stdout and "revision-conflict" in traced.stdout
    unknown = ns.cli("trace", "--consumer", "catalog", "00000000-0000-4000-8000-000000000000")
    assert unknown.returncode == 1 and f"any of the {PARTITIONS} partitions" in unknown.stderr

    refused = ns.cli("dead", "list", "--consumer", "catalog")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "give --partition K" in refused.stderr
    dead = ns.cli("dead", "list", "--consumer", "catalog", "--partition", str(home), "--json")
    assert dead.returncode == 0, dead.stderr
    assert [m["eventId"] for m in orjson.loads(dead.stdout)["messages"]] == [conflict["eventId"]]
    requeue = ns.cli("dead", "requeue", "--consumer", "catalog", "--partition", str(home), "--all", "--dry-run")
    assert f"-> {ns.prefix}.catalog.p{home} " in requeue.stderr, requeue.stderr

    stats = ns.cli("inbox", "stats", "--consumer", "catalog", "--partition", str(home), "--json")
    assert json_lines(stats.stdout)[0]["consumer"] == "catalog"
    assert ns.cli("inbox", "prune", "--consumer", "catalog", "--older-than", "7d", "--dry-run").returncode == 2
    pruned = ns.cli("inbox", "prune", "--consumer", "catalog", "--partition", str(home), "--older-than", "7d",
                    "--dry-run")
    assert pruned.returncode == 0, pruned.stderr
    assert f"dead queue {ns.prefix}.catalog.p{home}.dead: 1 dead letter" in pruned.stdout


def test_the_outbox_dispatcher_routes_to_partitions(cluster: Cluster) -> None:
    """Events written to a producer's outbox and dispatched reach their article's partition (the
    dispatcher sends the slot header like publish), and the merged catalog equals the producer's."""
    from test_outbox_broker import dispatch
    from test_outbox_broker import make_events as produce_events

    db = cluster.ns.workdir / "producer.db"
    ids = produce_events(db, 60, articles=12)
    runs = [cluster.start(k) for k in range(PARTITIONS)]
    done = dispatch(cluster.ns, db, "--exit-when-idle", "1s")
    assert done.returncode == 0, done.stderr
    wait_until("every receipt", lambda: cluster.receipts() >= len(ids), 120, runs)
    cluster.stop()
    listed = orjson.loads(cluster.ns.cli("catalog", "list", "--consumer", "catalog", "--json").stdout)
    material = {a: (rev, title) for a, rev, title in read_rows(db, "material", "article_id, revision, title")}
    assert {r["articleId"]: (r["revision"], r["title"]) for r in listed} == material
    assert all(r["partition"] == partition_of(r["articleId"], PARTITIONS) for r in listed)



def test_consumers_with_different_counts_share_the_exchange(cluster: Cluster, counter: ConsumerSpec) -> None:
    """catalog in 2 partitions, audit in 3 and an unpartitioned consumer all bind the same exchange:
    each gets every event once, each partitioned one in the article's partition for its own count."""
    ns = cluster.ns
    audit = Cluster(ns, "audit", 3)
    audit.declare()
    try:
        # an unpartitioned consumer on the same exchange (the test-only counter, registered here by its
        # fixture; an unpartitioned catalog beside its own partitions is refused: test_partition_layout)
        from delivery_consumer.amqp.admin import declare

        declare(ns.url, [ns.topology(counter.name)])
        events = make_events(300, 30)
        runs = [cluster.start(k) for k in range(PARTITIONS)] + [audit.start(k) for k in range(3)]
        cluster.publish(events)
        plain = ns.run_until_idle("counter", idle=2, env=ns.env(DELIVERY_PLUGINS="counter_consumer"))
        assert plain.returncode == 0, plain.stderr
        wait_until("every receipt", lambda: cluster.receipts() >= len(events) and audit.receipts() >= len(events),
                   120, runs)
        assert cluster.check_exactly_once(events) == {"updated": len(events)}
        for k in range(3):
            keys = read_rows(audit.db(k), "inbox", "partition_key")
            assert keys and all(partition_of(key, 3) == k for (key,) in keys)
        assert audit.receipts() == len(events)
        assert count_rows(ns.db("counter"), "inbox") == len(events)
    finally:
        audit.stop()
        audit.delete()


def test_an_event_without_a_slot_waits_in_unrouted_until_rerouted(cluster: Cluster) -> None:
    """A message without the slot headers reaches no partition: it waits in <consumer>.unrouted (also
    when another consumer took it, so no return could tell), and reroute sends it to its article's
    partition."""
    from delivery_consumer.amqp.publisher import Publisher
    from delivery_consumer.model.deliveries import OutMessage

    ns = cluster.ns
    assert ns.cli("topology", "declare", "--consumer", "audit").returncode == 0
    event = make_events(1, 1)[0]
    with Publisher(ns.url, exchanges=[ns.exchange]) as pub:
        [result] = pub.publish([OutMessage("material.published", orjson.dumps(event), ns.exchange,
                                           event["eventId"])])
    assert result.ok  # audit took it: the broker returns nothing
    unrouted = f"{ns.prefix}.catalog.unrouted"
    wait_until("the message in unrouted", lambda: ns.count(unrouted) == 1, 30)
    moved = ns.cli("reroute", "--consumer", "catalog")  # back through the slot route, by its articleId
    assert moved.returncode == 0, moved.stderr
    assert moved.stdout.split() == ["rerouted", event["eventId"]]
    home = f"{ns.prefix}.catalog.p{partition_of(event['articleId'], PARTITIONS)}"
    wait_until("the message in its partition", lambda: ns.count(home) == 1, 30)
    assert ns.count(unrouted) == 0


def test_another_count_is_refused_by_the_broker(cluster: Cluster) -> None:
    """Declaring (or running) a partitioned consumer with another count than the broker records is
    refused in one line, exit 2, before anything is declared: no article can be bound to two partitions."""
    ns = cluster.ns
    declared = ns.cli("topology", "declare", "--consumer", "catalog", "--partitions", "4")
    assert declared.returncode == 2, declared.stderr
    assert declared.stderr.strip().splitlines() == [
        f"delivery-consumer: catalog is partitioned with another count on this broker (the queue "
        f"{ns.prefix}.catalog.partitions records it); change the count with repartition"]
    from delivery_consumer.amqp.admin import queue_counts

    assert queue_counts(ns.url, [f"{ns.prefix}.catalog.p3"]) == {f"{ns.prefix}.catalog.p3": None}
    assert ns.cli("topology", "declare", "--consumer", "catalog", "--partitions", str(PARTITIONS)).returncode == 0
    ran = ns.cli("run", "--consumer", "catalog", "--partition", "0", "--partitions", "4", "--db",
                 str(ns.workdir / "other.db"))
    assert ran.returncode == 2 and "partitioned with another count" in ran.stderr, ran.stderr


def test_an_event_of_another_partition_is_forwarded_in_order_and_status_names_it(cluster: Cluster) -> None:
    """Events whose producer sent another partition's slot headers reach the wrong partition's run: it
    forwards each, in the order they came, to its own partition, where all are applied `updated` (none
    `stale`); nothing is dead-lettered or rejected; trace says where each went; status names the
    partition that received them and why it happens."""
    from deploykit import dc, write_deployment

    from delivery_consumer.amqp.partitions import slot_headers
    from delivery_consumer.amqp.publisher import Publisher
    from delivery_consumer.model.deliveries import OutMessage

    ns = cluster.ns
    events = make_events(60, 6, seed=31)
    home = partition_of(events[0]["articleId"], PARTITIONS)
    stray = [e for e in events if e["articleId"] == events[0]["articleId"]]
    elsewhere = next(f"x-{i}" for i in range(100) if partition_of(f"x-{i}", PARTITIONS) != home)
    with Publisher(ns.url, exchanges=[ns.exchange]) as pub:
        results = pub.publish([OutMessage(e["type"], orjson.dumps(e), ns.exchange, e["eventId"], headers=slot_headers(
            elsewhere if e in stray else e["articleId"])) for e in events])
    assert all(r.ok for r in results)
    runs = [cluster.start(k) for k in range(PARTITIONS)]
    wait_until("every receipt", lambda: cluster.receipts() >= len(events), 120, runs)
    cluster.stop()
    assert cluster.check_exactly_once(events) == {"updated": len(events)}
    assert all(count_rows(cluster.db(k), "rejected") == 0 for k in range(PARTITIONS))
    assert [ns.count(ns.topology("catalog", partition=k).dead_queue) for k in range(PARTITIONS)] == [0] * PARTITIONS
    forwarded = read_rows(cluster.db(1 - home), "deliveries", "event_id, last_outcome")
    assert forwarded == sorted((e["eventId"], f"forwarded:p{home}") for e in stray)
    assert "forwarded to their partitions" in runs[1 - home].output()[1]

    traced = ns.cli("trace", "--consumer", "catalog", stray[-1]["eventId"])
    assert traced.returncode == 0, traced.stderr
    assert f"it belongs to partition p{home}: forwarded to it" in traced.stdout, traced.stdout
    config = write_deployment(ns.workdir, ns=ns, consumers=("catalog",), partitions={"catalog": PARTITIONS})
    shown = dc(config, "status", "--json")
    assert shown.returncode == 1, shown.stdout
    [problem] = orjson.loads(shown.stdout)["problems"]
    assert problem.startswith(f"catalog/p{1 - home}: {len(stray)} events of other partitions reached "
                              f"{ns.prefix}.catalog.p{1 - home} in the last hour"), problem
    assert "a producer computing another slot" in problem


def test_reroute_moves_more_than_a_quorum_queue_hands_one_reader(cluster: Cluster) -> None:
    """2,500 messages without slot headers wait in the unrouted queue (a quorum queue gives a reader without a
    prefetch limit 2,000 at most): reroute moves every one to its article's partition, in order per
    article."""
    from delivery_consumer.amqp.admin import queue_counts
    from delivery_consumer.amqp.publisher import Publisher
    from delivery_consumer.model.deliveries import OutMessage

    ns = cluster.ns
    events = make_events(2_500, 50, seed=37)
    with Publisher(ns.url, exchanges=[ns.exchange]) as pub:
        assert all(r.ok for r in pub.publish([OutMessage(e["type"], orjson.dumps(e), ns.exchange, e["eventId"])
                                              for e in events]))
    unrouted = f"{ns.prefix}.catalog.unrouted"
    wait_until("every message in unrouted", lambda: ns.count(unrouted) == len(events), 60)
    moved = ns.cli("reroute", "--consumer", "catalog")
    assert moved.returncode == 0, moved.stderr
    assert f"{len(events)} of {len(events)} messages from {unrouted} rerouted" in moved.stderr
    queues = [ns.topology("catalog", partition=k).queue for k in range(PARTITIONS)]
    states = queue_counts(ns.url, [unrouted, *queues])
    assert states[unrouted] is not None and states[unrouted].ready == 0
    assert sum(s.ready for q, s in states.items() if q in queues and s is not None) == len(events)
    runs = [cluster.start(k) for k in range(PARTITIONS)]
    wait_until("every receipt", lambda: cluster.receipts() >= len(events), 120, runs)
    cluster.stop()
    assert cluster.check_exactly_once(events) == {"updated": len(events)}
