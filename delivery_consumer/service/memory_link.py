"""``run``'s connection in memory: the worker without RabbitMQ.

:class:`MemoryQueues` keeps a consumer's queues as the broker would (main
queue, retry tiers that give a copy back when its delay has passed, dead
queue, the main queue's delivery limit); :class:`MemoryLink` is one
connection to them: the worker's :class:`~.worker.WorkerIO`, in the worker's
own thread. Acks are recorded, copies confirmed -- or refused on request --
and the channel is lost on request, so that ``run``'s behaviour (retries,
dead letters, poison, outages, ack after commit) can be checked in
milliseconds; docs/run.md, "Without a broker".

Time on the retry tiers is virtual: when nothing else is ready, the copy due
first is given back at once. Nothing here imports pika.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..amqp.topology import H_DELIVERY_COUNT, Topology, topic_matches
from ..model.deliveries import Delivery, OutMessage
from ..model.errors import BrokerUnavailable
from .messages import Ack, PublishCopies, Reconnect, Shutdown, ToConnection

if TYPE_CHECKING:
    from .worker import Worker


@dataclass(slots=True)
class Held:
    """A message in a queue: its content, and how often it was given back unacked."""

    message: OutMessage
    redelivered: bool = False
    returns: int = 0


class MemoryQueues:
    """A consumer's queues (:class:`~delivery_consumer.amqp.topology.Topology`) held in memory.

    Any thread may publish; :meth:`take`, :meth:`give_back` and :meth:`drained` are
    for a link, which holds :attr:`changed` (a reentrant lock) while it calls them.
    """

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        #: Retry tier queue -> its delay (ms); each connection declares its own tiers.
        self.tiers: dict[str, int] = {}
        self.ready: deque[Held] = deque()
        #: Copies on a retry tier: (due on the virtual clock in ms, order, copy).
        self.delayed: list[tuple[float, int, Held]] = []
        self.dead: list[OutMessage] = []
        self.clock_ms = 0.0
        self._order = 0
        self._generations = 0
        #: Guards everything here; notified when a message arrives or a channel is to be dropped.
        self.changed = threading.Condition()
        self.declare(topology)

    def declare(self, topology: Topology) -> None:
        """Declare *topology*'s retry tiers too (``run`` declares its queues at each connect)."""
        with self.changed:
            self.tiers.update({topology.retry_queue(tier): ms for tier, ms in enumerate(topology.retry_delays_ms)})

    def publish(self, message: OutMessage, *, redelivered: bool = False) -> bool:
        """Route *message* (mandatory): False when no queue takes it. *redelivered*: it
        reaches the main queue as a message given back unacked (the broker's flag set)."""
        topo = self.topology
        with self.changed:
            if message.exchange == topo.exchange and any(
                    topic_matches(key, message.routing_key) for key in topo.queue_binding_keys):
                self.ready.append(Held(message, redelivered))
            elif message.exchange != "":
                return False
            elif message.routing_key == topo.queue:
                self.ready.append(Held(message, redelivered))
            elif message.routing_key == topo.dead_queue:
                self.dead.append(message)
            elif message.routing_key in self.tiers:
                self._order += 1
                heapq.heappush(self.delayed, (self.clock_ms + self.tiers[message.routing_key], self._order,
                                              Held(message)))
            else:
                return False
            self.changed.notify_all()
            return True

    def take(self) -> Held | None:
        """The next ready message, if any (the clock jumps to the first copy due when none is ready)."""
        if not self.ready and self.delayed:
            due, _, _ = self.delayed[0]
            self.clock_ms = max(self.clock_ms, due)
            while self.delayed and self.delayed[0][0] <= self.clock_ms:
                _, _, held = heapq.heappop(self.delayed)
                copy = held.message  # expired: dead-lettered by the tier to the main queue
                self.ready.append(Held(OutMessage(
                    self.topology.queue, copy.body, "", copy.message_id,
                    {**(copy.headers or {}), "x-last-death-reason": "expired",
                     "x-last-death-queue": copy.routing_key}, copy.content_type, copy.content_encoding)))
        return self.ready.popleft() if self.ready else None

    def give_back(self, held: Sequence[Held]) -> None:
        """Messages delivered and not acked go back to the head of the queue, in order, marked
        redelivered; one given back more than the delivery limit goes to the dead queue."""
        for h in reversed(held):
            h.returns += 1
            h.redelivered = True
            if h.returns > self.topology.delivery_limit:
                m = h.message
                self.dead.append(OutMessage(self.topology.dead_queue, m.body, "", m.message_id,
                                            {**(m.headers or {}), "x-last-death-reason": "delivery_limit"},
                                            m.content_type, m.content_encoding))
            else:
                self.ready.appendleft(h)
        self.changed.notify_all()

    def new_generation(self) -> int:
        self._generations += 1
        return self._generations

    def drained(self) -> bool:
        """Nothing ready and nothing on a retry tier."""
        return not self.ready and not self.delayed


@dataclass
class _Refusal:
    count: int = 0
    why: str = "the broker nacked a copy"


class MemoryLink:
    """One connection to :class:`MemoryQueues`, as the worker's :class:`~.worker.WorkerIO`.

    *stop_when_drained*: tell the worker to stop (as SIGTERM does) once every
    message is acked and nothing is left, not even on a retry tier.
    Each request is the message the pipe would carry to the connection process
    (:mod:`.messages`): *on_request* is called with it before it is carried
    out (a test looks at the database then), and :attr:`requests` keeps them all.
    """

    def __init__(self, queues: MemoryQueues, worker: Worker, *, prefetch: int = 500,
                 stop_when_drained: bool = False, on_request: Callable[[ToConnection], None] | None = None) -> None:
        self.queues = queues
        self.worker = worker
        queues.declare(worker.topology)
        self.prefetch = prefetch
        self.stop_when_drained = stop_when_drained
        self.on_request = on_request
        self.requests: list[ToConnection] = []
        self.unacked: dict[int, Held] = {}
        self.generation = 0  # 0: no channel yet, or the channel is gone
        self.closed = False
        self._next_tag = 0
        self._lost: list[tuple[int, str]] = []  # channels gone that the worker has not heard of yet
        self._refusal = _Refusal()

    # -- on request (any thread) --
    def refuse_copies(self, count: int = 1, why: str = "the broker nacked a copy") -> None:
        """The next *count* copies published fail to confirm."""
        with self.queues.changed:
            self._refusal = _Refusal(count, why)

    def lose_channel(self, why: str = "connection reset by peer") -> None:
        """The channel dies now: its unacked deliveries go back to the queue and an ack
        for them is dropped; the worker hears of it at its next pump."""
        with self.queues.changed:
            if self.generation:
                self._lost.append((self.generation, why))
            self.generation = 0
            self._return_unacked()

    # -- WorkerIO (the worker's thread) --
    def pump(self, timeout: float) -> None:
        queues, worker = self.queues, self.worker
        with queues.changed:
            if self.closed:
                return
            lost, self._lost = self._lost, []
            for generation, why in lost:
                worker.channel_lost(generation, why)
            if not self.generation:
                self.generation = queues.new_generation()
                self._next_tag = 0
                worker.channel_opened(self.generation)
            batch: list[Delivery] = []
            while len(self.unacked) < self.prefetch and (held := queues.take()) is not None:
                self._next_tag += 1
                self.unacked[self._next_tag] = held
                m = held.message
                headers = dict(m.headers or {})
                if held.returns:
                    headers[H_DELIVERY_COUNT] = held.returns
                batch.append(Delivery(self.generation, self._next_tag, m.body, m.routing_key, held.redelivered,
                                      m.message_id, headers, m.content_type, m.exchange, m.content_encoding))
            if batch:
                worker.deliver_all(batch)
                return
            if self.stop_when_drained and not self.unacked and queues.drained():
                worker.stop_requested.set()
                return
            queues.changed.wait(timeout)

    def ack(self, generation: int, tag: int, *, multiple: bool = True) -> None:
        self._request(Ack(generation, tag, multiple))
        with self.queues.changed:
            if generation != self.generation:
                return  # the channel is gone: dropped, never sent
            for t in [t for t in self.unacked if t <= tag] if multiple else [tag]:
                self.unacked.pop(t, None)

    def publish_copies(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]:
        self._request(PublishCopies(len(self.requests) + 1, generation, tuple(messages)))
        future: Future[None] = Future()
        with self.queues.changed:
            if generation != self.generation or self.closed:
                future.set_exception(BrokerUnavailable("the channel of these deliveries is gone"))
            elif self._refusal.count > 0:
                self._refusal.count -= 1
                future.set_exception(BrokerUnavailable(self._refusal.why))
            else:
                unroutable = [m.routing_key for m in messages if not self.queues.publish(m)]
                if unroutable:
                    future.set_exception(BrokerUnavailable(f"copy to {unroutable[0]} unroutable: 312 NO_ROUTE"))
                else:
                    future.set_result(None)
        return future

    def reconnect(self, why: str) -> None:
        self._request(Reconnect(why))
        self.lose_channel(why)

    def shutdown(self) -> None:
        self._request(Shutdown())
        self.close()

    def close(self) -> None:
        """The connection ends (a clean exit or a crash): unacked deliveries go back."""
        with self.queues.changed:
            self.closed = True
            self.generation = 0
            self._return_unacked()

    def _return_unacked(self) -> None:
        held, self.unacked = list(self.unacked.values()), {}
        self.queues.give_back(held)

    def _request(self, request: ToConnection) -> None:
        if self.on_request is not None:
            self.on_request(request)
        self.requests.append(request)


__all__ = ["Held", "MemoryLink", "MemoryQueues"]
