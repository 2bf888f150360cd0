"""delivery-consumer: RabbitMQ consumers that survive redelivery, duplicates,
out-of-order revisions and crashes, with one SQLite database per consumer.

The supported API is what this module exports (``__all__``), imported as
``from delivery_consumer import ConsumerSpec, Rejection, ...``, and the public
submodules :mod:`delivery_consumer.outbox` (the producer's outbox) and
:mod:`delivery_consumer.testing` (the test kit). Every other module is internal
and may move (docs/adding-a-consumer.md, "The API in one place").

Each name is imported on first use (``__getattr__``): ``import delivery_consumer``
loads none of the toolkit, so every command starts as fast as before, and pika
only comes with what runs a broker.

Follow an event by names: bytes -> :mod:`.envelope` -> :func:`.inbox.apply_batch`
-> :mod:`.consumers` (``catalog``, ``audit``, ...) -> receipt -> commit ->
:mod:`.amqp.consumer` acks (docs/architecture.md).
"""

from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from . import outbox, testing
    from .consumers import register
    from .model.contract import ApplyFn, ApplyManyFn, Connection, ConsumerSpec, View, dialect
    from .model.errors import (
        ConfigError,
        DatabaseError,
        DeliveryError,
        OutboxError,
        Rejection,
        TransientError,
    )
    from .model.event_ids import new_event_id
    from .model.event_types import MATERIAL, Envelope, EventType, EventTypes, declare, default_types
    from .model.state import RevisionTable, StateOf
    from .model.typed import Consumer, Event, event_type
    from .model.typed import envelope as make_envelope
    from .service.launch import run_consumer
    from .testing import ConsumerHarness

#: Public name -> (the module that defines it, its name there; None: the module
#: itself), imported on first use.
_LAZY: dict[str, tuple[str, str | None]] = {
    # a consumer
    "ConsumerSpec": ("delivery_consumer.model.contract", "ConsumerSpec"),
    "View": ("delivery_consumer.model.contract", "View"),
    "ApplyFn": ("delivery_consumer.model.contract", "ApplyFn"),
    "ApplyManyFn": ("delivery_consumer.model.contract", "ApplyManyFn"),
    "Connection": ("delivery_consumer.model.contract", "Connection"),
    "dialect": ("delivery_consumer.model.contract", "dialect"),
    "Consumer": ("delivery_consumer.model.typed", "Consumer"),
    "Event": ("delivery_consumer.model.typed", "Event"),
    "event_type": ("delivery_consumer.model.typed", "event_type"),
    "register": ("delivery_consumer.consumers", "register"),
    # event types and the envelope
    "EventType": ("delivery_consumer.model.event_types", "EventType"),
    "EventTypes": ("delivery_consumer.model.event_types", "EventTypes"),
    "MATERIAL": ("delivery_consumer.model.event_types", "MATERIAL"),
    "declare": ("delivery_consumer.model.event_types", "declare"),
    "default_types": ("delivery_consumer.model.event_types", "default_types"),
    "Envelope": ("delivery_consumer.model.event_types", "Envelope"),
    "make_envelope": ("delivery_consumer.model.typed", "envelope"),
    "new_event_id": ("delivery_consumer.model.event_ids", "new_event_id"),
    # errors a consumer raises or its caller catches
    "DeliveryError": ("delivery_consumer.model.errors", "DeliveryError"),
    "Rejection": ("delivery_consumer.model.errors", "Rejection"),
    "TransientError": ("delivery_consumer.model.errors", "TransientError"),
    "ConfigError": ("delivery_consumer.model.errors", "ConfigError"),
    "DatabaseError": ("delivery_consumer.model.errors", "DatabaseError"),
    "OutboxError": ("delivery_consumer.model.errors", "OutboxError"),
    # state
    "RevisionTable": ("delivery_consumer.model.state", "RevisionTable"),
    "StateOf": ("delivery_consumer.model.state", "StateOf"),
    # running and testing it; the producer's side
    "run_consumer": ("delivery_consumer.service.launch", "run_consumer"),
    "ConsumerHarness": ("delivery_consumer.testing", "ConsumerHarness"),
    "outbox": ("delivery_consumer.outbox", None),
    "testing": ("delivery_consumer.testing", None),
}

#: The public submodules: their own ``__all__`` is their supported API.
PUBLIC_MODULES = ("delivery_consumer.outbox", "delivery_consumer.testing")


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'delivery_consumer' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(where[0])
    value = module if where[1] is None else getattr(module, where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "MATERIAL",
    "ApplyFn",
    "ApplyManyFn",
    "ConfigError",
    "Connection",
    "Consumer",
    "ConsumerHarness",
    "ConsumerSpec",
    "DatabaseError",
    "DeliveryError",
    "Envelope",
    "Event",
    "EventType",
    "EventTypes",
    "OutboxError",
    "Rejection",
    "RevisionTable",
    "StateOf",
    "TransientError",
    "View",
    "__version__",
    "declare",
    "default_types",
    "dialect",
    "event_type",
    "make_envelope",
    "new_event_id",
    "outbox",
    "register",
    "run_consumer",
    "testing",
]
