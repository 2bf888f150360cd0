"""A partitioned consumer's queues on the broker: the partition count the broker
records, a layout that would apply events twice, and moving held messages to
their partition (``reroute``; the messages ``repartition`` finds stranded).

The slot arithmetic is :mod:`delivery_consumer.partitions` (no broker there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .amqp.admin import queue_counts
from .amqp.dead_queue import DeadQueue, HeldMessage
from .cloudevents import parse_message
from .consumers import find
from .deliveries import OutMessage
from .envelope import KOMBU_COMPRESSION_HEADER, MAX_BODY_BYTES
from .errors import Rejection
from .event_types import EventTypes
from .partitions import (
    SLOT_COUNT,
    check_count,
    partition_of,
    partition_of_slot,
    partition_topology,
    slot_headers,
    slot_of,
    slots_exchange,
    unrouted_name,
)
from .topology import Topology


def recorded_count(url: str, base: Topology) -> int | None:
    """The partition count the broker records for the consumer of *base*, or None when its marker
    queue does not exist (nothing declared it partitioned yet).

    The marker's ``x-max-length`` cannot be read back over AMQP, so the count is the number of
    partition queues ``.p0``, ``.p1``, ... that exist in a row; the run that uses it declares
    the marker with that count, which the broker refuses (406) if the marker says otherwise.
    """
    name = "delivery-consumer run"
    if queue_counts(url, [base.count_marker], name=name).get(base.count_marker) is None:
        return None
    count, step = 0, 8
    while count < SLOT_COUNT:
        names = [partition_topology(base, k).queue for k in range(count, min(count + step, SLOT_COUNT))]
        found = queue_counts(url, names, name=name)
        present = next((i for i, q in enumerate(names) if found.get(q) is None), len(names))
        count += present
        if present < len(names):
            break
        step *= 2
    return count or None


def layout_conflict(url: str, base: Topology, count: int | None) -> str | None:
    """Why declaring *base* with *count* partitions (None: unpartitioned) would apply its events twice:
    the broker already holds the other layout of the consumer (its unpartitioned queue, or the marker
    queue of its partitions). None when it does not."""
    other = base.queue if count is not None else base.count_marker
    if queue_counts(url, [other], name="delivery-consumer topology").get(other) is None:
        return None
    if count is not None:
        return (f"{base.consumer} has an unpartitioned queue {other}: its partitions beside it would apply every "
                f"event twice; split it with delivery-consumer repartition --consumer {base.consumer} "
                f"--partitions {count}")
    return (f"{base.consumer} is partitioned on this broker ({other} records the count): its unpartitioned queue "
            "beside the partitions would apply every event twice; give --partitions N, or change the count "
            "with repartition")


@dataclass(frozen=True)
class Rerouted:
    """What :func:`reroute` (or :func:`move_stranded`) did with one message."""

    event_id: str | None
    outcome: str  # "rerouted" | "moved to <queue>" | "stays" | "left: <why>"


def _types_of(base: Topology) -> EventTypes | None:
    """The event types of *base*'s consumer (None: the default ones), to find each body's key."""
    spec = find(base.consumer)
    return spec.event_types if spec is not None else None


def _key_of(msg: HeldMessage, types: EventTypes | None) -> tuple[str | None, str | None, str | None]:
    """``(eventId, partition key, why there is none)`` of a held message, from its body."""
    try:
        env = parse_message(msg.body, max_bytes=max(len(msg.body) + 1, MAX_BODY_BYTES),
                            content_type=msg.content_type, headers=msg.headers, content_encoding=msg.content_encoding,
                            compression=msg.headers.get(KOMBU_COMPRESSION_HEADER), types=types)
    except Rejection as rej:
        return rej.event_id or msg.message_id, None, rej.code
    return env.event_id, env.key, None


def _copy(msg: HeldMessage, exchange: str, routing_key: str, headers: Mapping[str, Any]) -> OutMessage:
    return OutMessage(routing_key=routing_key, body=msg.body, exchange=exchange, message_id=msg.message_id,
                      headers={**msg.headers, **headers}, content_type=msg.content_type or "application/json",
                      content_encoding=msg.content_encoding)


def reroute(url: str, base: Topology, *, dry_run: bool = False) -> list[Rerouted]:
    """Send every message of the consumer's unrouted queue back through its slot route.

    Each message's slot comes from its body's key (its type's key field); the copy goes to
    the consumer's slots exchange with the slot headers (mandatory, confirmed),
    and only then is the original removed. A body that does not parse, or a
    copy that is not confirmed, stays in the queue. The queue is held by one
    exclusive reader meanwhile (see amqp.dead_queue.DeadQueue).
    """
    types = _types_of(base)

    done: list[Rerouted] = []
    with DeadQueue(url, unrouted_name(base), name=f"delivery-consumer reroute {base.consumer}") as queue:
        queue.open()
        for msg in queue.read():
            event_id, key, why = _key_of(msg, types)
            if key is None:
                done.append(Rerouted(event_id, f"left: {why}"))
                continue
            if dry_run:
                done.append(Rerouted(event_id, f"would go to slot {slot_of(key)}"))
                continue
            result = queue.publish(_copy(msg, slots_exchange(base), msg.routing_key, slot_headers(key)))
            if not result.ok:
                done.append(Rerouted(event_id, f"left: {result.status} {result.reason}"))
                continue
            queue.ack(msg.tag)
            done.append(Rerouted(event_id, "rerouted"))
        queue.flush()
    return done


def move_stranded(url: str, base: Topology, queue_name: str, count: int, *, old: int | None, old_count: int,
                  dead: bool = False) -> list[Rerouted]:
    """Move each message of *queue_name* -- a queue of old partition *old* of
    *old_count* (None: of the unpartitioned consumer) -- to where *count*
    partitions put its key, once the slot route of *count* is declared.

    What ``repartition`` does with what arrived in its window: a message of a
    main queue or retry tier goes through the slots exchange with its key's
    slot headers (as :func:`reroute` does), a dead letter to its new
    partition's dead queue; a message without a key (a body that does not
    parse) to the first new partition that the old one's slots go to, where
    it is rejected as usual. A message already in its place stays. Each copy is
    confirmed before the original is removed.
    """
    check_count(count)
    types = _types_of(base)
    keyless = min(partition_of_slot(s, count) for s in range(SLOT_COUNT)
                  if old is None or partition_of_slot(s, old_count) == old)
    done: list[Rerouted] = []
    with DeadQueue(url, queue_name, name=f"delivery-consumer repartition {base.consumer}") as queue:
        queue.open()
        for msg in queue.read():
            event_id, key, _why = _key_of(msg, types)
            home = partition_topology(base, partition_of(key, count) if key is not None else keyless)
            target = home.dead_queue if dead else home.queue
            if target == queue_name:
                done.append(Rerouted(event_id, "stays"))
                continue
            if key is not None and not dead:
                copy = _copy(msg, slots_exchange(base), msg.routing_key, slot_headers(key))
            else:
                copy = _copy(msg, "", target, {})
            result = queue.publish(copy)
            if not result.ok:
                done.append(Rerouted(event_id, f"left: {result.status} {result.reason}"))
                continue
            queue.ack(msg.tag)
            done.append(Rerouted(event_id, f"moved to {target}"))
        queue.flush()
    return done


__all__ = ["Rerouted", "layout_conflict", "move_stranded", "recorded_count", "reroute"]
