"""One-shot administrative calls: declare a topology, count queues, delete unused ones and exchanges.

Queue counts come from a passive declare per queue, which needs no plugin:
ready messages and consumers (the unacknowledged count is only in the
management API). Used by ``topology declare``, ``status``, the console, the
metrics and ``repartition``.

:func:`queue_states` asks each queue under a deadline of its own (the
connection's handshake, then each passive declare): a queue that does not
answer in time, or that the broker cannot serve (home node down, no quorum,
locked), is :class:`Unreadable` with the reason, and the others are still asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import pika.exceptions as pex

from ..model.errors import BrokerError
from .connection import FAILURES, Addresses, classify, open_blocking
from .publisher import Publisher
from .topology import Route, Topology


def done_unless_refused(call: Callable[[], object], code: int, *words: str) -> bool:
    """Make *call* on a channel: True when done, False when the broker refused it by closing
    the channel with *code* (and every one of *words* in its reply); any other failure raises.
    A refused channel is closed: the caller opens a new one for its next call."""
    try:
        call()
    except pex.ChannelClosedByBroker as exc:
        if exc.reply_code == code and all(word in exc.reply_text for word in words):
            return False
        raise
    return True


def declare(url: str, topologies: Sequence[Topology], *, exchanges: Sequence[str] = (),
            routes: Sequence[Route] = ()) -> None:
    """Declare exchanges and queues idempotently (and add or remove the
    bindings of *routes*), then disconnect."""
    with Publisher(url, topologies=topologies, exchanges=exchanges, routes=routes,
                   name="delivery-consumer topology") as pub:
        pub.connect()


@dataclass(frozen=True, slots=True)
class QueueCount:
    """What a passive declare tells about one queue."""

    ready: int
    consumers: int


def queue_counts(url: str, queues: Sequence[str], *, name: str = "delivery-consumer status",
                 timeout_s: float = 10.0) -> dict[str, QueueCount | None]:
    """Ready messages and consumers of each queue; None for a queue that does not exist."""
    out: dict[str, QueueCount | None] = {}
    with _connection(url, name, timeout_s=timeout_s) as conn:
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
    return out


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A queue the broker did not let us read: why, in a few words."""

    reason: str


#: What :func:`queue_states` tells about a queue: its counts, None (no such queue), or why it cannot be read.
QueueState = QueueCount | Unreadable | None


def queue_states(url: str, queues: Sequence[str], *, name: str = "delivery-consumer status",
                 timeout_s: float = 5.0, silent_max: int = 2) -> dict[str, QueueState]:
    """Each queue's counts, None for a queue that does not exist, or :class:`Unreadable`.

    Every broker call has its own deadline of *timeout_s*: the connection
    (TCP and the AMQP handshake), then each passive declare. A declare that
    does not answer in time (a queue whose node is paused or partitioned away)
    makes that queue unreadable, and the next queues are asked on a new
    connection; a connection that cannot be made makes every queue not yet
    asked unreadable with its reason. After *silent_max* declares that did not
    answer, the queues left are not asked (unreadable: unknown). So the whole
    call takes at most about ``(silent_max + 1) * timeout_s`` plus the answers.
    """
    out: dict[str, QueueState] = {}
    left = list(dict.fromkeys(queues))
    silent = 0
    while left:
        if silent >= silent_max:
            reason = f"not asked ({silent} queues before it did not answer within {timeout_s:g}s)"
            out.update({queue: Unreadable(reason) for queue in left})
            break
        try:
            conn = _open(url, name, timeout_s)
        except BrokerError as exc:
            reason = _no_answer(timeout_s) if "within the connection timeout" in str(exc) else str(exc)
            out.update({queue: Unreadable(reason) for queue in left})
            break
        try:
            left = _declare_each(conn, left, out, timeout_s)
        finally:
            _drop(conn)
        silent = sum(1 for state in out.values() if state == Unreadable(_no_answer(timeout_s)))
    return {queue: out[queue] for queue in dict.fromkeys(queues)}


def _no_answer(timeout_s: float) -> str:
    return f"unavailable (no answer within {timeout_s:g}s)"


#: 404 answers that name a queue which exists but cannot be served now (not "no queue").
_UNAVAILABLE_404 = ("home node", "down or inaccessible", "not available", "timeout")


class _Expired(Exception):
    """A broker call that did not answer within its deadline (its connection is dropped)."""


def _within(conn: Any, timeout_s: float, call: Callable[[], Any]) -> Any:
    """*call* (a blocking call on *conn*), or :class:`_Expired` when the broker does not answer
    within *timeout_s*: pika's own loop runs the timer while the call waits, and the timer drops
    the connection's socket, which ends the wait."""
    expired = [False]

    def expire() -> None:
        expired[0] = True
        _abort(conn)

    timer = conn._impl.ioloop.call_later(timeout_s, expire)
    try:
        return call()
    except FAILURES:
        if expired[0]:
            raise _Expired from None
        raise
    finally:
        with suppress(Exception):
            conn._impl.ioloop.remove_timeout(timer)


def _declare_each(conn: Any, queues: list[str], out: dict[str, QueueState], timeout_s: float) -> list[str]:
    """Declare *queues* passively one after the other on *conn*; the queues left to ask
    on a new connection (after one that did not answer in time), else []."""
    channel = None
    for i, queue in enumerate(queues):
        try:
            if channel is None:
                channel = _within(conn, timeout_s, conn.channel)
            declare = partial(channel.queue_declare, queue, passive=True)
            frame = _within(conn, timeout_s, declare)
        except pex.ChannelClosedByBroker as exc:
            text = f"{exc.reply_code} {exc.reply_text}"
            if exc.reply_code == 404 and not any(word in exc.reply_text for word in _UNAVAILABLE_404):
                out[queue] = None
            else:
                out[queue] = Unreadable(f"unavailable ({text})")
            channel = None  # a refused passive declare closes the channel
            continue
        except _Expired:
            out[queue] = Unreadable(_no_answer(timeout_s))
            return queues[i + 1:]
        except FAILURES as exc:
            out[queue] = Unreadable(f"unavailable ({classify(exc)})")
            return queues[i + 1:]
        out[queue] = QueueCount(int(frame.method.message_count), int(frame.method.consumer_count))
    return []


def _open(url: str, name: str, timeout_s: float) -> Any:
    """A connection made within *timeout_s* (TCP connect and AMQP handshake), else BrokerError."""
    try:
        addrs = Addresses(url, name=name)
        _timed(addrs.params, timeout_s)
        return open_blocking(addrs)  # each address under its own deadline, in the client's order
    except FAILURES as exc:
        raise classify(exc, url=url) from None


def _timed(params: Any, timeout_s: float) -> Any:
    """*params* (one set or a list of them) with every connection deadline set to *timeout_s*."""
    for each in params if isinstance(params, list) else [params]:
        each.socket_timeout = each.stack_timeout = each.blocked_connection_timeout = timeout_s
    return params


def _abort(conn: Any) -> None:
    """Drop *conn*'s socket now, without the closing handshake a silent broker would never answer
    (as pika itself does when heartbeats stop)."""
    if conn.is_open:
        conn._impl._terminate_stream(pex.StreamLostError("the broker did not answer within the deadline"))


def _drop(conn: Any) -> None:
    """Close *conn* if it is still open, waiting at most a second for a broker that does not answer."""
    if not conn.is_open:
        return
    timer = conn._impl.ioloop.call_later(1.0, lambda: _abort(conn))
    with suppress(*FAILURES):
        conn.close()
    with suppress(Exception):
        conn._impl.ioloop.remove_timeout(timer)


@contextmanager
def _connection(url: str, name: str, *, timeout_s: float | None = None) -> Iterator[Any]:
    """A short connection for one administrative call; pika's failures leave classified."""
    conn: Any = None
    try:
        addrs = Addresses(url, name=name)
        if timeout_s is not None:
            for params in addrs.params:
                params.socket_timeout = params.stack_timeout = params.blocked_connection_timeout = timeout_s
        conn = open_blocking(addrs)
        yield conn
    except FAILURES as exc:
        raise classify(exc, url=url) from None
    finally:
        if conn is not None and conn.is_open:
            with suppress(*FAILURES):
                conn.close()


def exchange_exists(url: str, exchange: str, *, name: str = "delivery-consumer topology") -> bool:
    """Whether *exchange* exists (a passive declare)."""
    with _connection(url, name) as conn:
        return done_unless_refused(lambda: conn.channel().exchange_declare(exchange, passive=True), 404)


def delete_exchanges(url: str, exchanges: Sequence[str], *, name: str = "delivery-consumer topology") -> None:
    """Delete *exchanges* (deleting one that does not exist does nothing)."""
    with _connection(url, name) as conn:
        channel = conn.channel()
        for exchange in exchanges:
            channel.exchange_delete(exchange)


def delete_unused_queues(url: str, queues: Sequence[str]) -> list[str]:
    """Delete each queue that is empty and has no consumer; returns those kept.

    Checked with a passive declare just before the delete: quorum queues
    refuse the ``if-unused`` flag (540 NOT_IMPLEMENTED on RabbitMQ 3.10).
    """
    kept = []
    states = queue_counts(url, queues, name="delivery-consumer repartition")
    try:
        conn = open_blocking(Addresses(url, name="delivery-consumer delete queues"))
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
    except FAILURES as exc:
        raise classify(exc, url=url) from None
    return kept
