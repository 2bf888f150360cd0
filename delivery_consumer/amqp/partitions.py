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

No broker here: what a partitioned consumer asks of the broker (the count it records, a
layout conflict, moving held messages to their partition) is :mod:`delivery_consumer.amqp.partition_queues`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..model.errors import FORWARDED, WRONG_PARTITION, ConfigError
from .topology import Binding, Route, Topology, upgrade_hint

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
    return upgrade_hint(error, base)


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


def forwarded_to(code: str | None, key: str | None, identity: Identity | None) -> int | None:
    """The partition ``run`` sends an event on to: its *key*'s, when the partition *identity* refused it
    as another partition's (rejection *code* ``wrong-partition``); None for any other outcome."""
    if identity is None or key is None or code != WRONG_PARTITION:
        return None
    return partition_of(key, identity.count)


def delivery_outcome(status: str, home: int | None) -> str:
    """What a delivery's record says: its outcome's *status*, or ``forwarded:p<home>``."""
    return status if home is None else f"{FORWARDED}:p{home}"


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
    "delivery_outcome",
    "explain",
    "forwarded_to",
    "identity_from_meta",
    "misplaced",
    "partition_of",
    "partition_of_slot",
    "partition_topologies",
    "partition_topology",
    "route",
    "slot_headers",
    "slot_key",
    "slot_of",
    "slots_exchange",
    "unrouted_name",
]
