"""delivery-consumer: RabbitMQ consumers that survive redelivery, duplicates,
out-of-order revisions and crashes, with one SQLite database per consumer.

Follow an event by names: bytes -> :mod:`.envelope` -> :func:`.inbox.apply_batch`
-> :mod:`.consumers` (``catalog``, ``audit``, ...) -> receipt -> commit ->
:mod:`.amqp.consumer` acks (docs/architecture.md).

:func:`run_consumer` runs a consumer from a program of your own, as
``delivery-consumer run`` does (:mod:`.service.launch`). :class:`Consumer`,
:class:`Event` and :func:`event_type` write a consumer as one handler per
event type, each type declared from a model of its data (:mod:`.typed`).
The test kit is :mod:`delivery_consumer.testing` (docs/testing-consumers.md).
"""

from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .service.launch import run_consumer
    from .typed import Consumer, Event, event_type

#: Name -> the module that defines it, imported on first use: ``import delivery_consumer``
#: stays cheap for every command.
_LAZY = {
    "run_consumer": "delivery_consumer.service.launch",
    "Consumer": "delivery_consumer.typed",
    "Event": "delivery_consumer.typed",
    "event_type": "delivery_consumer.typed",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'delivery_consumer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["Consumer", "Event", "__version__", "event_type", "run_consumer"]
