"""Queue depths in ``run``'s Prometheus metrics, read from the broker at scrape time.

The worker knows what it committed, not what waits for it: the backlog of the
main queue and the dead letters waiting for a person are the broker's to tell.
:class:`QueueCollector` asks with a passive declare (no plugin needed) when
Prometheus scrapes, so the figures are as fresh as the scrape and cost one
short connection per scrape, nothing between scrapes. When the broker cannot
be asked, ``delivery_queue_up`` is 0 and the depths are left out.

The asking runs in a thread of its own: a scrape waits for it at most
:data:`SCRAPE_TIMEOUT_S`, and a broker that does not answer makes the scrape
say ``delivery_queue_up 0`` then, not hang (the next scrape waits for the same
question again, never stacks another one). Each broker call of the question has
a deadline of its own (:func:`amqp.admin.queue_states`): a queue that cannot be
read (its node down, no answer in time, no quorum to answer) while the broker
answers for the others is ``delivery_queue_readable 0``, its depths left out.

A partition's run labels these series ``partition`` as :class:`metrics.Metrics`
labels the rest of its series, so that an alert can join a partition's queue
to that partition's commits (``on (consumer, partition)``); an unpartitioned
consumer's series have no ``partition`` label, like its other series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..model.errors import BrokerError
from .topology import Topology

#: A scrape must not hang on a broker that does not answer.
SCRAPE_TIMEOUT_S = 3.0


class QueueCollector(Collector):
    """``delivery_queue_ready``, ``delivery_queue_consumers``, ``delivery_queue_readable`` and
    ``delivery_queue_up`` for the consumer's (or the partition's) main queue (``kind="main"``) and dead
    queue (``kind="dead"``)."""

    def __init__(self, url: str, topology: Topology) -> None:
        self.url = url
        self.topology = topology
        self._lock = threading.Lock()
        self._asking: threading.Thread | None = None
        self._answer: dict[str, Any] | None = None

    def _ask(self, queues: list[str]) -> None:
        from .admin import Unreadable, queue_states  # pika, only when the broker is asked

        try:
            answer: dict[str, Any] | None = queue_states(
                self.url, queues, name=f"delivery-consumer metrics {self.topology.consumer}",
                timeout_s=SCRAPE_TIMEOUT_S)
        except BrokerError:
            answer = None
        if answer and all(isinstance(state, Unreadable) for state in answer.values()) and len(
                {state.reason for state in answer.values()}) == 1:
            answer = None  # not one queue answered: the broker itself
        with self._lock:
            self._answer = answer

    def _counts(self, queues: list[str]) -> dict[str, Any] | None:
        """The broker's answer if it comes within SCRAPE_TIMEOUT_S, else None."""
        with self._lock:
            asking = self._asking
            if asking is None or not asking.is_alive():
                self._answer = None
                asking = self._asking = threading.Thread(target=self._ask, args=(queues,), daemon=True,
                                                         name="queue-counts")
                asking.start()
        asking.join(SCRAPE_TIMEOUT_S)
        with self._lock:
            return None if asking.is_alive() else self._answer

    def collect(self) -> Iterator[GaugeMetricFamily]:
        topo = self.topology
        # The labels every series of the run starts with (as metrics.Metrics has them).
        base, values = (["consumer"], [topo.consumer]) if topo.partition is None else (
            ["consumer", "partition"], [topo.consumer, str(topo.partition)])
        labels = [*base, "queue", "kind"]
        ready = GaugeMetricFamily("delivery_queue_ready", "Messages ready in the queue (passive declare at scrape).",
                                  labels=labels)
        consumers = GaugeMetricFamily("delivery_queue_consumers", "Consumers attached to the queue.", labels=labels)
        up = GaugeMetricFamily("delivery_queue_up", "1 when the broker answered the scrape's passive declare.",
                               labels=base)
        readable = GaugeMetricFamily("delivery_queue_readable", "1 when the queue answered the scrape's passive "
                                     "declare, 0 when the broker could not serve it (its node down, no answer "
                                     "in time, no quorum).", labels=labels)
        queues = {topo.queue: "main", topo.dead_queue: "dead"}
        counts = self._counts(list(queues))
        if counts is None:
            up.add_metric(values, 0)
            yield up
            return
        from .admin import Unreadable

        up.add_metric(values, 1)
        for queue, kind in queues.items():
            count = counts.get(queue)
            if isinstance(count, Unreadable):
                readable.add_metric([*values, queue, kind], 0)
            elif count is not None:
                readable.add_metric([*values, queue, kind], 1)
                ready.add_metric([*values, queue, kind], count.ready)
                consumers.add_metric([*values, queue, kind], count.consumers)
        yield from (ready, consumers, readable, up)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # no collect() at registration: that would connect to the broker


__all__ = ["QueueCollector"]
