"""The declare operations of a topology, run one after another on an open channel.

Names and arguments come from :mod:`delivery_consumer.amqp.topology`; this module
only turns them into pika's asynchronous channel calls. Used by the
publisher (before its first message) and by ``run``'s connection (before it
consumes). A process declares once, at its first connection (where a queue
declared with other arguments is refused: 406); a reconnect only looks
(:class:`Missing`: passive declares) and declares what is missing, so that a
node that is down does not fail a reconnect with its queues' declares
(docs/amqp.md, "Declaring once").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pika.exceptions as pex

from .topology import Binding, Route, Topology

#: One channel call; it is given the callback that starts the next.
Step = Callable[[Callable[[Any], None]], None]


class Steps:
    """Run asynchronous channel operations one after another."""

    def __init__(self, steps: list[Step], done: Callable[[], None]):
        self._steps = steps
        self._done = done

    def start(self) -> None:
        self._next(None)

    def _next(self, _frame: Any) -> None:
        if not self._steps:
            self._done()
            return
        step = self._steps.pop(0)
        step(self._next)


def declare_steps(channel: Any, topologies: Sequence[Topology], exchanges: Sequence[str] = (),
                  routes: Sequence[Route] = ()) -> list[Step]:
    """The declare operations for *topologies* (idempotent; a mismatch of
    arguments closes the channel with 406, which is reported as fatal), then
    those of *routes* (a partitioned consumer's slot routing)."""

    def exchange_step(name: str, kind: str = "topic", args: dict[str, Any] | None = None) -> Step:
        return lambda cb: channel.exchange_declare(name, exchange_type=kind, durable=True, arguments=args,
                                                   callback=cb)

    def queue_step(name: str, args: dict[str, Any]) -> Step:
        return lambda cb: channel.queue_declare(name, durable=True, arguments=args, callback=cb)

    def bind_step(b: Binding, unbind: bool = False) -> Step:
        if b.to_exchange:
            call = channel.exchange_unbind if unbind else channel.exchange_bind
            return lambda cb: call(b.destination, b.source, routing_key=b.routing_key, arguments=b.arguments,
                                   callback=cb)
        qcall = channel.queue_unbind if unbind else channel.queue_bind
        return lambda cb: qcall(b.destination, b.source, routing_key=b.routing_key, arguments=b.arguments,
                                callback=cb)

    steps: list[Step] = [exchange_step(ex) for ex in dict.fromkeys([*exchanges, *(t.exchange for t in topologies)])]
    for topo in topologies:
        steps.extend(queue_step(q, a) for q, a in topo.queues())
        steps.extend(bind_step(Binding(topo.exchange, topo.queue, key)) for key in topo.queue_binding_keys)
    for route in routes:
        steps.extend(exchange_step(name, kind, args) for name, kind, args in route.exchanges)
        steps.extend(queue_step(q, a) for q, a in route.queues)
        steps.extend(bind_step(b) for b in route.bind)
        steps.extend(bind_step(b, unbind=True) for b in route.unbind)
    return steps


def _absent(reason: BaseException, kind: str) -> bool:
    """A refused passive declare that says the object does not exist (not "home node down")."""
    return (isinstance(reason, pex.ChannelClosedByBroker) and reason.reply_code == 404
            and f"no {kind} " in reason.reply_text)


class Missing:
    """On a reconnect: ask for each exchange and queue of *topologies* with a passive declare, and
    declare only those the broker says do not exist (and a main queue's bindings with it).

    *open_channel* opens a channel on the connection and calls its argument with it (a refused
    passive declare closes its channel: each object missing costs a new one). *done* is called when
    everything exists; *failed* with the reason when the broker answered anything else (a queue whose
    home node is down: 404 "home node"; no quorum; a closed connection).
    """

    def __init__(self, open_channel: Callable[[Callable[[Any], None]], None], topologies: Sequence[Topology],
                 done: Callable[[], None], failed: Callable[[BaseException], None],
                 exchanges: Sequence[str] = ()) -> None:
        self._open_channel = open_channel
        self._topologies = list(topologies)
        self._done = done
        self._failed = failed
        self._todo: list[tuple[str, str, Any]] = [
            ("exchange", ex, None) for ex in dict.fromkeys([*exchanges, *(t.exchange for t in topologies)])]
        for topo in topologies:
            self._todo.extend(("queue", q, (a, topo if q == topo.queue else None)) for q, a in topo.queues())
        self._channel: Any = None
        self._finished = False
        self._declaring = False  # an active declare (not a passive one) is under way
        #: What this reconnect declared, for the log.
        self.declared: list[str] = []

    def start(self) -> None:
        self._open_channel(self._opened)

    def _opened(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._closed)
        self._next()

    def _next(self, _frame: Any = None) -> None:
        self._declaring = False
        if not self._todo:
            self._finished = True
            if self._channel is not None and self._channel.is_open:
                self._channel.close()
            self._done()
            return
        kind, name, extra = self._todo[0]
        if kind == "bind":  # an exchange declared again lost its bindings: bind again (idempotent)
            self._declaring = True
            self._channel.queue_bind(name, extra[0], routing_key=extra[1], callback=self._exists)
        elif kind == "exchange":
            self._channel.exchange_declare(name, passive=True, callback=self._exists)
        else:
            self._channel.queue_declare(name, passive=True, callback=self._exists)

    def _exists(self, _frame: Any) -> None:
        self._todo.pop(0)
        self._next()

    def _closed(self, channel: Any, reason: BaseException) -> None:
        if self._finished or channel is not self._channel:
            return
        if self._declaring or not self._todo or not _absent(reason, self._todo[0][0]):
            self._finished = True
            self._failed(reason)
            return
        kind, name, extra = self._todo.pop(0)
        self.declared.append(name)
        self._open_channel(lambda channel: self._declare(channel, kind, name, extra))

    def _declare(self, channel: Any, kind: str, name: str, extra: Any) -> None:
        self._channel, self._declaring = channel, True
        channel.add_on_close_callback(self._closed)
        if kind == "exchange":
            self._todo.extend(("bind", t.queue, (name, key)) for t in self._topologies if t.exchange == name
                              for key in t.queue_binding_keys)
            channel.exchange_declare(name, exchange_type="topic", durable=True, callback=self._next)
            return
        args, topo = extra
        if topo is None:
            channel.queue_declare(name, durable=True, arguments=args, callback=self._next)
            return
        steps: list[Step] = [lambda cb: channel.queue_declare(name, durable=True, arguments=args, callback=cb)]

        def bind(key: str) -> Step:
            return lambda cb: channel.queue_bind(name, topo.exchange, routing_key=key, callback=cb)

        steps.extend(bind(key) for key in topo.queue_binding_keys)
        Steps(steps, self._next).start()
