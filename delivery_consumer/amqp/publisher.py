"""Publishing with publisher confirms, from ordinary synchronous code.

:class:`Publisher` publishes a batch of persistent, mandatory messages with a
window of unconfirmed ones and tells the fate of each (:class:`PublishResult`);
:class:`StreamPublisher` lets batches overlap on the same channel, for the
outbox dispatcher. Both run pika's ``SelectConnection`` loop inside their own
methods only, so confirms are pipelined (see docs/amqp.md).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pika
import pika.exceptions as pex
from pika import spec
from pika.adapters.select_connection import IOLoop, PollEvents

from ..model.deliveries import OutMessage, PublishResult
from ..model.errors import BrokerError, BrokerFatal, BrokerUnavailable, safe_reason
from .connection import Addresses, Opening, classify, open_select
from .declare import Missing, Steps, declare_steps
from .topology import DEFAULT_URL, Route, Topology
from .wakeup import Wakeup

PERSISTENT = 2
_V = TypeVar("_V")


def properties(msg: OutMessage) -> pika.BasicProperties:
    """*msg*'s AMQP properties: persistent, with its content type, encoding, message_id and headers."""
    return pika.BasicProperties(
        delivery_mode=PERSISTENT,
        content_type=msg.content_type,
        content_encoding=msg.content_encoding,
        message_id=msg.message_id,
        headers=msg.headers or None,
    )


def confirm_mode(channel: Any, *, on_close: Callable[[Any, BaseException], None],
                 on_return: Callable[[Any, Any, Any, bytes], None], on_confirm: Callable[[Any], None],
                 then: Callable[[], None]) -> None:
    """Put *channel* in confirm mode, its closing, returns and confirms going to the given
    callbacks; *then* once the broker has agreed (delivery tags start at 1 from there)."""
    channel.add_on_close_callback(on_close)
    channel.add_on_return_callback(on_return)
    channel.confirm_delivery(ack_nack_callback=on_confirm, callback=lambda _frame: then())


def take_confirmed(frame: Any, pending: dict[int, _V]) -> tuple[bool, list[tuple[int, _V]]]:
    """What a confirm *frame* says (True: ack, False: nack), and the entries of *pending*
    (delivery tag -> what was published) it settles, taken out of it."""
    method = frame.method
    tags = [tag for tag in pending if tag <= method.delivery_tag] if method.multiple else [method.delivery_tag]
    return isinstance(method, spec.Basic.Ack), [(tag, pending.pop(tag)) for tag in tags if tag in pending]


class Publisher:
    """Publish with pipelined confirms from ordinary synchronous code.

    The I/O loop runs only inside this object's methods; between calls the
    connection is idle (keep gaps below the heartbeat, or call :meth:`idle`).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        topologies: Sequence[Topology] = (),
        exchanges: Sequence[str] = (),
        routes: Sequence[Route] = (),
        name: str = "delivery-consumer publisher",
        timeout_s: float = 30.0,
        window: int = 1000,
    ) -> None:
        self.url = url
        self._addrs = Addresses(url, name=name)
        self._opening: Opening | None = None
        self._topologies = list(topologies)
        self._exchanges = list(exchanges)
        self._routes = list(routes)
        self._declared = False  # declared once: a reconnect declares only what is missing (declare.Missing)
        self._timeout_s = timeout_s
        self.window = window
        self._ioloop = IOLoop()
        self._wakeup = Wakeup(self._ioloop)
        self._conn: pika.SelectConnection | None = None
        self._channel: Any = None
        self._ready = False
        self._error: BrokerError | None = None
        self._waiting: Callable[[], bool] | None = None
        self._seq = 0
        self._pending: dict[int, int] = {}
        self._results: list[PublishResult | None] = []
        self._batch: Sequence[OutMessage] = ()
        self._next = 0
        self._deadline: float | None = None  # time.monotonic() no wait of publish() goes past

    # loop driving
    def _check(self) -> None:
        if self._waiting is not None and (self._error is not None or self._waiting()):
            self._waiting = None
            self._ioloop.stop()

    def _run_until(self, done: Callable[[], bool], what: str) -> None:
        if self._error is None and done():
            return
        self._waiting = done
        timeout_s, why = self._timeout_s, f"timed out after {self._timeout_s:g}s waiting for the broker to {what}"
        if self._deadline is not None and self._deadline - time.monotonic() < timeout_s:
            timeout_s, why = max(0.0, self._deadline - time.monotonic()), f"no answer within the deadline ({what})"
        handle = self._ioloop.call_later(timeout_s, lambda: self._fail(BrokerUnavailable(why)))
        try:
            self._ioloop.start()
        finally:
            self._ioloop.remove_timeout(handle)

    def _fail(self, error: BrokerError) -> None:
        if self._error is None:
            self._error = error
        self._waiting = self._waiting or (lambda: True)
        self._check()

    # connection
    def connect(self) -> None:
        """Open the connection and a confirm-mode channel, declare topology."""
        if self._ready:
            return
        self._error = None
        self._opening = open_select(self._addrs, ioloop=self._ioloop, on_open=self._on_open,
                                    on_open_error=lambda _c, exc: self._fail(classify(exc, url=self.url)),
                                    on_close=self._on_closed)
        self._run_until(lambda: self._ready, "open the connection")
        if self._error is not None:
            error, self._error = self._error, None
            self._abort()
            raise error

    def _on_open(self, conn: pika.SelectConnection) -> None:
        self._conn, self._opening = conn, None
        conn.channel(on_open_callback=self._on_channel)

    def _on_channel(self, channel: Any) -> None:
        self._channel = channel

        def confirming() -> None:
            self._seq = 0
            conn = self._conn
            if self._declared and conn is not None:
                Missing(lambda then: conn.channel(on_open_callback=then), self._topologies, self._on_ready,
                        self._missing_failed, exchanges=self._exchanges).start()
                return
            Steps(declare_steps(channel, self._topologies, self._exchanges, self._routes), self._on_declared).start()

        confirm_mode(channel, on_close=self._on_channel_closed, on_return=self._on_return,
                     on_confirm=self._on_confirm, then=confirming)

    def _on_declared(self) -> None:
        self._declared = True
        self._on_ready()

    def _missing_failed(self, reason: BaseException) -> None:
        """A reconnect's look at the topology got another answer than "exists" or "no such queue"
        (a queue whose home node is down, no quorum): an outage."""
        if isinstance(reason, pex.ChannelClosedByBroker) and reason.reply_code == 404:
            self._fail(BrokerUnavailable(f"a queue is not available: {reason.reply_text}"))
        else:
            self._fail(classify(reason, url=self.url))

    def _on_ready(self) -> None:
        self._ready = True
        self._check()

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel is not self._channel:  # one given up by renew_channel()
            return
        self._ready = False
        self._lose_pending(reason)
        self._fail(classify(reason, url=self.url))
        if self._conn is not None and self._conn.is_open:
            self._conn.close()

    def _on_closed(self, _conn: Any, reason: BaseException) -> None:
        self._ready = False
        self._conn = None
        self._lose_pending(reason)
        if not isinstance(reason, pex.ConnectionClosedByClient):
            self._fail(classify(reason, url=self.url))
        else:
            self._check()

    def _lose_pending(self, reason: BaseException) -> None:
        text = str(classify(reason, url=self.url))
        for index in self._pending.values():
            self._results[index] = PublishResult("unconfirmed", text)
        self._pending.clear()

    def _abort(self) -> None:
        if self._opening is not None:
            self._opening.abort()  # every address tried in turn is given up, not left connecting
            self._opening = None
        conn = self._conn
        if conn is not None and conn.is_open:
            conn.close()
            deadline, self._deadline = self._deadline, None  # closing gets its own timeout
            try:
                self._run_until(lambda: self._conn is None, "close the connection")
            finally:
                self._deadline = deadline
        # A connection still being set up (interrupted) is left to the loop's
        # close: pika cannot close one whose set-up is pending (its workflow asserts).
        self._conn = None
        self._ready = False

    def renew_channel(self) -> None:
        """Close the channel and publish on a new one of the same connection, in confirm mode.

        For a destination the broker nacked every message of: on some
        releases a channel that published to a quorum queue while its leader
        changed has every later message to that queue nacked, while a new
        channel is confirmed (docs/cluster.md). Nothing may await a confirm.
        Not connected: nothing to do (the next connect opens a new channel).
        Raises BrokerUnavailable (the connection is closed) or BrokerFatal.
        """
        conn = self._conn
        if conn is None or not conn.is_open or not self._ready:
            return
        if self._pending:
            raise RuntimeError("collect every batch sent before renewing the channel")
        old, self._channel, self._ready = self._channel, None, False
        if old is not None and old.is_open:
            old.close()

        def opened(channel: Any) -> None:
            self._channel = channel

            def confirming() -> None:
                self._seq = 0
                self._on_ready()

            confirm_mode(channel, on_close=self._on_channel_closed, on_return=self._on_return,
                         on_confirm=self._on_confirm, then=confirming)

        conn.channel(on_open_callback=opened)
        self._run_until(lambda: self._ready, "open a channel")
        if self._error is not None:
            error, self._error = self._error, None
            self._abort()
            raise error

    def interrupt(self) -> None:
        """End a :meth:`connect` waiting for the broker now (BrokerUnavailable);
        safe from a signal handler. Confirms already awaited are not cut short.
        Close the publisher afterwards."""
        self._wakeup.request(self._on_interrupt)

    def _on_interrupt(self) -> None:
        opening = self._opening is not None and self._opening.pending
        if (self._conn is not None or opening) and not self._ready and self._waiting is not None:
            self._fail(BrokerUnavailable("stopped while waiting for the broker"))

    # confirms and returns
    def _on_confirm(self, frame: Any) -> None:
        ack, settled = take_confirmed(frame, self._pending)
        for _tag, index in settled:
            if self._results[index] is None:  # not returned before its ack
                self._results[index] = PublishResult("confirmed") if ack else PublishResult(
                    "nacked", "the broker could not store the message")
        self._pump()
        self._check()

    def _on_return(self, _channel: Any, method: Any, props: Any, _body: bytes) -> None:
        # A basic.return precedes the ack of the same message; match it to the
        # oldest unconfirmed message with the same routing key and message_id.
        for tag in sorted(self._pending):
            index = self._pending[tag]
            msg = self._batch[index]
            if (msg.routing_key == method.routing_key and msg.message_id == props.message_id
                    and self._results[index] is None):
                self._results[index] = PublishResult(
                    "returned", f"unroutable: {method.reply_code} {method.reply_text}")
                break

    def _pump(self) -> None:
        channel = self._channel
        while self._next < len(self._batch) and len(self._pending) < self.window and self._ready:
            msg = self._batch[self._next]
            channel.basic_publish(msg.exchange, msg.routing_key, msg.body, properties(msg), mandatory=True)
            self._seq += 1
            self._pending[self._seq] = self._next
            self._next += 1

    def _connect_for(self, messages: Sequence[OutMessage]) -> list[PublishResult] | None:
        """Connect before publishing *messages*; None when connected, else the
        result of each (unconfirmed, or none at all when there are none)."""
        if not messages:
            return []
        try:
            self.connect()
        except BrokerUnavailable as exc:
            return [PublishResult("unconfirmed", str(exc)) for _ in messages]
        return None

    def publish(self, messages: Sequence[OutMessage], *, deadline: float | None = None) -> list[PublishResult]:
        """Publish *messages* in order; return one result per message.

        Connection loss is not raised: the affected messages come back
        ``unconfirmed`` (they may or may not have reached the queue), so the
        caller can retry them -- a duplicate is absorbed by the consumer's
        inbox, a loss would not be. *deadline* (a ``time.monotonic()`` value):
        no wait, connecting included, goes past it; what is not confirmed
        then comes back ``unconfirmed`` and the connection is closed.
        """
        self._deadline = deadline
        try:
            done = self._connect_for(messages)
            if done is not None:
                return done
            self._batch = messages
            self._results = [None] * len(messages)
            self._next = 0
            self._pump()
            self._run_until(lambda: self._next >= len(self._batch) and not self._pending, "confirm messages")
        finally:
            self._deadline = None
        reason = "not sent: the connection was lost first"
        if self._error is not None:
            error, self._error = self._error, None
            if not isinstance(error, BrokerFatal):  # what no confirm came for says why
                reason = f"not sent: {error}"
                for index in self._pending.values():
                    self._results[index] = PublishResult("unconfirmed", str(error))
                self._pending.clear()
            self._abort()
            if isinstance(error, BrokerFatal):
                raise error
        results = [r if r is not None else PublishResult("unconfirmed", reason) for r in self._results]
        self._batch, self._results = (), []
        return results

    def idle(self, seconds: float, wake: int | None = None) -> None:
        """Let the connection service heartbeats for *seconds*, or until the
        file descriptor *wake* is readable (the caller reads it)."""
        if self._conn is None:
            return
        deadline = [False]

        def done(*_args: object) -> None:
            deadline[0] = True
            self._check()

        handle = self._ioloop.call_later(seconds, done)
        if wake is not None:
            self._ioloop.add_handler(wake, done, PollEvents.READ)
        try:
            self._run_until(lambda: deadline[0], "idle")
        finally:
            self._ioloop.remove_timeout(handle)
            if wake is not None:
                self._ioloop.remove_handler(wake)
        self._error = None

    def close(self) -> None:
        self._error = None
        try:
            self._abort()
        finally:
            self._wakeup.close()
            self._ioloop.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Ticket:
    """A batch given to :meth:`StreamPublisher.send`: absolute message indexes."""

    start: int
    end: int


#: What pika raises while encoding one message's frames. pika marshals every
#: frame of a message before writing any (pika/connection.py, _send_message),
#: so such a message fails alone and the channel stays usable.
_UNENCODABLE = (pex.ShortStringTooLong, UnicodeError, struct.error, TypeError, ValueError, OverflowError)


class StreamPublisher(Publisher):
    """Publisher whose batches overlap; collect them in the order sent.

    :meth:`send` queues a batch behind the ones before it and returns at
    once; :meth:`collect` runs the loop until that batch is settled while
    later ones keep flowing. One channel, one window: the broker receives the
    batches in the order they were sent. A message pika cannot encode comes
    back ``unencodable``, alone.

    Connection loss is not raised by :meth:`collect`: the batch comes back
    ``unconfirmed`` (or "not sent"), and so do the batches sent after it,
    which the caller must collect before it connects again. BrokerFatal is
    raised.
    """

    def __init__(self, url: str = DEFAULT_URL, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._batch: list[OutMessage] = []
        self._offset = 0  # absolute index of self._batch[0]
        self._broken: str | None = None  # why the connection was given up

    def connect(self) -> None:
        if self._broken is not None:
            if self._batch:
                raise RuntimeError("collect every batch sent before connecting again")
            self._broken = None
            self._next, self._pending = 0, {}
        super().connect()

    def send(self, messages: Sequence[OutMessage]) -> Ticket:
        """Queue *messages* behind everything sent so far; returns at once
        (the loop, and with it the sending, runs inside :meth:`collect` and
        :meth:`idle`). Call :meth:`connect` first."""
        start = self._offset + len(self._batch)
        self._batch.extend(messages)
        self._results.extend([None] * len(messages))
        if self._broken is None:
            self._pump()
        return Ticket(start, start + len(messages))

    def collect(self, ticket: Ticket) -> list[PublishResult]:
        """Wait until every message of *ticket* is settled; its results, in order.

        Tickets are collected in the order they were sent.
        """
        if ticket.start != self._offset:
            raise ValueError("collect batches in the order they were sent")
        end = ticket.end - self._offset

        def settled() -> bool:  # pending is in sending order: its first entry is the oldest
            return self._next >= end and (not self._pending or next(iter(self._pending.values())) >= end)

        if self._broken is None and not self._ready:
            self._broken = "not connected"
        if self._broken is None:
            if self._error is None:  # (wait() may have met the error already)
                self._run_until(settled, "confirm messages")
            if self._error is not None:
                error, self._error = self._error, None
                self._broken = str(error)
                if not isinstance(error, BrokerFatal):  # what no confirm came for says why
                    for index in self._pending.values():
                        self._results[index] = PublishResult("unconfirmed", str(error))
                    self._pending.clear()
                self._abort()  # closing marks every (other) pending message unconfirmed
                if isinstance(error, BrokerFatal):
                    raise error
        reason = f"not sent: {self._broken}"
        results = [r if r is not None else PublishResult("unconfirmed", reason) for r in self._results[:end]]
        del self._batch[:end], self._results[:end]
        self._next = max(0, self._next - end)
        self._pending = {tag: index - end for tag, index in self._pending.items()}
        self._offset = ticket.end
        return results

    def wait(self, ticket: Ticket, wake: int) -> bool:
        """Run the loop until *ticket* is settled (True; also when the
        connection failed: :meth:`collect` says how) or the file descriptor
        *wake* is readable first (False; the caller reads it), so that the
        caller can send more behind it."""
        end = ticket.end - self._offset
        if self._broken is not None or not self._ready or self._error is not None:
            return True
        woken = [False]

        def settled() -> bool:
            return self._next >= end and (not self._pending or next(iter(self._pending.values())) >= end)

        def on_wake(*_args: object) -> None:
            woken[0] = True
            self._check()

        self._ioloop.add_handler(wake, on_wake, PollEvents.READ)
        try:
            self._run_until(lambda: woken[0] or settled(), "confirm messages")
        finally:
            self._ioloop.remove_handler(wake)
        return self._error is not None or settled() or not woken[0]

    def _pump(self) -> None:
        channel = self._channel
        while self._next < len(self._batch) and len(self._pending) < self.window and self._ready:
            msg = self._batch[self._next]
            try:
                channel.basic_publish(msg.exchange, msg.routing_key, msg.body, properties(msg), mandatory=True)
            except _UNENCODABLE as exc:  # a closed channel raises other errors: those propagate
                self._results[self._next] = PublishResult(
                    "unencodable", safe_reason(f"{type(exc).__name__}: {exc}", 120))
                self._next += 1
                continue
            self._seq += 1
            self._pending[self._seq] = self._next
            self._next += 1

    def __enter__(self) -> StreamPublisher:
        return self

    def publish(self, messages: Sequence[OutMessage], *, deadline: float | None = None) -> list[PublishResult]:
        """Publisher.publish's contract: one call, one settled batch."""
        self._deadline = deadline
        try:
            done = self._connect_for(messages)
            if done is not None:
                return done
            return self.collect(self.send(messages))
        finally:
            self._deadline = None
