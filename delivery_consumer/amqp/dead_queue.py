"""Exclusive, order-preserving access to a dead-letter queue.

``dead list / requeue / purge`` and ``inbox prune`` read a dead queue through
:class:`DeadQueue`: one consumer takes every message without acknowledging
it, acks the ones it removes, and gives back the rest when it closes (also
when the process is killed). Each reader first declares the dead queue's
*reader lock*, an exclusive queue ``<dead queue>.reader`` that lives as long
as its connection: a second reader is refused by the broker
(:class:`QueueBusy`), which serialises those commands (see docs/amqp.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import pika.exceptions as pex

from ..model.deliveries import OutMessage, PublishResult
from ..model.errors import BrokerError, BrokerFatal, BrokerUnavailable
from .connection import FAILURES, Addresses, classify, open_blocking, redact, unreachable_queue
from .publisher import properties

#: The most messages one reader holds: a quorum queue gives a consumer without a prefetch limit at
#: most 2,000, so the reader asks for the most AMQP allows (a queue longer than this is listed in part).
MAX_HELD = 65535


class QueueBusy(BrokerError):
    """Another reader holds the dead queue (another dead command, a prune)."""


@dataclass(slots=True)
class HeldMessage:
    """A message taken from a queue and not yet acknowledged."""

    tag: int
    body: bytes
    message_id: str | None
    headers: dict[str, Any]
    content_type: str | None
    redelivered: bool
    exchange: str
    routing_key: str
    content_encoding: str | None = None


def reader_lock(queue: str) -> str:
    """The exclusive queue a reader of *queue* holds while it reads (the readers' lock)."""
    return f"{queue}.reader"


def close_returning_in_order(conn: Any) -> None:
    """Close a ``BlockingConnection`` so that the broker gives back, in their order, every message
    its consumers were sent and did not ack.

    pika's ``close`` first cancels each consumer (``basic.cancel``) and rejects (requeue) what it
    received and did not dispatch yet; the broker too gives back at once what was on its way to a
    cancelled consumer. A quorum queue puts those ahead of (or, without a delivery limit, behind)
    the messages the closing channel returns: out of order. So the channels are closed with no
    cancel (their consumers marked as cancelled already, so pika sends none and rejects nothing
    that arrives meanwhile): the broker returns everything when the channel goes, in order, as
    it does for a process that was killed.
    """
    impl = conn._impl  # pika's blocking layer has no close that leaves deliveries alone
    for channel in list(impl._channels.values()):
        channel._cancelled.update(channel._consumers)
    if impl.is_open:
        impl.close()
    deadline = time.monotonic() + 10.0
    while not conn.is_closed and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)


class DeadQueue:
    """Exclusive, order-preserving access to one dead-letter queue.

    ``read()`` returns the queue's messages in queue order, held; ``ack()``
    removes one; ``publish()`` sends a copy elsewhere with a publisher confirm
    (mandatory, so a missing target queue is reported, not silently dropped);
    ``close()`` gives back everything not acknowledged. Uses a
    ``BlockingConnection``: the command is a short, single-threaded script, and
    every call here services the connection's heartbeats.
    """

    def __init__(self, url: str, queue: str, *, name: str = "delivery-consumer dead",
                 settle_s: float = 0.2, timeout_s: float = 120.0) -> None:
        self.url = url
        self.queue = queue
        self._params = Addresses(url, name=name)
        self._settle_s = settle_s
        self._timeout_s = timeout_s
        self._conn: Any = None
        self._channel: Any = None  # consuming channel: deliveries and acks
        self._pub: Any = None  # confirm-mode channel for copies
        self._held: list[HeldMessage] = []
        self._limit = MAX_HELD  # the prefetch: no more arrive while this many are held
        #: Ready messages when the reader attached, and the time (Unix) it did.
        self.count_at_open = 0
        self.opened_at = 0.0
        #: True when :meth:`read` returned every message present at :meth:`open`.
        self.complete = False

    def _error(self, exc: BaseException) -> BrokerError:
        if isinstance(exc, pex.ChannelClosedByBroker) and exc.reply_code == 404 and not unreachable_queue(exc):
            return BrokerFatal(f"queue {self.queue} does not exist on {redact(self.url)} (wrong --queue-prefix? "
                               "run topology declare, or start the consumer once)")
        if isinstance(exc, pex.ChannelClosedByBroker) and (
                exc.reply_code == 405 or (exc.reply_code == 403 and "exclusive" in exc.reply_text)):
            return QueueBusy(f"queue {self.queue} is in use by another reader (dead list/requeue/purge or "
                             "inbox prune); try again when it has finished")
        return classify(exc, url=self.url)

    def open(self, *, prefetch: int = 0) -> int:
        """Connect and start the exclusive consumer; returns the ready count.

        *prefetch* 0 asks for as many as one reader may hold (:data:`MAX_HELD`).
        """
        try:
            self._conn = open_blocking(self._params)
            self._channel = self._conn.channel()
            self.opened_at = time.time()
            # A quorum queue does not refuse a second "exclusive" consumer: the lock is an exclusive
            # queue of this connection (405 RESOURCE_LOCKED for any other), gone when it closes.
            self._channel.queue_declare(reader_lock(self.queue), exclusive=True, auto_delete=True,
                                        arguments={"x-queue-type": "classic"})
            frame = self._channel.queue_declare(self.queue, passive=True)
            self.count_at_open = int(frame.method.message_count)
            self._limit = min(prefetch, MAX_HELD) if prefetch > 0 else MAX_HELD
            self._channel.basic_qos(prefetch_count=self._limit)
            self._channel.basic_consume(self.queue, self._on_message, auto_ack=False, exclusive=True)
        except FAILURES as exc:
            error = self._error(exc)
            self.close()
            raise error from None
        return self.count_at_open

    def _on_message(self, _channel: Any, method: Any, props: Any, body: bytes) -> None:
        self._held.append(HeldMessage(
            tag=method.delivery_tag, body=body, message_id=props.message_id, headers=dict(props.headers or {}),
            content_type=props.content_type, redelivered=bool(method.redelivered), exchange=method.exchange,
            routing_key=method.routing_key, content_encoding=props.content_encoding,
        ))

    def _ready(self) -> int:
        return int(self._channel.queue_declare(self.queue, passive=True).method.message_count)

    def read(self, max_messages: int | None = None) -> list[HeldMessage]:
        """Every message of the queue, in queue order (at most *max_messages*).

        Done when the broker has no ready message left -- all of them are held
        here -- and either as many arrived as the queue had at :meth:`open` or
        none arrived for a moment; or when the reader holds as many as its
        prefetch lets it (a longer queue: the read is not complete). Dead
        letters that arrive later stay at the tail, after everything returned here.
        """
        try:
            self._gather(max_messages, lambda seen, quiet: seen >= self._limit or (self._ready() == 0 and (
                seen >= self.count_at_open or quiet >= self._settle_s)))
        except FAILURES as exc:
            raise self._error(exc) from None
        held = self._held if max_messages is None else self._held[:max_messages]
        # One consumer on a FIFO queue: the first count_at_open deliveries are
        # exactly the messages that were there when it attached.
        self.complete = len(held) >= self.count_at_open
        return list(held)

    def _gather(self, until: int | None, enough: Callable[[int, float], bool]) -> None:
        """Receive until *until* messages are held, or until *enough* (messages held, seconds since the
        last one arrived) says so, asked every 50 ms; BrokerUnavailable past the reader's timeout."""
        started = last_arrival = time.monotonic()
        seen = len(self._held)
        next_check = 0.0
        while until is None or len(self._held) < until:
            self._conn.process_data_events(time_limit=0.02)
            now = time.monotonic()
            if len(self._held) != seen:
                seen, last_arrival = len(self._held), now
            if now >= next_check:
                next_check = now + 0.05
                if enough(seen, now - last_arrival):
                    break
            if now - started > self._timeout_s:
                raise BrokerUnavailable(f"timed out after {self._timeout_s:g}s reading {self.queue}")

    def poll(self) -> list[HeldMessage]:
        """Messages that arrived since the last :meth:`read` or :meth:`poll`."""
        before = len(self._held)
        try:
            self._conn.process_data_events(time_limit=0)
        except FAILURES as exc:
            raise self._error(exc) from None
        return self._held[before:]

    def publish(self, message: OutMessage) -> PublishResult:
        """Publish *message* and wait for its confirm (mandatory, persistent).

        Connection loss is raised (BrokerUnavailable): the copy may or may not
        have reached its queue, and the held messages go back to this one.
        """
        try:
            if self._pub is None:
                self._pub = self._conn.channel()
                self._pub.confirm_delivery()
            self._pub.basic_publish(message.exchange, message.routing_key, message.body, properties(message),
                                    mandatory=True)
        except pex.UnroutableError:
            return PublishResult("returned", f"unroutable: no queue {message.routing_key!r}")
        except pex.NackError:
            # The next copy goes on a new channel: one a queue refused may stay refused (docs/cluster.md).
            pub, self._pub = self._pub, None
            with suppress(*FAILURES):
                pub.close()
            return PublishResult("nacked", "the broker could not store the message")
        except FAILURES as exc:
            raise self._error(exc) from None
        return PublishResult("confirmed")

    def ack(self, tag: int) -> None:
        """Remove one held message from the queue."""
        try:
            self._channel.basic_ack(tag)
        except FAILURES as exc:
            raise self._error(exc) from None

    def flush(self) -> None:
        """Make sure the acks so far were written to the broker."""
        try:
            self._conn.process_data_events(time_limit=0)
        except FAILURES as exc:
            raise self._error(exc) from None

    def close(self) -> None:
        """Disconnect; every message not acknowledged returns to its place."""
        conn, self._conn = self._conn, None
        self._channel = self._pub = None
        self._held = []
        if conn is not None and conn.is_open:
            with suppress(*FAILURES):  # the broker requeues when the socket goes
                close_returning_in_order(conn)

    def __enter__(self) -> DeadQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
