"""``topology upgrade``: the classic dead queues and count marker of the previous release become quorum
queues, every dead letter kept with its headers and properties, in order; ``run`` against the old
topology says in one line what to run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pika
import pika.exceptions as pex
import pytest
from brokerkit import Namespace
from support import new_event

from delivery_consumer.amqp.partitions import partition_topologies
from delivery_consumer.amqp.topology import Topology


def old_release(ns: Namespace, topologies: list[Topology], marker_count: int | None = None) -> None:
    """Declare *topologies* as the previous release did: a classic dead queue (and a classic count
    marker), the other queues as now."""
    conn, ch = ns.channel()
    try:
        ch.exchange_declare(ns.exchange, exchange_type="topic", durable=True)
        if marker_count is not None:
            ch.queue_declare(topologies[0].count_marker, durable=True,
                             arguments={"x-queue-type": "classic", "x-max-length": marker_count})
        for topo in topologies:
            for queue, args in topo.queues():
                if queue == topo.count_marker:
                    continue
                ch.queue_declare(queue, durable=True,
                                 arguments={"x-queue-type": "classic"} if queue == topo.dead_queue else args)
            for key in topo.queue_binding_keys:
                ch.queue_bind(topo.queue, ns.exchange, key)
    finally:
        conn.close()


def put_dead(ns: Namespace, queue: str, n: int, tag: str) -> list[tuple[str, bytes, dict[str, Any]]]:
    """*n* dead letters in *queue*, with the headers run writes and a broker's x-death; (id, body, headers)."""
    out = []
    conn, ch = ns.channel()
    ch.confirm_delivery()
    try:
        for i in range(n):
            event = new_event(article_id=f"{tag}-{i}")
            body = orjson.dumps(event)
            headers: dict[str, Any] = {"x-error-code": "invalid-envelope", "x-error-reason": f"reason {tag} {i}",
                                       "x-attempts": 1, "x-original-routing-key": "material.published",
                                       "x-death": [{"queue": "q", "reason": "delivery_limit", "count": 1}]}
            ch.basic_publish("", queue, body, pika.BasicProperties(
                delivery_mode=2, message_id=event["eventId"], content_type="application/json", headers=headers,
                correlation_id=f"c-{i}"), mandatory=True)
            out.append((event["eventId"], body, headers))
    finally:
        conn.close()
    return out


def is_quorum(ns: Namespace, queue: str, args: dict[str, Any]) -> bool:
    conn, ch = ns.channel()
    try:
        ch.queue_declare(queue, durable=True, arguments=args)
        return True
    except pex.ChannelClosedByBroker:
        return False
    finally:
        if conn.is_open:
            conn.close()


def exists(ns: Namespace, queue: str) -> bool:
    conn, ch = ns.channel()
    try:
        ch.queue_declare(queue, passive=True)
        return True
    except pex.ChannelClosedByBroker:
        return False
    finally:
        if conn.is_open:
            conn.close()


def same_letters(ns: Namespace, queue: str, letters: list[tuple[str, bytes, dict[str, Any]]]) -> None:
    got = ns.drain(queue)
    assert [p.message_id for p, _ in got] == [mid for mid, _, _ in letters]
    for (props, body), (_mid, sent, headers) in zip(got, letters, strict=True):
        assert body == sent
        assert props.content_type == "application/json" and props.correlation_id is not None
        for key in ("x-error-code", "x-error-reason", "x-attempts", "x-original-routing-key"):
            assert props.headers[key] == headers[key]
        assert props.headers["x-death"][0]["reason"] in ("delivery_limit", b"delivery_limit")


@pytest.fixture
def cleanup(ns: Namespace) -> Iterator[list[str]]:
    """Queues the test declares beyond the namespace's own, deleted afterwards."""
    extra: list[str] = []
    yield extra
    conn, ch = ns.channel()
    try:
        for queue in extra:
            ch.queue_delete(queue)
    finally:
        conn.close()


def test_upgrade_moves_every_dead_letter_and_run_works_after(ns: Namespace, cleanup: list[str]) -> None:
    """A classic dead queue with dead letters: run refuses in one line naming the upgrade; the upgrade
    leaves a quorum dead queue holding every dead letter (body, headers, properties, order); run works;
    a second upgrade changes nothing."""
    topo = ns.topology("catalog")
    cleanup.append(f"{topo.dead_queue}.upgrade")
    old_release(ns, [topo])
    letters = put_dead(ns, topo.dead_queue, 30, "old")

    refused = ns.run_until_idle("catalog", idle=1)
    assert refused.returncode == 2, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert f"{topo.dead_queue} is a classic queue" in last
    assert f"delivery-consumer topology upgrade --consumer catalog --queue-prefix {ns.prefix}" in last

    done = ns.cli("topology", "upgrade", "--consumer", "catalog")
    assert done.returncode == 0, done.stderr
    assert f"{topo.dead_queue}: upgraded, 30 dead letters moved" in done.stdout
    assert is_quorum(ns, topo.dead_queue, topo.dead_arguments())
    assert not exists(ns, f"{topo.dead_queue}.upgrade")
    assert ns.count(topo.dead_queue) == 30

    ns.publish([orjson.dumps(new_event(article_id="after-upgrade"))])
    ran = ns.run_until_idle("catalog", idle=1)
    assert ran.returncode == 0, ran.stderr
    assert ns.count(topo.queue) == 0

    again = ns.cli("topology", "upgrade", "--consumer", "catalog")
    assert again.returncode == 0, again.stderr
    assert f"{topo.dead_queue}: quorum already" in again.stdout
    same_letters(ns, topo.dead_queue, letters)


def test_an_interrupted_upgrade_finishes_when_run_again(ns: Namespace, cleanup: list[str]) -> None:
    """A crash midway left dead letters both in the parking queue and in the classic dead queue: the
    next upgrade brings both back, none lost, the parked (older) ones first."""
    topo = ns.topology("catalog")
    parking = f"{topo.dead_queue}.upgrade"
    cleanup.append(parking)
    old_release(ns, [topo])
    conn, ch = ns.channel()
    ch.queue_declare(parking, durable=True, arguments=topo.dead_arguments())
    conn.close()
    parked = put_dead(ns, parking, 5, "parked")
    left = put_dead(ns, topo.dead_queue, 5, "left")

    done = ns.cli("topology", "upgrade", "--consumer", "catalog")
    assert done.returncode == 0, done.stderr
    assert not exists(ns, parking)
    same_letters(ns, topo.dead_queue, parked + left)


def test_upgrade_of_a_partitioned_consumer(ns: Namespace, cleanup: list[str]) -> None:
    """A partitioned consumer of the previous release (classic marker, classic dead queues): the
    upgrade finds its count on the broker, makes the marker and every dead queue quorum queues, and
    a declare of another count is still refused."""
    base = ns.topology("catalog")
    parts = partition_topologies(base, 2)
    cleanup.extend([base.count_marker, *(q for t in parts for q, _ in t.queues()),
                    *(f"{t.dead_queue}.upgrade" for t in parts)])
    old_release(ns, parts, marker_count=2)
    letters = put_dead(ns, parts[1].dead_queue, 3, "p1")

    done = ns.cli("topology", "upgrade", "--consumer", "catalog")
    assert done.returncode == 0, done.stderr
    assert f"{base.count_marker}: upgraded" in done.stdout
    assert is_quorum(ns, base.count_marker, base.marker_arguments(2))
    assert all(is_quorum(ns, t.dead_queue, t.dead_arguments()) for t in parts)
    other = ns.cli("topology", "declare", "--consumer", "catalog", "--partitions", "3")
    assert other.returncode == 2 and "partitioned with another count" in other.stderr
    same_letters(ns, parts[1].dead_queue, letters)
