"""RabbitMQ transport: the only module that imports pika.

It hands the rest of the code plain objects (:class:`Delivery`,
:class:`OutMessage`, :class:`PublishResult`) and the project's own errors:
:class:`BrokerUnavailable` (try again later) and :class:`BrokerFatal` (bad
credentials, missing vhost, a queue declared with other arguments: retrying
cannot help).

Two pieces, both on pika's ``SelectConnection`` (an I/O loop with callbacks),
because it services heartbeats whatever the application does and lets
publisher confirms be pipelined -- ``BlockingChannel.basic_publish`` waits
for each confirm in turn:

* :class:`Publisher` -- a synchronous facade for commands (``publish``, the
  outbox dispatcher, dead-letter requeue): publish many persistent, mandatory
  messages with a window of unconfirmed ones, and learn the fate of each.
* :class:`ConsumerIO` -- the connection side of ``run``: owns the loop in the
  calling thread, reconnects with backoff and jitter, hands deliveries to a
  callback, and takes acks and copy publications from the worker thread only
  through ``add_callback_threadsafe`` (pika is not thread-safe:
  https://github.com/pika/pika/blob/1.4.4/docs/faq.rst). Delivery tags belong
  to one channel: each channel gets a *generation* number and an ack for an
  older generation is dropped, never sent (the broker redelivers those
  messages and the inbox absorbs them).
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions as pex
from pika import spec
from pika.adapters.select_connection import IOLoop, PollEvents

from .errors import DeliveryError, safe_reason
from .retry import reconnect_delay_s
from .topology import Binding, Route, Topology

log = logging.getLogger("delivery_consumer.broker")

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
PERSISTENT = 2

# AMQP reply codes (https://www.rabbitmq.com/amqp-0-9-1-reference#constants).
_FATAL_REPLY_CODES = {
    403: "access refused",
    404: "not found",
    406: "precondition failed",
    530: "not allowed (missing vhost or no permission)",
}


class BrokerError(DeliveryError):
    """Something went wrong talking to RabbitMQ."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached or dropped us; retrying later may work."""


class BrokerFatal(BrokerError):
    """Retrying cannot help: credentials, vhost, permissions, queue arguments."""


@dataclass(slots=True)
class OutMessage:
    """A message to publish: persistent, mandatory, with a message_id."""

    routing_key: str
    body: bytes
    exchange: str = ""
    message_id: str | None = None
    headers: dict[str, Any] | None = None
    content_type: str = "application/json"
    content_encoding: str | None = None

    def properties(self) -> pika.BasicProperties:
        return pika.BasicProperties(
            delivery_mode=PERSISTENT,
            content_type=self.content_type,
            content_encoding=self.content_encoding,
            message_id=self.message_id,
            headers=self.headers or None,
        )


@dataclass(slots=True)
class PublishResult:
    """The fate of one published message."""

    status: str  # "confirmed" | "returned" | "nacked" | "unconfirmed" | "unencodable"
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "confirmed"


@dataclass(slots=True)
class Delivery:
    """One message received by ``run``, with its channel generation."""

    generation: int
    tag: int
    body: bytes
    routing_key: str
    redelivered: bool
    message_id: str | None
    headers: dict[str, Any]
    content_type: str | None = None
    exchange: str = ""
    content_encoding: str | None = None


def parameters(url: str, *, name: str) -> pika.URLParameters:
    """Connection parameters from an AMQP URL, named for the management UI."""
    try:
        params = pika.URLParameters(url)
    except Exception as exc:  # pika raises assorted errors for a bad URL
        raise BrokerFatal(f"invalid AMQP URL: {exc}") from None
    params.client_properties = {"connection_name": name, "product": "delivery-consumer"}
    if params.blocked_connection_timeout is None:
        # A broker under a resource alarm blocks publishers; do not hang forever.
        params.blocked_connection_timeout = 60
    return params


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        params = pika.URLParameters(url)
    except Exception:
        return "<invalid url>"
    vhost = params.virtual_host
    user = getattr(params.credentials, "username", "?")
    return f"amqp://{user}@{params.host}:{params.port}/{vhost}"


def _innermost(exc: BaseException) -> BaseException:
    """pika wraps a refused socket in two or three layers; find the cause."""
    for _ in range(5):
        inner: BaseException | None = None
        failures = getattr(exc, "exceptions", None)
        wrapped = getattr(exc, "exception", None)  # a connector phase error
        if failures:
            inner = failures[-1]
        elif isinstance(wrapped, BaseException):
            inner = wrapped
        elif exc.args and isinstance(exc.args[0], BaseException):
            inner = exc.args[0]
        if inner is None or isinstance(exc, (pex.ProbableAuthenticationError, pex.AuthenticationError,
                                              pex.ProbableAccessDeniedError)):
            return exc
        exc = inner
    return exc


def classify(exc: BaseException | None, *, url: str = "") -> BrokerError:
    """Map a pika failure to BrokerFatal or BrokerUnavailable, with one clear line."""
    where = f" ({redact(url)})" if url else ""
    if isinstance(exc, BrokerError):
        return exc
    if exc is not None:
        exc = _innermost(exc)
    if isinstance(exc, (pex.ProbableAuthenticationError, pex.AuthenticationError)):
        return BrokerFatal(f"authentication failed{where}: check the user and password")
    if isinstance(exc, pex.ProbableAccessDeniedError):
        return BrokerFatal(f"access denied{where}: the vhost does not exist or the user may not use it")
    if isinstance(exc, pex.IncompatibleProtocolError):
        return BrokerFatal(f"not an AMQP 0-9-1 server{where}")
    if isinstance(exc, (pex.ConnectionClosedByBroker, pex.ChannelClosedByBroker)):
        code, text = exc.reply_code, exc.reply_text
        if code in _FATAL_REPLY_CODES:
            return BrokerFatal(f"broker refused{where}: {code} {_FATAL_REPLY_CODES[code]}: {text}")
        return BrokerUnavailable(f"broker closed the connection{where}: {code} {text}")
    if exc is None:
        return BrokerUnavailable(f"connection lost{where}")
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return BrokerUnavailable(f"broker unreachable{where}: {text}")


# -- topology ------------------------------------------------------------------


Step = Callable[[Callable[[Any], None]], None]


class _Steps:
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


# -- publisher -------------------------------------------------------------------


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
        self._params = parameters(url, name=name)
        self._topologies = list(topologies)
        self._exchanges = list(exchanges)
        self._routes = list(routes)
        self._timeout_s = timeout_s
        self.window = window
        self._ioloop = IOLoop()
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

    # loop driving
    def _check(self) -> None:
        if self._waiting is not None and (self._error is not None or self._waiting()):
            self._waiting = None
            self._ioloop.stop()

    def _run_until(self, done: Callable[[], bool], what: str) -> None:
        if self._error is None and done():
            return
        self._waiting = done
        handle = self._ioloop.call_later(self._timeout_s, lambda: self._fail(BrokerUnavailable(
            f"timed out after {self._timeout_s:g}s waiting for the broker to {what}")))
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
        self._conn = pika.SelectConnection(
            self._params,
            on_open_callback=self._on_open,
            on_open_error_callback=lambda _c, exc: self._fail(classify(exc, url=self.url)),
            on_close_callback=self._on_closed,
            custom_ioloop=self._ioloop,
        )
        self._run_until(lambda: self._ready, "open the connection")
        if self._error is not None:
            error, self._error = self._error, None
            self._abort()
            raise error

    def _on_open(self, conn: pika.SelectConnection) -> None:
        conn.channel(on_open_callback=self._on_channel)

    def _on_channel(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)

        def confirmed(_frame: Any) -> None:
            self._seq = 0
            _Steps(declare_steps(channel, self._topologies, self._exchanges, self._routes), self._on_ready).start()

        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=confirmed)

    def _on_ready(self) -> None:
        self._ready = True
        self._check()

    def _on_channel_closed(self, _channel: Any, reason: BaseException) -> None:
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
        conn = self._conn
        if conn is not None and not (conn.is_closed or conn.is_closing):
            conn.close()
            self._run_until(lambda: self._conn is None, "close the connection")
        self._conn = None
        self._ready = False

    # confirms and returns
    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        ack = isinstance(method, spec.Basic.Ack)
        tags = [t for t in self._pending if t <= method.delivery_tag] if method.multiple else [method.delivery_tag]
        for tag in tags:
            index = self._pending.pop(tag, None)
            if index is None:
                continue
            previous = self._results[index]
            if previous is None:  # not returned before its ack
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
            channel.basic_publish(msg.exchange, msg.routing_key, msg.body, msg.properties(), mandatory=True)
            self._seq += 1
            self._pending[self._seq] = self._next
            self._next += 1

    def publish(self, messages: Sequence[OutMessage]) -> list[PublishResult]:
        """Publish *messages* in order; return one result per message.

        Connection loss is not raised: the affected messages come back
        ``unconfirmed`` (they may or may not have reached the queue), so the
        caller can retry them -- a duplicate is absorbed by the consumer's
        inbox, a loss would not be.
        """
        if not messages:
            return []
        try:
            self.connect()
        except BrokerUnavailable as exc:
            return [PublishResult("unconfirmed", str(exc)) for _ in messages]
        self._batch = messages
        self._results = [None] * len(messages)
        self._next = 0
        self._pump()
        self._run_until(lambda: self._next >= len(self._batch) and not self._pending, "confirm messages")
        if self._error is not None:
            if isinstance(self._error, BrokerFatal):
                error, self._error = self._error, None
                self._abort()
                raise error
            self._error = None
            self._abort()
        reason = "not sent: the connection was lost first"
        results = [r if r is not None else PublishResult("unconfirmed", reason) for r in self._results]
        self._batch, self._results = (), []
        return results

    def idle(self, seconds: float) -> None:
        """Let the connection service heartbeats for *seconds*."""
        if self._conn is None:
            return
        deadline = [False]

        def wake() -> None:
            deadline[0] = True
            self._check()

        self._ioloop.call_later(seconds, wake)
        self._run_until(lambda: deadline[0], "idle")
        self._error = None

    def close(self) -> None:
        self._error = None
        try:
            self._abort()
        finally:
            self._ioloop.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def declare(url: str, topologies: Sequence[Topology], *, exchanges: Sequence[str] = (),
            routes: Sequence[Route] = ()) -> None:
    """Declare exchanges and queues idempotently (and add or remove the
    bindings of *routes*), then disconnect."""
    with Publisher(url, topologies=topologies, exchanges=exchanges, routes=routes,
                   name="delivery-consumer topology") as pub:
        pub.connect()


# -- consumer connection -------------------------------------------------------------


@dataclass
class _PendingCopies:
    future: Future[None]
    remaining: set[int] = field(default_factory=set)
    failure: str | None = None


class ConsumerIO:
    """The connection side of ``run``; :meth:`run` owns the calling thread.

    *on_delivery* is called in the loop thread for each message and must not
    block (it hands the delivery to the worker). *on_channel* is told the new
    generation after every (re)connect, *on_lost* the generation that died.
    """

    def __init__(
        self,
        url: str,
        topology: Topology,
        *,
        prefetch: int,
        on_delivery: Callable[[Delivery], None],
        on_channel: Callable[[int], None] = lambda gen: None,
        on_lost: Callable[[int, str], None] = lambda gen, why: None,
        name: str = "delivery-consumer run",
        retry_first_connect: bool = True,
    ) -> None:
        self.url = url
        self.topology = topology
        self.prefetch = prefetch
        self._params = parameters(url, name=name)
        self._on_delivery = on_delivery
        self._on_channel_cb = on_channel
        self._on_lost = on_lost
        self.ioloop = IOLoop()
        self._conn: pika.SelectConnection | None = None
        self._channel: Any = None  # consuming channel (acks go here)
        self._pub: Any = None  # confirm-mode channel for retry / dead copies
        self._pub_seq = 0
        self._pub_pending: dict[int, _PendingCopies] = {}
        self._consumer_tag: str | None = None
        self.generation = 0
        self._live_generation = 0  # 0 while no channel is consuming
        self._stopping = False
        self._failures = 0
        #: False: a failure before the first successful consume is fatal (a
        #: one-shot run with a wrong address must say so, not wait forever).
        self._retry_first_connect = retry_first_connect
        self._ever_consumed = False
        self.fatal: BrokerError | None = None
        self.connected = threading.Event()

    # -- lifecycle (loop thread) --
    def run(self) -> None:
        """Connect and consume until :meth:`shutdown`; raises BrokerFatal."""
        self._connect()
        self.ioloop.start()
        self.ioloop.close()
        if self.fatal is not None:
            raise self.fatal

    def _connect(self) -> None:
        if self._stopping:
            self.ioloop.stop()
            return
        self._conn = pika.SelectConnection(
            self._params,
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_closed,
            custom_ioloop=self.ioloop,
        )

    def _retry_later(self, why: BrokerError) -> None:
        if isinstance(why, BrokerFatal) or not (self._ever_consumed or self._retry_first_connect):
            self.fatal = why
            self._stopping = True
            self.ioloop.stop()
            return
        if self._stopping:
            self.ioloop.stop()
            return
        self._failures += 1
        delay = reconnect_delay_s(self._failures)
        log.warning("%s; reconnecting in %.1fs (attempt %d)", why, delay, self._failures)
        self.ioloop.call_later(delay, self._connect)

    def _on_open_error(self, _conn: Any, exc: BaseException) -> None:
        self._conn = None
        self._retry_later(classify(exc, url=self.url))

    def _on_open(self, conn: pika.SelectConnection) -> None:
        conn.channel(on_open_callback=self._on_consume_channel)

    def _on_consume_channel(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_cancel_callback(lambda _f: self._reconnect("the broker cancelled the consumer"))
        _Steps(
            declare_steps(channel, [self.topology]),
            lambda: self._conn.channel(on_open_callback=self._on_pub_channel) if self._conn else None,
        ).start()

    def _on_pub_channel(self, channel: Any) -> None:
        self._pub = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)

        def confirmed(_frame: Any) -> None:
            self._pub_seq = 0
            self._channel.basic_qos(prefetch_count=self.prefetch, callback=self._on_qos)

        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=confirmed)

    def _on_qos(self, _frame: Any) -> None:
        if self._stopping:
            self._close()
            return
        self.generation += 1
        gen = self.generation
        self._on_channel_cb(gen)
        self._live_generation = gen
        self._consumer_tag = self._channel.basic_consume(
            self.topology.queue,
            lambda _ch, method, props, body: self._deliver(gen, method, props, body),
            auto_ack=False,
        )
        self._failures = 0
        self._ever_consumed = True
        self.connected.set()
        log.info("consuming %s (prefetch %d, channel generation %d)", self.topology.queue, self.prefetch, gen)

    def _deliver(self, gen: int, method: Any, props: Any, body: bytes) -> None:
        self._on_delivery(
            Delivery(
                generation=gen,
                tag=method.delivery_tag,
                body=body,
                routing_key=method.routing_key,
                redelivered=method.redelivered,
                message_id=props.message_id,
                headers=props.headers or {},
                content_type=props.content_type,
                exchange=method.exchange,
                content_encoding=props.content_encoding,
            )
        )

    def _on_channel_closed(self, _channel: Any, reason: BaseException) -> None:
        if self._stopping and isinstance(reason, pex.ChannelClosedByClient):
            return
        error = classify(reason, url=self.url)
        if self._live_generation == 0 and isinstance(error, BrokerFatal):
            # Failed while declaring: the topology is incompatible; retrying cannot help.
            self.fatal = error
            self._stopping = True
        else:
            log.error("channel closed: %s", error)
        self._close()

    def _on_closed(self, _conn: Any, reason: BaseException) -> None:
        gen, self._live_generation = self._live_generation, 0
        self.connected.clear()
        self._conn = self._channel = self._pub = None
        self._consumer_tag = None
        why = str(classify(reason, url=self.url))
        for pending in list(self._pub_pending.values()):
            self._settle(pending, f"connection lost before the confirm: {why}")
        self._pub_pending.clear()
        if gen:
            self._on_lost(gen, why)
        if self._stopping:
            self.ioloop.stop()
        elif isinstance(reason, pex.ConnectionClosedByClient):
            self._retry_later(BrokerUnavailable("reconnecting after a channel error"))
        else:
            self._retry_later(classify(reason, url=self.url))

    def _close(self) -> None:
        conn = self._conn
        if conn is not None and not (conn.is_closing or conn.is_closed):
            conn.close()
        elif conn is None and self._stopping:
            self.ioloop.stop()

    def _reconnect(self, why: str) -> None:
        log.warning("%s; reconnecting", why)
        self._close()

    # -- thread-safe API (called from the worker) --
    def ack(self, generation: int, tag: int, *, multiple: bool = True) -> None:
        """Acknowledge up to *tag* on channel *generation*, if it still lives."""
        self.ioloop.add_callback_threadsafe(lambda: self._ack(generation, tag, multiple))

    def publish_copies(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]:
        """Publish *messages* on the confirm channel; the future resolves when
        every one is confirmed, or fails (BrokerUnavailable) if any was
        returned, nacked or lost -- or if *generation* is no longer live."""
        future: Future[None] = Future()
        self.ioloop.add_callback_threadsafe(lambda: self._publish(generation, list(messages), future))
        return future

    def reconnect(self, why: str) -> None:
        """Drop the connection (unacked deliveries return to the queue)."""
        self.ioloop.add_callback_threadsafe(lambda: self._reconnect(why))

    def shutdown(self) -> None:
        """Stop consuming, close the connection and end :meth:`run`."""
        self.ioloop.add_callback_threadsafe(self._shutdown)

    def cancel(self) -> None:
        """Stop receiving new deliveries (the connection stays for acks)."""
        self.ioloop.add_callback_threadsafe(self._cancel)

    # -- loop-thread API (for code already running in the loop, e.g. a watched pipe) --
    def soon(self, callback: Callable[[], None]) -> None:
        """Call *callback* on the next turn of the loop (after the current events)."""
        self.ioloop.call_later(0, callback)

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Call *on_readable* in the loop whenever *fd* has data."""
        self.ioloop.add_handler(fd, lambda _fd, _events: on_readable(), PollEvents.READ)

    def unwatch(self, fd: int) -> None:
        self.ioloop.remove_handler(fd)

    def ack_now(self, generation: int, tag: int, *, multiple: bool = True) -> None:
        self._ack(generation, tag, multiple)

    def publish_now(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]:
        future: Future[None] = Future()
        self._publish(generation, list(messages), future)
        return future

    def reconnect_now(self, why: str) -> None:
        self._reconnect(why)

    def shutdown_now(self) -> None:
        self._shutdown()

    # -- loop-thread halves --
    def _ack(self, generation: int, tag: int, multiple: bool) -> None:
        channel = self._channel
        if generation != self._live_generation or channel is None or not channel.is_open:
            log.info("dropping ack of tag %d from channel generation %d (channel gone)", tag, generation)
            return
        channel.basic_ack(tag, multiple=multiple)

    def _publish(self, generation: int, messages: list[OutMessage], future: Future[None]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        pub = self._pub
        if generation != self._live_generation or pub is None or not pub.is_open:
            future.set_exception(BrokerUnavailable("the channel of these deliveries is gone"))
            return
        pending = _PendingCopies(future)
        for msg in messages:
            pub.basic_publish(msg.exchange, msg.routing_key, msg.body, msg.properties(), mandatory=True)
            self._pub_seq += 1
            pending.remaining.add(self._pub_seq)
            self._pub_pending[self._pub_seq] = pending

    def _on_return(self, _channel: Any, method: Any, _props: Any, _body: bytes) -> None:
        # The return precedes the ack of the same message; the oldest pending
        # group is the one it belongs to (copies are confirmed in order).
        if self._pub_pending:
            first = self._pub_pending[min(self._pub_pending)]
            first.failure = f"copy to {method.routing_key} unroutable: {method.reply_code} {method.reply_text}"

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        ack = isinstance(method, spec.Basic.Ack)
        tags = [t for t in self._pub_pending if t <= method.delivery_tag] if method.multiple else [
            method.delivery_tag]
        for tag in tags:
            pending = self._pub_pending.pop(tag, None)
            if pending is None:
                continue
            pending.remaining.discard(tag)
            if not ack:
                pending.failure = pending.failure or "the broker nacked a copy"
            if not pending.remaining:
                self._settle(pending, pending.failure)

    @staticmethod
    def _settle(pending: _PendingCopies, failure: str | None) -> None:
        if pending.future.done():
            return
        if failure:
            pending.future.set_exception(BrokerUnavailable(failure))
        else:
            pending.future.set_result(None)

    def _cancel(self) -> None:
        channel = self._channel
        if channel is not None and channel.is_open and self._consumer_tag is not None:
            channel.basic_cancel(self._consumer_tag)
            self._consumer_tag = None

    def _shutdown(self) -> None:
        self._stopping = True
        self._cancel()
        if self._conn is None:
            self.ioloop.stop()
        else:
            self._close()


# =============================================================================
# Dead-letter queue access: ``dead list / requeue / purge`` and ``inbox prune``
# (issue 4). Kept in this section, apart from the rest of the module.
#
# A dead queue is read by one *exclusive* consumer that takes every message
# without acknowledging it. Whatever is not acknowledged goes back when the
# connection closes -- also when the process is killed -- and a classic queue
# (see topology.py) puts it back in its original position. A second reader is
# refused by the broker (403 "in exclusive use"), which serialises the dead
# commands and the prune's dead-queue check without any lock of our own.
# =============================================================================


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
        self._params = parameters(url, name=name)
        self._settle_s = settle_s
        self._timeout_s = timeout_s
        self._conn: Any = None
        self._channel: Any = None  # consuming channel: deliveries and acks
        self._pub: Any = None  # confirm-mode channel for copies
        self._held: list[HeldMessage] = []
        self._consuming = False
        #: Ready messages when the reader attached, and the time (Unix) it did.
        self.count_at_open = 0
        self.opened_at = 0.0
        #: True when :meth:`read` returned every message present at :meth:`open`.
        self.complete = False

    def _error(self, exc: BaseException) -> BrokerError:
        if isinstance(exc, pex.ChannelClosedByBroker) and exc.reply_code == 404:
            return BrokerFatal(f"queue {self.queue} does not exist on {redact(self.url)} (wrong --queue-prefix? "
                               "run topology declare, or start the consumer once)")
        if isinstance(exc, pex.ChannelClosedByBroker) and exc.reply_code == 403 and "exclusive" in exc.reply_text:
            return QueueBusy(f"queue {self.queue} is in use by another reader (dead list/requeue/purge or "
                             "inbox prune); try again when it has finished")
        return classify(exc, url=self.url)

    def open(self, *, prefetch: int = 0) -> int:
        """Connect and start the exclusive consumer; returns the ready count.

        *prefetch* 0 lets the broker send every message (up to 65535 otherwise).
        """
        import time  # (imports of this section stay inside it)

        try:
            self._conn = pika.BlockingConnection(self._params)
            self._channel = self._conn.channel()
            self.opened_at = time.time()
            frame = self._channel.queue_declare(self.queue, passive=True)
            self.count_at_open = int(frame.method.message_count)
            self._channel.basic_qos(prefetch_count=min(max(prefetch, 0), 65535))
            self._channel.basic_consume(self.queue, self._on_message, auto_ack=False, exclusive=True)
            self._consuming = True
        except (pex.AMQPError, OSError) as exc:
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
        none arrived for a moment. Dead letters that arrive later stay at the
        tail, after everything returned here.
        """
        import time  # (imports of this section stay inside it)

        started = last_arrival = time.monotonic()
        seen = len(self._held)
        next_check = 0.0
        try:
            while max_messages is None or len(self._held) < max_messages:
                self._conn.process_data_events(time_limit=0.02)
                now = time.monotonic()
                if len(self._held) != seen:
                    seen, last_arrival = len(self._held), now
                if now >= next_check:
                    next_check = now + 0.05
                    if self._ready() == 0 and (seen >= self.count_at_open or now - last_arrival >= self._settle_s):
                        break
                if now - started > self._timeout_s:
                    raise BrokerUnavailable(f"timed out after {self._timeout_s:g}s reading {self.queue}")
        except (pex.AMQPError, OSError) as exc:
            raise self._error(exc) from None
        held = self._held if max_messages is None else self._held[:max_messages]
        # One consumer on a FIFO queue: the first count_at_open deliveries are
        # exactly the messages that were there when it attached.
        self.complete = len(held) >= self.count_at_open
        return list(held)

    def poll(self) -> list[HeldMessage]:
        """Messages that arrived since the last :meth:`read` or :meth:`poll`."""
        before = len(self._held)
        try:
            self._conn.process_data_events(time_limit=0)
        except (pex.AMQPError, OSError) as exc:
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
            self._pub.basic_publish(message.exchange, message.routing_key, message.body, message.properties(),
                                    mandatory=True)
        except pex.UnroutableError:
            return PublishResult("returned", f"unroutable: no queue {message.routing_key!r}")
        except pex.NackError:
            return PublishResult("nacked", "the broker could not store the message")
        except (pex.AMQPError, OSError) as exc:
            raise self._error(exc) from None
        return PublishResult("confirmed")

    def ack(self, tag: int) -> None:
        """Remove one held message from the queue."""
        try:
            self._channel.basic_ack(tag)
        except (pex.AMQPError, OSError) as exc:
            raise self._error(exc) from None

    def flush(self) -> None:
        """Make sure the acks so far were written to the broker."""
        try:
            self._conn.process_data_events(time_limit=0)
        except (pex.AMQPError, OSError) as exc:
            raise self._error(exc) from None

    def close(self) -> None:
        """Disconnect; every message not acknowledged returns to its place."""
        conn, self._conn = self._conn, None
        self._channel = self._pub = None
        self._held = []
        if conn is not None and conn.is_open:
            from contextlib import suppress  # (imports of this section stay inside it)

            with suppress(pex.AMQPError, OSError):  # the broker requeues when the socket goes
                conn.close()

    def __enter__(self) -> DeadQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# =============================================================================
# Overlapping batches for the outbox dispatcher. Kept in this section, apart
# from the rest of the module.
#
# Publisher.publish() returns when the last confirm of its batch is in, so a
# caller publishing batch after batch leaves the broker idle at every batch
# boundary: while the tail of the confirms comes back, and while the caller
# does its own work between batches (the dispatcher: two SQLite commits).
# StreamPublisher lets the next batch follow on the same channel before the
# previous one is settled: send() queues a batch and returns; collect() runs
# the loop until that batch is settled (later batches keep flowing) and
# returns its results. One channel, one window: the broker receives the
# batches in the order they were sent. It builds on Publisher's own state
# (window, confirm and return tracking); publish() keeps its contract.
#
# A message pika cannot encode (a routing key over 255 bytes, a lone
# surrogate) fails alone as "unencodable": pika marshals every frame of a
# message before writing any (pika/connection.py, _send_message), so nothing
# of it reached the wire and the channel stays usable.
# =============================================================================


@dataclass(frozen=True, slots=True)
class Ticket:
    """A batch given to :meth:`StreamPublisher.send`: absolute message indexes."""

    start: int
    end: int


#: What pika raises while encoding one message's frames.
_UNENCODABLE = (pex.ShortStringTooLong, UnicodeError, struct.error, TypeError, ValueError, OverflowError)


class StreamPublisher(Publisher):
    """Publisher whose batches overlap; collect them in the order sent.

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
            self._run_until(settled, "confirm messages")
            if self._error is not None:
                error, self._error = self._error, None
                self._broken = str(error)
                self._abort()  # closing marks every pending message unconfirmed
                if isinstance(error, BrokerFatal):
                    raise error
        reason = f"not sent: {self._broken}"
        results = [r if r is not None else PublishResult("unconfirmed", reason) for r in self._results[:end]]
        del self._batch[:end], self._results[:end]
        self._next = max(0, self._next - end)
        self._pending = {tag: index - end for tag, index in self._pending.items()}
        self._offset = ticket.end
        return results

    def _pump(self) -> None:
        channel = self._channel
        while self._next < len(self._batch) and len(self._pending) < self.window and self._ready:
            msg = self._batch[self._next]
            try:
                channel.basic_publish(msg.exchange, msg.routing_key, msg.body, msg.properties(), mandatory=True)
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

    def publish(self, messages: Sequence[OutMessage]) -> list[PublishResult]:
        """Publisher.publish's contract: one call, one settled batch."""
        if not messages:
            return []
        try:
            self.connect()
        except BrokerUnavailable as exc:
            return [PublishResult("unconfirmed", str(exc)) for _ in messages]
        return self.collect(self.send(messages))


# =============================================================================
# Queue counts for the system view (status, console): a passive declare per
# queue, which needs no plugin. It reports ready messages and consumers; the
# unacknowledged count is only in the management API.
# =============================================================================


@dataclass(frozen=True, slots=True)
class QueueCount:
    """What a passive declare tells about one queue."""

    ready: int
    consumers: int


def queue_counts(url: str, queues: Sequence[str], *, name: str = "delivery-consumer status",
                 timeout_s: float = 10.0) -> dict[str, QueueCount | None]:
    """Ready messages and consumers of each queue; None for a queue that does not exist."""
    params = parameters(url, name=name)
    params.socket_timeout = params.blocked_connection_timeout = timeout_s
    out: dict[str, QueueCount | None] = {}
    conn: Any = None
    try:
        conn = pika.BlockingConnection(params)
        channel = conn.channel()
        for queue in queues:
            try:
                frame = channel.queue_declare(queue, passive=True)
            except pex.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                out[queue] = None
                channel = conn.channel()  # a refused passive declare closes the channel
                continue
            out[queue] = QueueCount(int(frame.method.message_count), int(frame.method.consumer_count))
    except (pex.AMQPError, OSError) as exc:
        raise classify(exc, url=url) from None
    finally:
        if conn is not None and conn.is_open:
            from contextlib import suppress

            with suppress(pex.AMQPError, OSError):
                conn.close()
    return out


def delete_unused_queues(url: str, queues: Sequence[str]) -> list[str]:
    """Delete each queue that is empty and has no consumer; returns those kept.

    Checked with a passive declare just before the delete: quorum queues
    refuse the ``if-unused`` flag (540 NOT_IMPLEMENTED on RabbitMQ 3.10).
    """
    kept = []
    states = queue_counts(url, queues, name="delivery-consumer repartition")
    try:
        conn = pika.BlockingConnection(parameters(url, name="delivery-consumer delete queues"))
        try:
            channel = conn.channel()
            for queue, state in states.items():
                if state is None:
                    continue
                if state.ready or state.consumers:
                    kept.append(queue)
                    continue
                channel.queue_delete(queue)
        finally:
            if conn.is_open:
                conn.close()
    except (pex.AMQPError, OSError) as exc:
        raise classify(exc, url=url) from None
    return kept
