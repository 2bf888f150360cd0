"""Moving a queue's messages elsewhere in order, a bounded window at a time.

:class:`WindowReader` takes a queue's messages in *windows*: one exclusive
consumer with a prefetch of the window's size receives them, is cancelled, and
the caller publishes their copies (confirmed) and acks the window with one
``basic.ack(multiple)``; then the next window. The queue is never asked to
hand over more than a window at once, so it works whatever the queue holds --
a quorum queue gives a consumer without a prefetch limit only 2,000 messages
and would never look empty to a reader that held them all -- and it never
receives more than it asked for: a consumer with a prefetch of *n* that acks
nothing gets at most *n*, so a reader told to take the first *n* messages of a
queue that is still being published to never touches the (n+1)th.

What is not acked when the connection goes (a crash, a copy that was not
confirmed) returns to the head of the queue in its order: the broker does so
for a closed channel. ``basic.nack`` or ``basic.reject`` with requeue is never
used: a quorum queue puts such a message at its tail (seen on RabbitMQ 3.10.8),
behind newer events of its key.
"""

from __future__ import annotations

import time

from ..model.errors import BrokerError
from .connection import FAILURES, open_blocking
from .dead_queue import DeadQueue, HeldMessage, reader_lock


class WindowReader(DeadQueue):
    """Exclusive, windowed reading of one queue, for moving its messages (see the module)."""

    def __init__(self, url: str, queue: str, *, name: str = "delivery-consumer move",
                 settle_s: float = 0.3, timeout_s: float = 120.0) -> None:
        super().__init__(url, queue, name=name, settle_s=settle_s, timeout_s=timeout_s)
        self._last_tag = 0

    def open(self, *, prefetch: int = 0) -> int:
        """Connect (no consumer yet); returns the ready count."""
        del prefetch  # each window sets its own
        try:
            self._conn = open_blocking(self._params)
            self._channel = self._conn.channel()
            self.opened_at = time.time()
            self._channel.queue_declare(reader_lock(self.queue), exclusive=True, auto_delete=True,
                                        arguments={"x-queue-type": "classic"})  # the readers' lock (dead_queue.py)
            self.count_at_open = self._ready()
        except FAILURES as exc:
            error = self._error(exc)
            self.close()
            raise error from None
        return self.count_at_open

    def ready(self) -> int:
        """The queue's ready messages now (a passive declare)."""
        try:
            return self._ready()
        except FAILURES as exc:
            raise self._error(exc) from None

    def take(self, limit: int) -> list[HeldMessage]:
        """The next at most *limit* messages of the queue, in queue order, held.

        Done when *limit* arrived, or when the broker has no ready message
        left and none arrived for a moment (a retry tier's messages leave
        by their TTL meanwhile). :meth:`ack_taken` removes them.
        """
        if limit <= 0:
            return []
        self._held = []
        try:
            self._channel.basic_qos(prefetch_count=min(limit, 65535))
            tag = self._channel.basic_consume(self.queue, self._on_message, auto_ack=False, exclusive=True)
            self._gather(limit, lambda _seen, quiet: quiet >= self._settle_s and self._ready() == 0)
            self._channel.basic_cancel(tag)  # delivers what was in flight before the cancel-ok
        except FAILURES as exc:
            raise self._error(exc) from None
        held = list(self._held)
        if len(held) > limit:  # cannot happen with the prefetch; never ack more than asked for
            raise BrokerError(f"{self.queue}: received {len(held)} messages with a prefetch of {limit}")
        if held:
            self._last_tag = held[-1].tag
        return held

    def __enter__(self) -> WindowReader:
        return self

    def ack_taken(self, upto: int | None = None) -> None:
        """Remove the messages taken so far (up to delivery tag *upto*) from the queue."""
        tag = self._last_tag if upto is None else upto
        if not tag:
            return
        try:
            self._channel.basic_ack(tag, multiple=True)
            self._conn.process_data_events(time_limit=0)
        except FAILURES as exc:
            raise self._error(exc) from None


__all__ = ["WindowReader"]
