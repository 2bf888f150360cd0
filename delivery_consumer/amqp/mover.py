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
confirmed) returns to the head of the queue in its order (the broker does so
on a closed channel; a ``basic.nack`` with requeue is not used: a quorum queue
may requeue a multiple nack out of order).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import pika
import pika.exceptions as pex

from ..errors import BrokerError, BrokerUnavailable
from .connection import FAILURES, classify, parameters
from .dead_queue import DeadQueue, HeldMessage


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
            self._conn = pika.BlockingConnection(self._params)
            self._channel = self._conn.channel()
            self.opened_at = time.time()
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
        started = last_arrival = time.monotonic()
        next_check = 0.0
        seen = 0
        try:
            self._channel.basic_qos(prefetch_count=min(limit, 65535))
            tag = self._channel.basic_consume(self.queue, self._on_message, auto_ack=False, exclusive=True)
            while len(self._held) < limit:
                self._conn.process_data_events(time_limit=0.02)
                now = time.monotonic()
                if len(self._held) != seen:
                    seen, last_arrival = len(self._held), now
                if now >= next_check:
                    next_check = now + 0.05
                    if now - last_arrival >= self._settle_s and self._ready() == 0:
                        break
                if now - started > self._timeout_s:
                    raise BrokerUnavailable(f"timed out after {self._timeout_s:g}s reading {self.queue}")
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


def delete_queue(url: str, queue: str, *, name: str = "delivery-consumer move") -> bool:
    """Delete *queue* if it is empty and has no consumer (checked just before: quorum queues refuse the
    ``if-empty`` and ``if-unused`` flags); True when it is gone (or never was)."""
    conn: Any = None
    try:
        conn = pika.BlockingConnection(parameters(url, name=name))
        channel = conn.channel()
        try:
            frame = channel.queue_declare(queue, passive=True)
        except pex.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return True
            raise
        if frame.method.message_count or frame.method.consumer_count:
            return False
        channel.queue_delete(queue)
        return True
    except FAILURES as exc:
        raise classify(exc, url=url) from None
    finally:
        if conn is not None and conn.is_open:
            with suppress(*FAILURES):
                conn.close()


def exchange_exists(url: str, exchange: str, *, name: str = "delivery-consumer move") -> bool:
    """Whether *exchange* exists (a passive declare)."""
    conn: Any = None
    try:
        conn = pika.BlockingConnection(parameters(url, name=name))
        try:
            conn.channel().exchange_declare(exchange, passive=True)
        except pex.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return False
            raise
        return True
    except FAILURES as exc:
        raise classify(exc, url=url) from None
    finally:
        if conn is not None and conn.is_open:
            with suppress(*FAILURES):
                conn.close()


def delete_exchanges(url: str, exchanges: Sequence[str], *, name: str = "delivery-consumer move") -> None:
    """Delete *exchanges* (those that do not exist are skipped)."""
    conn: Any = None
    try:
        conn = pika.BlockingConnection(parameters(url, name=name))
        channel = conn.channel()
        for exchange in exchanges:
            channel.exchange_delete(exchange)
    except FAILURES as exc:
        raise classify(exc, url=url) from None
    finally:
        if conn is not None and conn.is_open:
            with suppress(*FAILURES):
                conn.close()


__all__ = ["WindowReader", "delete_exchanges", "delete_queue", "exchange_exists"]
