"""What ``run``, its metrics, the outbox and the dead-queue tools share about
a message, without importing ``run`` or pika: a message received
(:class:`Delivery`) or to publish (:class:`OutMessage`) and its fate
(:class:`PublishResult`), the key of a message in the ``deliveries`` table,
and the hooks through which ``run`` reports what it did (:class:`Observer`).
The broker's side of them is :mod:`delivery_consumer.amqp`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .envelope import body_digest

if TYPE_CHECKING:
    from .contract import Outcome



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


@dataclass(slots=True)
class PublishResult:
    """The fate of one published message."""

    status: str  # "confirmed" | "returned" | "nacked" | "unconfirmed" | "unencodable"
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "confirmed"


#: The longest message_id used as a key as it is; a longer one is replaced by the body's hash.
MAX_KEY_CHARS = 128


class Keyed(Protocol):
    """Anything with a message_id and a body: a delivery, a dead letter."""

    @property
    def message_id(self) -> str | None: ...

    @property
    def body(self) -> bytes: ...


def delivery_key(message: Keyed) -> str:
    """The key of a message in ``deliveries``: its message_id, or its body's hash."""
    if message.message_id and len(message.message_id) <= MAX_KEY_CHARS:
        return message.message_id
    return "sha256:" + body_digest(message.body)


class Observer:
    """Hooks for metrics; the default does nothing."""

    #: Whether :meth:`event_ages` is wanted (the worker computes ages only then).
    wants_ages: bool = False

    def event_ages(self, stamp: str, seconds: Sequence[float]) -> None:
        """Ages of a batch's events at its commit, from *stamp*: ``produced``
        (the outbox row's creation, header ``x-produced-ms``) or ``occurred``
        (the envelope's occurredAt, when the header is missing)."""

    def batch_committed(self, outcomes: Sequence[Outcome], seconds: float, committed_at: float = 0.0) -> None:
        """A batch was applied (*committed_at* is its Unix commit time, 0 if it failed)."""

    def copy_published(self, kind: str, code: str) -> None:
        """A retry or dead-letter copy was confirmed by the broker."""

    def connection_state(self, connected: bool) -> None:
        """The consumer started or stopped consuming."""

    def store_health(self, healthy: bool) -> None:
        """The database as a whole stopped (False) or started again (True) working."""

    def copies_held(self, count: int) -> None:
        """Deliveries held unacked because their retry or dead-letter copy was not accepted (yet)."""


#: Makes the observer in the worker process (where metrics live).
ObserverFactory = Callable[[], Observer]
