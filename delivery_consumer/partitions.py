"""Partitioned consumers: one consumer spread over a fixed set of partitions.

Each partition has its own queues (``<prefix>.<consumer>.p<k>``, a quorum
queue with a single active consumer) and its own database
(``state/<consumer>/p<k>/inbox.db``); an article always lives in the same
partition, so its events stay in order and its state in one file.

The routing contract (docs/partitions.md says why it is not the
consistent-hash exchange):

* the **publisher** computes the article's *slot* -- the first 8 bytes of
  SHA-256 of the UTF-8 ``articleId``, read as a big-endian unsigned integer,
  modulo :data:`SLOT_COUNT` -- and sends two headers: ``delivery-slot-<s>``
  = ``"1"`` (what the broker routes on) and ``delivery-slot`` = ``"<s>"``
  (for people). It knows nothing of partitions;
* each partitioned **consumer** has a headers exchange
  ``<prefix>.<consumer>.slots``, bound to the events exchange with the
  consumer's binding keys, and binds each partition ``k`` once, with
  ``x-match: any`` over the headers of its slots (``s mod count == k``).
  One binding per partition, not per slot: the broker tries every binding
  of a headers exchange for every message, so fewer bindings cost it less
  (bench/bench_partitions.py measures it). A message matching no
  binding goes to the exchange's alternate exchange and waits in
  ``<prefix>.<consumer>.unrouted``: never dropped.

No pika here: the broker calls go through :mod:`delivery_consumer.amqp`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .errors import ConfigError
from .topology import Binding, Route, Topology

#: Slots of the hash space. Fixed forever: changing it moves every article.
#: Also the largest partition count.
SLOT_COUNT = 256
#: The header that carries an event's slot (a decimal string, "0".."255");
#: the broker routes on the header named ``<SLOT_HEADER>-<slot>`` (value "1").
SLOT_HEADER = "delivery-slot"


def slot_of(article_id: str) -> int:
    """The slot of *article_id*: SHA-256 of its UTF-8 bytes, first 8 bytes
    as a big-endian unsigned integer, modulo :data:`SLOT_COUNT`."""
    digest = hashlib.sha256(article_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % SLOT_COUNT


def partition_of_slot(slot: int, count: int) -> int:
    """The partition that serves *slot* among *count* partitions."""
    return slot % count


def partition_of(article_id: str, count: int) -> int:
    """The partition of *article_id* among *count* partitions."""
    return partition_of_slot(slot_of(article_id), count)


def slot_key(slot: int) -> str:
    """The header (and binding argument) a message of *slot* is routed on."""
    return f"{SLOT_HEADER}-{slot}"


def slot_headers(article_id: str) -> dict[str, Any]:
    """The headers a publisher adds to an event of *article_id*."""
    slot = slot_of(article_id)
    return {SLOT_HEADER: str(slot), slot_key(slot): "1"}


def check_count(count: int) -> int:
    """*count* if it is a valid partition count, else ConfigError."""
    if not 1 <= count <= SLOT_COUNT:
        raise ConfigError(f"partition count {count} is out of range (1 .. {SLOT_COUNT})")
    return count


def check_partition(partition: int, count: int) -> int:
    """*partition* if it is one of *count* partitions, else ConfigError."""
    check_count(count)
    if not 0 <= partition < count:
        raise ConfigError(f"partition {partition} does not exist among {count} (0 .. {count - 1})")
    return partition


# -- names -----------------------------------------------------------------------------


def slots_exchange(topology: Topology) -> str:
    return f"{topology.prefix}.{topology.consumer}.slots"


def unrouted_name(topology: Topology) -> str:
    """The alternate exchange (fanout) and queue of messages no slot binding matched."""
    return f"{topology.prefix}.{topology.consumer}.unrouted"


def partition_topology(base: Topology, partition: int, count: int | None = None) -> Topology:
    """The queues of one partition of the consumer described by *base*
    (with *count*, also the marker queue that records the count)."""
    return replace(base, partition=partition, partition_count=count)


def partition_topologies(base: Topology, count: int) -> list[Topology]:
    check_count(count)
    return [partition_topology(base, k, count) for k in range(count)]


def explain(error: str, base: Topology) -> str:
    """*error* in the operator's words when it is the count marker refusing another count."""
    if "x-max-length" in error and f"'{base.prefix}.{base.consumer}.partitions'" in error:
        return (f"{base.consumer} is partitioned with another count on this broker (the queue "
                f"{base.prefix}.{base.consumer}.partitions records it); change the count with repartition")
    return error


def recorded_count(url: str, base: Topology) -> int | None:
    """The partition count the broker records for the consumer of *base*, or None when its marker
    queue does not exist (nothing declared it partitioned yet).

    The marker's ``x-max-length`` cannot be read back over AMQP, so the count is the number of
    partition queues ``.p0``, ``.p1``, ... that exist in a row; the run that uses it declares
    the marker with that count, which the broker refuses (406) if the marker says otherwise.
    """
    from .amqp.admin import queue_counts

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
    from .amqp.admin import queue_counts

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


def _partition_binding(base: Topology, partition: int, count: int) -> Binding:
    """Partition *partition*'s binding: any header of its slots."""
    args: dict[str, Any] = {"x-match": "any"}
    args.update({slot_key(s): "1" for s in range(SLOT_COUNT) if partition_of_slot(s, count) == partition})
    return Binding(slots_exchange(base), partition_topology(base, partition).queue, "", args)


def route(base: Topology, count: int, *, previous: int | None = None) -> Route:
    """The slot routing of a consumer with *count* partitions.

    With *previous* (a former count), the bindings of that count which the
    new one does not have are removed -- after the new ones are added, so a
    slot is never without a partition; declare this only while publishers
    are stopped (docs/partitions.md: drain, then switch).
    """
    check_count(count)
    unrouted = unrouted_name(base)
    exchanges: tuple[tuple[str, str, dict[str, Any]], ...] = (
        (unrouted, "fanout", {}),
        (slots_exchange(base), "headers", {"alternate-exchange": unrouted}),
    )
    bind = [Binding(unrouted, unrouted)]
    bind += [Binding(base.exchange, slots_exchange(base), key, to_exchange=True) for key in base.binding_keys]
    wanted = [_partition_binding(base, k, count) for k in range(count)]
    bind += wanted
    unbind: list[Binding] = []
    if previous is not None and previous != count:
        unbind = [b for b in (_partition_binding(base, k, previous) for k in range(previous)) if b not in wanted]
    return Route(exchanges=exchanges, queues=((unrouted, {"x-queue-type": "quorum"}),), bind=tuple(bind),
                 unbind=tuple(unbind))


@dataclass(frozen=True)
class Rerouted:
    """What :func:`reroute` (or :func:`move_stranded`) did with one message."""

    event_id: str | None
    outcome: str  # "rerouted" | "moved to <queue>" | "stays" | "left: <why>"


def _types_of(base: Topology) -> Any:
    """The event types of *base*'s consumer (None: the default ones), to find each body's key."""
    from .consumers import find

    spec = find(base.consumer)
    return spec.event_types if spec is not None else None


def _key_of(msg: Any, types: Any) -> tuple[str | None, str | None, str | None]:
    """``(eventId, partition key, why there is none)`` of a held message, from its body."""
    from .cloudevents import parse_message
    from .envelope import KOMBU_COMPRESSION_HEADER, MAX_BODY_BYTES
    from .errors import Rejection

    try:
        env = parse_message(msg.body, max_bytes=max(len(msg.body) + 1, MAX_BODY_BYTES),
                            content_type=msg.content_type, headers=msg.headers, content_encoding=msg.content_encoding,
                            compression=msg.headers.get(KOMBU_COMPRESSION_HEADER), types=types)
    except Rejection as rej:
        return rej.event_id or msg.message_id, None, rej.code
    return env.event_id, env.key, None


def _copy(msg: Any, exchange: str, routing_key: str, headers: Mapping[str, Any]) -> Any:
    from .amqp.publisher import OutMessage

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
    from .amqp.dead_queue import DeadQueue  # (amqp imports pika)
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
    from .amqp.dead_queue import DeadQueue

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


@dataclass(frozen=True)
class Identity:
    """What a partition database records about itself."""

    partition: int
    count: int

    def describe(self) -> str:
        return f"partition {self.partition} of {self.count}"


def misplaced(key: str, identity: Identity, field: str = "articleId") -> str | None:
    """Why an event of *key* (the value of its type's key *field*) cannot be applied in the
    partition *identity*, or None when it belongs there."""
    home = partition_of(key, identity.count)
    if home == identity.partition:
        return None
    return f"{field} belongs to partition {home} of {identity.count}, this database is partition {identity.partition}"


def identity_from_meta(meta: Mapping[str, str]) -> Identity | None:
    """The partition identity recorded in a database's meta table, if any."""
    if "partition" not in meta:
        return None
    return Identity(int(meta["partition"]), int(meta["partition_count"]))


__all__ = [
    "SLOT_COUNT",
    "SLOT_HEADER",
    "Identity",
    "check_count",
    "check_partition",
    "explain",
    "identity_from_meta",
    "layout_conflict",
    "misplaced",
    "move_stranded",
    "partition_of",
    "partition_of_slot",
    "partition_topologies",
    "partition_topology",
    "recorded_count",
    "reroute",
    "route",
    "slot_headers",
    "slot_key",
    "slot_of",
    "slots_exchange",
    "unrouted_name",
]
