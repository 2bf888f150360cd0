"""What ``run``, its metrics and the dead-queue tools share about a delivery,
without importing ``run``: the key of a message in the ``deliveries`` table
and the hooks through which ``run`` reports what it did (:class:`Observer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from .envelope import body_digest

if TYPE_CHECKING:
    from .contract import Outcome

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


#: Makes the observer in the worker process (where metrics live).
ObserverFactory = Callable[[], Observer]
