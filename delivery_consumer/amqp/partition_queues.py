"""A partitioned consumer's queues on the broker: the partition count the broker
records, a layout that would apply events twice, and moving held messages to
their partition (``reroute``; the messages ``repartition`` finds stranded).

The slot arithmetic is :mod:`delivery_consumer.amqp.partitions` (no broker there).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from ..model.cloudevents import parse_message
from ..model.deliveries import OutMessage
from ..model.envelope import KOMBU_COMPRESSION_HEADER, MAX_BODY_BYTES
from ..model.errors import Rejection
from ..model.event_types import EventTypes
from ..model.faults import crashpoint
from .admin import QueueCount, queue_counts
from .dead_queue import HeldMessage, QueueBusy
from .mover import WindowReader
from .partitions import (
    SLOT_COUNT,
    partition_of,
    partition_of_slot,
    partition_topologies,
    partition_topology,
    route,
    slot_headers,
    slot_of,
    slots_exchange,
    unrouted_name,
)
from .publisher import Publisher
from .topology import H_ROUTING_KEY, Binding, Route, Topology


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


# -- moving messages by their key ---------------------------------------------------------

#: Messages a move takes from a queue at once (the reader's prefetch, and one batch of confirms).
MOVE_WINDOW = 1000
#: How many times repartition goes over queues of the former layout that received messages after
#: it had emptied them (retry copies whose delay ended, a publish routed just before the switch).
_PASSES = 3


def layout(base: Topology, count: int | None) -> list[Topology]:
    """The topologies of *base*'s consumer with *count* partitions (None: unpartitioned), each
    knowing the count (so that declaring them declares the count's marker too)."""
    return [base] if count is None else partition_topologies(base, count)


def describe(count: int | None) -> str:
    return "unpartitioned" if count is None else f"{count} partition" + ("" if count == 1 else "s")


@dataclass(frozen=True)
class Rerouted:
    """What :func:`reroute` did with one message."""

    event_id: str | None
    outcome: str  # "rerouted" | "would go to slot <s>" | "left: <why>"


@dataclass
class Moved:
    """What :func:`move_layout` did with the messages of the former layout's queues."""

    #: Copies now in a queue of the new layout, by queue.
    into: Counter[str] = field(default_factory=Counter)
    #: Dead letters already in their place (copied to the tail of their own queue).
    kept: int = 0
    #: Messages not moved: (eventId, why), in the queue they were in.
    left: list[tuple[str | None, str]] = field(default_factory=list)
    #: Queues of the former layout it could not delete: their state then.
    stuck: dict[str, QueueCount] = field(default_factory=dict)

    @property
    def moved(self) -> int:
        return sum(self.into.values())


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
    """A copy of *msg* (its body, properties and headers) for *exchange* / *routing_key*; the routing
    key it was published with stays in its ``x-original-routing-key`` header."""
    return OutMessage(routing_key=routing_key, body=msg.body, exchange=exchange, message_id=msg.message_id,
                      headers={H_ROUTING_KEY: msg.routing_key, **msg.headers, **headers},
                      content_type=msg.content_type or "application/json", content_encoding=msg.content_encoding)


@dataclass(frozen=True)
class _Source:
    """One queue of the former layout to empty into the new one."""

    queue: str
    #: The former partition's topology (the unpartitioned consumer's for its queues and the unrouted one).
    old: Topology
    dead: bool
    #: Also a queue of the new layout: only the messages it held when the events were switched to the
    #: new layout (*cutoff*) are moved, since it receives new ones meanwhile; it is never deleted.
    cutoff: int | None = None
    #: A main queue the new layout keeps: events of keys that were not its own under the former count
    #: reached it through the new bindings (while both were bound, or just after the switch). Their
    #: keys' older events are in other queues, so they wait, held, until every other queue is moved.
    defers: bool = False


class _Placer:
    """Where a message of the former layout goes in the new one: its key's partition -- the handover
    queue, or the dead queue for a dead letter; a body without a key to the first new partition the
    former one's slots go to (its run rejects it as usual)."""

    def __init__(self, base: Topology, old_count: int | None, new_count: int | None,
                 types: EventTypes | None) -> None:
        self.new = layout(base, new_count)
        self.old_count = old_count
        self.new_count = new_count
        self.types = types

    def _home(self, key: str | None, old: Topology) -> Topology:
        if self.new_count is None:
            return self.new[0]
        if key is not None:
            return self.new[partition_of(key, self.new_count)]
        slots = [s for s in range(SLOT_COUNT)
                 if old.partition is None or self.old_count is None
                 or partition_of_slot(s, self.old_count) == old.partition]
        return self.new[min(partition_of_slot(s, self.new_count) for s in slots)]

    def place(self, msg: HeldMessage, source: _Source) -> tuple[str | None, str, bool]:
        """``(eventId, target queue, whether it waits for every other queue)``."""
        event_id, key, _why = _key_of(msg, self.types)
        home = self._home(key, source.old)
        later = (source.defers and key is not None and self.old_count is not None
                 and partition_of(key, self.old_count) != source.old.partition)
        return event_id, home.dead_queue if source.dead else home.handover_queue, later


class _Mover:
    """Moves sources a window at a time: copies published (confirmed), then the originals acked.

    Acks are cumulative (``multiple``), one per window: a quorum queue turns each ack into a command
    of its own, and on RabbitMQ 3.10 a burst of them beyond its client's soft limit is held back in
    the channel and lost when the channel closes -- the messages then come back (seen: 100+ single
    acks in a row, then a close). A source that defers messages acks up to its first deferred one,
    and the rest, held by its reader, with one ack in :meth:`finish`."""

    def __init__(self, url: str, placer: _Placer, publisher: Publisher, moved: Moved, window: int,
                 readers: ExitStack) -> None:
        self.url, self.placer, self.publisher, self.moved, self.window = url, placer, publisher, moved, window
        self.readers = readers
        self.deferred: list[tuple[WindowReader, str, list[tuple[HeldMessage, str | None, str]]]] = []

    def _send(self, queue: str, placed: list[tuple[HeldMessage, str | None, str]]) -> bool:
        """Publish copies of *placed* (confirmed); False when one failed (named in :attr:`Moved.left`)."""
        results = self.publisher.publish([_copy(msg, "", target, {}) for msg, _e, target in placed])
        for (_msg, event_id, target), result in zip(placed, results, strict=True):
            if not result.ok:
                self.moved.left.append((event_id, f"in {queue}: copy to {target} {result.status}: {result.reason}"))
                return False
            if target == queue:
                self.moved.kept += 1
            else:
                self.moved.into[target] += 1
        return True

    def move(self, source: _Source) -> None:
        reader = WindowReader(self.url, source.queue, name=f"delivery-consumer repartition {source.old.consumer}")
        try:
            reader.open()
            later = self._move(reader, source)
        except BaseException:
            reader.close()
            raise
        if later:
            self.readers.callback(reader.close)
            self.deferred.append((reader, source.queue, later))
        else:
            reader.close()  # what was not acked returns to the head of the queue, in order

    def _move(self, reader: WindowReader, source: _Source) -> list[tuple[HeldMessage, str | None, str]]:
        remaining = source.cutoff
        later: list[tuple[HeldMessage, str | None, str]] = []
        while remaining is None or remaining > 0:
            limit = self.window if remaining is None else min(self.window, remaining)
            held = reader.take(limit)
            if not held:
                break
            now: list[tuple[HeldMessage, str | None, str]] = []
            acked = 0 if later else held[-1].tag  # once one is deferred, nothing is acked before finish()
            for msg in held:
                event_id, target, wait = self.placer.place(msg, source)
                if wait and not later:
                    acked = now[-1][0].tag if now else 0
                (later if wait else now).append((msg, event_id, target))
            if not self._send(source.queue, now):
                return []  # nothing of this window acked: it returns to the queue, in order
            crashpoint("repartition-copied")
            if acked:
                reader.ack_taken(acked)
            for waiting, _queue, _later in self.deferred:  # their heartbeats: they hold messages meanwhile
                waiting.flush()
            if remaining is not None:
                remaining -= len(held)
            if len(held) < limit:
                break
        return later

    def finish(self) -> None:
        """Move what the sources deferred, each source's in its order, after everything else; then ack
        everything those sources' readers took."""
        for reader, queue, later in self.deferred:
            if all(self._send(queue, later[start:start + self.window]) for start in range(0, len(later), self.window)):
                reader.ack_taken()


def _sources(base: Topology, old: int | None, new: int | None, *, relayout: bool, rerun: bool,
             states: Mapping[str, QueueCount | None]) -> list[_Source]:
    """The queues of the former layout *old* to empty, in the order they are emptied: per former
    partition its handover queue (what an earlier repartition left it is older than its queue's), its
    retry tiers, its queue, its dead queue; then the unrouted queue. The queues the new layout keeps
    only when *relayout* (the databases were just moved: what they hold was routed by the former
    count), and never, in a *rerun* of an interrupted repartition, a handover queue of the new layout
    (what it holds is placed already). *states*: the queues as the switch left them (the cutoffs)."""
    new_layout = layout(base, new)
    kept = {q for t in new_layout for q in (*(name for name, _ in t.queues()), t.handover_queue)}
    handovers = {t.handover_queue for t in new_layout}
    out: list[_Source] = []
    for topo in layout(base, old):
        tiers = list(dict.fromkeys(topo.retry_queue(i) for i in range(len(topo.retry_delays_ms))))
        for queue in (topo.handover_queue, *tiers, topo.queue, topo.dead_queue):
            state = states.get(queue)
            stays = queue in kept
            if state is None or (stays and not relayout) or (rerun and queue in handovers):
                continue
            out.append(_Source(queue, topo, queue == topo.dead_queue, state.ready if stays else None,
                               defers=stays and queue == topo.queue))
    unrouted = unrouted_name(base)
    waiting = states.get(unrouted)
    if waiting is not None and (relayout or new is None):
        out.append(_Source(unrouted, base, False, waiting.ready if new is not None else None))
    return out


def switch_layout(url: str, base: Topology, old: int | None, new: int | None) -> None:
    """Declare the layout *new* and route the consumer's events to it instead of *old*: the new
    queues (and their handover queues) first, then the new bindings, then the old ones removed, so
    that every event reaches at least one of the two layouts meanwhile (one reaching both is applied
    once: the second copy is a duplicate)."""
    from .admin import declare, delete_unused_queues, exchange_exists

    if old != new and old is not None:
        delete_unused_queues(url, [base.count_marker])  # it records the old count; empty, never consumed
    handovers = Route(queues=tuple((t.handover_queue, t.main_arguments()) for t in layout(base, new)))
    routes = [handovers]
    if new is not None:
        routes.append(route(base, new, previous=old))
        if old is None:  # its events now go through the slots only
            routes.append(Route(unbind=tuple(Binding(base.exchange, base.queue, key) for key in base.binding_keys)))
    elif exchange_exists(url, slots_exchange(base), name="delivery-consumer repartition"):  # gone: done before
        routes.append(Route(unbind=tuple(Binding(base.exchange, slots_exchange(base), key, to_exchange=True)
                                         for key in base.binding_keys)))
    declare(url, layout(base, new), routes=routes)


def move_layout(url: str, base: Topology, old: int | None, new: int | None, *, relayout: bool,
                types: EventTypes | None, rerun: bool = False, window: int = MOVE_WINDOW) -> Moved:
    """Right after :func:`switch_layout` routed the events to *new*: move what the queues of the
    former layout *old* hold to the new partitions by key -- main queues, retry tiers and handover
    queues into each key's handover queue, which its run applies before its own queue; dead letters
    to its dead queue -- then delete the queues the new layout does not have, and the handover queues
    that received nothing. *relayout*: the databases were just moved, so the queues both layouts
    share are emptied too, up to what they held at the switch; *rerun*: finishing an interrupted one;
    *types*: the consumer's event types (None: the default ones), to find each body's key.

    Per key the order is kept: one reader per queue takes its messages in order, each copy is
    confirmed before its original is acked, the events of a key that reached a queue both layouts
    share through the new bindings follow those of the queue the key had before, and a run reads
    its handover queue before anything published after the switch. A queue in use by a consumer is
    not touched: :attr:`Moved.left` or :attr:`Moved.stuck` names it.
    """
    from .admin import delete_exchanges, delete_unused_queues, queue_counts

    def delete_queue(queue: str) -> bool:
        return not delete_unused_queues(url, [queue])

    name = "delivery-consumer repartition"
    new_layout = layout(base, new)
    permanent = {q for t in new_layout for q, _ in t.queues()}
    handovers = {t.handover_queue for t in new_layout}
    unrouted = unrouted_name(base)
    watched = list(dict.fromkeys([*(q for t in layout(base, old) + new_layout
                                    for q in (*(n for n, _ in t.queues()), t.handover_queue)), unrouted]))
    moved = Moved()
    states = queue_counts(url, watched, name=name)  # the cutoffs: what the queues held at the switch
    with Publisher(url, name=name, window=window) as publisher, ExitStack() as readers:
        mover = _Mover(url, _Placer(base, old, new, types), publisher, moved, window, readers)

        def move(source: _Source) -> None:
            try:
                mover.move(source)
            except QueueBusy:
                if source.cutoff is not None:  # its messages would reach its run misplaced: not finished
                    moved.left.append((None, f"{source.queue} is in use by a consumer: its messages were not moved"))

        for source in _sources(base, old, new, relayout=relayout, rerun=rerun, states=states):
            move(source)
        mover.finish()
        obsolete = [s for s in _sources(base, old, new, relayout=True, rerun=True, states=states) if s.cutoff is None]
        for _ in range(_PASSES):  # what reached them after they were emptied (a retry copy's delay ended)
            obsolete = [s for s in obsolete if not delete_queue(s.queue)]
            if not obsolete or moved.left:
                break
            for source in obsolete:
                move(source)
    for queue, state in queue_counts(url, watched, name=name).items():
        if state is None or queue in permanent or (queue == unrouted and new is not None):
            continue
        if queue in handovers:
            if not state.ready and not state.consumers:
                delete_queue(queue)
            continue
        moved.stuck[queue] = state
    if new is None and unrouted not in moved.stuck:
        delete_exchanges(url, [slots_exchange(base), unrouted], name=name)
    return moved


def reroute(url: str, base: Topology, *, types: EventTypes | None, dry_run: bool = False,
            window: int = MOVE_WINDOW) -> list[Rerouted]:
    """Send every message of the consumer's unrouted queue back through its slot route.

    Each message's slot comes from its body's key (its type's key field); the copy goes to the
    consumer's slots exchange with the slot headers (mandatory, confirmed), and only then is the
    original removed. A body without a key stays in the queue (a copy of it goes to the queue's
    tail: a window is acked as a whole, see :class:`_Mover`); a copy that is not confirmed stops the
    command, that message and those after it left in place. The queue is read a window at a time by
    one exclusive reader (:class:`amqp.mover.WindowReader`): any number of messages. *types*: the
    consumer's event types (None: the default ones), to find each body's key.
    """
    done: list[Rerouted] = []
    name = f"delivery-consumer reroute {base.consumer}"
    queue_name = unrouted_name(base)
    with WindowReader(url, queue_name, name=name) as queue, Publisher(url, name=name) as publisher:
        total = queue.open()
        taken = 0
        while taken < total:
            held = queue.take(min(window, total - taken))
            if not held:
                break
            taken += len(held)
            sending: list[tuple[HeldMessage, Rerouted, OutMessage]] = []
            for msg in held:
                event_id, key, why = _key_of(msg, types)
                if dry_run:
                    slot = f"would go to slot {slot_of(key)}" if key is not None else f"left: {why}"
                    done.append(Rerouted(event_id, slot))
                elif key is None:
                    sending.append((msg, Rerouted(event_id, f"left: {why}"), _copy(msg, "", queue_name, {})))
                else:
                    sending.append((msg, Rerouted(event_id, "rerouted"),
                                    _copy(msg, slots_exchange(base), msg.routing_key, slot_headers(key))))
            if dry_run:
                continue
            acked, failed = 0, ""
            for (msg, outcome, _sent), result in zip(sending, publisher.publish([c for *_, c in sending]), strict=True):
                if failed or not result.ok:
                    failed = failed or f"{result.status} {result.reason}"
                    done.append(Rerouted(outcome.event_id, f"left: {failed}"))
                    continue
                done.append(outcome)
                acked = msg.tag
            if acked:
                queue.ack_taken(acked)
            if acked != held[-1].tag:
                break
    return done


__all__ = ["MOVE_WINDOW", "Moved", "Rerouted", "describe", "layout", "layout_conflict", "move_layout",
           "recorded_count", "reroute", "switch_layout"]
