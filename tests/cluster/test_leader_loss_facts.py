"""What RabbitMQ itself does to a client that fails over the moment a quorum queue's leader dies.

These tests pin the broker's behaviour that docs/cluster.md relies on ("What the
toolkit does when a node dies"), on the installed RabbitMQ: a client that reconnects
at once to another node may reach it before the queue's record names the new
leader, and a channel that publishes to the queue then keeps a stale view of it.
"""

from __future__ import annotations

from pathlib import Path

import pika
import pytest
from clusterkit import ClusterNamespace, RabbitCluster
from outboxkit import envelope
from support import wait_until

from delivery_consumer import outbox
from delivery_consumer.amqp.publisher import StreamPublisher


def _declare_led_by_first(cluster: RabbitCluster, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(cluster.nodes[0].url))
    try:  # declared through the first node: it leads the queue (the default leader locator, client-local)
        conn.channel().queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        conn.close()
    assert cluster.leader(queue) is cluster.nodes[0]


def _publish(channel: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> str:
    try:
        channel.basic_publish("", queue, b"x", mandatory=True)
    except pika.exceptions.NackError:
        return "nacked"
    except pika.exceptions.UnroutableError:
        return "unroutable"
    return "confirmed"


def test_a_channel_that_publishes_as_the_leader_dies_is_nacked_until_it_is_closed(
        rabbit_cluster: RabbitCluster, cluster_ns: ClusterNamespace) -> None:
    """Leader's node killed, a connection to another node opened at once and a publish sent on
    a new channel: that channel's publishes to the queue are nacked, and still are once a new
    leader was elected; another channel of the same connection has them confirmed. (RabbitMQ
    3.10.8; later releases look the leader up afresh: rabbitmq-server pull request 9241.) So a
    publisher that meets a nack storm right after a failover must publish on a new channel."""
    queue = f"{cluster_ns.prefix}.facts"
    _declare_led_by_first(rabbit_cluster, queue)
    rabbit_cluster.nodes[0].kill()
    conn = pika.BlockingConnection(pika.URLParameters(rabbit_cluster.nodes[1].url))
    try:
        first = conn.channel()
        first.confirm_delivery()
        at_once = _publish(first, queue)
        new_leader = rabbit_cluster.leader(queue)
        assert new_leader is not rabbit_cluster.nodes[0]
        later = _publish(first, queue)
        other = conn.channel()
        other.confirm_delivery()
        fresh = _publish(other, queue)
    finally:
        conn.close()
    if at_once == "confirmed":
        pytest.skip("this broker had the new leader before the first publish: the race was not met")
    assert (at_once, later, fresh) == ("nacked", "nacked", "confirmed")


def test_a_consumer_that_subscribes_as_the_leader_dies_gets_and_settles_the_messages(
        rabbit_cluster: RabbitCluster, cluster_ns: ClusterNamespace) -> None:
    """Leader's node killed with five messages in the queue, a consumer subscribed at once
    through another node: it gets the five and its acks settle them (the queue is empty), so a
    consuming channel needs no such care."""
    queue = f"{cluster_ns.prefix}.facts"
    _declare_led_by_first(rabbit_cluster, queue)
    conn = pika.BlockingConnection(pika.URLParameters(rabbit_cluster.nodes[0].url))
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", queue, str(i).encode())
    conn.close()
    rabbit_cluster.nodes[0].kill()
    conn = pika.BlockingConnection(pika.URLParameters(rabbit_cluster.nodes[1].url))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=10)
        got: list[bytes] = []

        def on_message(channel: object, method: pika.spec.Basic.Deliver, _props: object, body: bytes) -> None:
            got.append(body)
            ch.basic_ack(method.delivery_tag)

        ch.basic_consume(queue, on_message)
        wait_until("the five messages", lambda: conn.process_data_events(0.1) or len(got) >= 5, timeout=60)
        ch.cancel()
        counter = conn.channel()

        def settled() -> bool:
            return int(counter.queue_declare(queue, passive=True).method.message_count) == 0

        wait_until("the acks to settle the five messages", settled, timeout=30)
    finally:
        conn.close()
    assert got == [b"0", b"1", b"2", b"3", b"4"]


def test_dispatch_that_fails_over_as_the_leader_dies_publishes_every_row_without_a_restart(
        rabbit_cluster: RabbitCluster, cluster_ns: ClusterNamespace, tmp_path: Path) -> None:
    """The race above met by the outbox's dispatcher: leader's node killed, a dispatcher connected at
    once to another node publishes its rows to the queue. Whether its first publish meets the race
    or not, every row is published (the nacked ones wait on one outage, probed on a new channel of
    the same connection) within a few probe intervals, each once, in order, with no restart."""
    queue = f"{cluster_ns.prefix}.facts"
    _declare_led_by_first(rabbit_cluster, queue)
    db = outbox.connect(tmp_path / "producer.db")
    envs = [envelope("article-1", i + 1) for i in range(20)]
    with outbox.transaction(db):
        for env in envs:
            outbox.enqueue(db, env, routing_key=queue)
    rabbit_cluster.nodes[0].kill()
    with StreamPublisher(rabbit_cluster.nodes[1].url) as pub:
        d = outbox.Dispatcher(db, pub, outbox.DispatchConfig(exchange="", batch=5, wake=False))
        wait_until("every row published", lambda: d.step() >= 0 and outbox.unpublished(db) == 0, timeout=60,
                   interval=0.01)
    raced = d.stats.outages > 0
    print(f"\ndispatch met the race: {raced} (nacked {d.stats.results['nacked']})")
    conn = pika.BlockingConnection(pika.URLParameters(rabbit_cluster.nodes[1].url))
    try:
        ch = conn.channel()
        got = []
        while (got_one := ch.basic_get(queue, auto_ack=True))[0] is not None:
            got.append(got_one[1].message_id)
    finally:
        conn.close()
    ids = [env["eventId"] for env in envs]
    assert ids == list(dict.fromkeys(got))  # each once (a nacked copy the broker kept: a duplicate), in order
