"""One-shot administrative calls: declare a topology, count queues, delete unused ones and exchanges.

Queue counts come from a passive declare per queue, which needs no plugin:
ready messages and consumers (the unacknowledged count is only in the
management API). Used by ``topology declare``, ``status``, the console, the
metrics and ``repartition``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import pika.exceptions as pex

from ..topology import Route, Topology
from .connection import FAILURES, Addresses, classify, open_blocking
from .publisher import Publisher


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
        try:
            conn.channel().exchange_declare(exchange, passive=True)
        except pex.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return False
            raise
        return True


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
