"""What ``run``'s two processes say to each other over their pipe, and the
one table per process that dispatches it (docs/run.md lists the messages).

Each message is a small frozen dataclass, pickled by the pipe. Deliveries
travel as one message per turn of the connection's I/O loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..model.deliveries import Delivery, OutMessage

# -- connection process -> worker process ---------------------------------------------

#: One delivery without its generation: tag, body, routing key, redelivered,
#: message_id, headers (None when empty), content type, exchange, content encoding.
Packed = tuple[int, bytes, str, bool, str | None, dict[str, Any] | None, str | None, str, str | None]


def pack(d: Delivery) -> Packed:
    return (d.tag, d.body, d.routing_key, d.redelivered, d.message_id, d.headers or None, d.content_type,
            d.exchange, d.content_encoding)


@dataclass(frozen=True, slots=True)
class Deliveries:
    """Deliveries of channel *generation*, in tag order, as :func:`pack` made them."""

    generation: int
    items: Sequence[Packed]

    def unpack(self) -> list[Delivery]:
        gen = self.generation
        return [Delivery(gen, tag, body, key, redelivered, message_id, headers or {}, content_type, exchange,
                         encoding)
                for tag, body, key, redelivered, message_id, headers, content_type, exchange, encoding
                in self.items]


@dataclass(frozen=True, slots=True)
class ChannelOpened:
    """Channel *generation* consumes now (deliveries of older ones are void)."""

    generation: int


@dataclass(frozen=True, slots=True)
class ChannelLost:
    """Channel *generation* is gone: its unacked deliveries will be redelivered."""

    generation: int
    why: str


@dataclass(frozen=True, slots=True)
class CopiesSettled:
    """The broker confirmed the copies of *request* (*error* None), or did not."""

    request: int
    error: str | None


@dataclass(frozen=True, slots=True)
class Stop:
    """Finish the batch in hand and exit (SIGTERM, SIGINT)."""


ToWorker = Deliveries | ChannelOpened | ChannelLost | CopiesSettled | Stop

# -- worker process -> connection process ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The database is open: start consuming."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The worker stops for good; *outage*: the database stayed unusable (exit 75)."""

    message: str
    outage: bool = False


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledge up to *tag* on channel *generation*: everything up to it is committed."""

    generation: int
    tag: int
    multiple: bool = True


@dataclass(frozen=True, slots=True)
class PublishCopies:
    """Publish *messages* (retry / dead copies) on the confirm channel; answer CopiesSettled."""

    request: int
    generation: int
    messages: Sequence[OutMessage]


@dataclass(frozen=True, slots=True)
class Reconnect:
    """Drop the connection (a copy was not confirmed): the broker redelivers the rest."""

    why: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop consuming and close the connection: the worker has exited its loop."""


@dataclass(frozen=True, slots=True)
class Vitals:
    """The worker's metrics (exposition text) made at Unix time *at*, about once a second."""

    at: float
    metrics: bytes


ToConnection = Ready | Failed | Ack | PublishCopies | Reconnect | Shutdown | Vitals

# -- dispatching ----------------------------------------------------------------------

M = TypeVar("M")
_B = TypeVar("_B")


class ProtocolError(Exception):
    """A message no handler is registered for (a bug, not a runtime condition)."""


class Dispatch(Generic[_B]):
    """Message type -> handler: the one place a process decides what a message means."""

    def __init__(self, default: Callable[[Any], None] | None = None) -> None:
        self._handlers: dict[type[Any], Callable[[Any], None]] = {}
        self._default = default

    def on(self, kind: type[M], handler: Callable[[M], None]) -> Dispatch[_B]:
        self._handlers[kind] = handler
        return self

    def __call__(self, message: _B) -> None:
        handler = self._handlers.get(type(message), self._default)
        if handler is None:
            raise ProtocolError(f"no handler for {type(message).__name__}")
        handler(message)
