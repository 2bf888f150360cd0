"""The declare operations of a topology, run one after another on an open channel.

Names and arguments come from :mod:`delivery_consumer.topology`; this module
only turns them into pika's asynchronous channel calls. Used by the
publisher (before its first message) and by ``run``'s connection (before it
consumes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..topology import Binding, Route, Topology

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
