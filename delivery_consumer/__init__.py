"""delivery-consumer: RabbitMQ consumers that survive redelivery, duplicates,
out-of-order revisions and crashes, with one SQLite database per consumer.

Follow an event by names: bytes -> :mod:`.envelope` -> :func:`.inbox.apply_batch`
-> :mod:`.consumers` (``catalog``, ``audit``, ...) -> receipt -> commit ->
:mod:`.amqp.consumer` acks (docs/architecture.md).

:func:`run_consumer` runs a consumer from a program of your own, as
``delivery-consumer run`` does (:mod:`.service.launch`).
"""

from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .service.launch import run_consumer


def __getattr__(name: str) -> Any:
    # Imported on first use: ``import delivery_consumer`` stays cheap for every command.
    if name == "run_consumer":
        from .service.launch import run_consumer

        return run_consumer
    raise AttributeError(f"module 'delivery_consumer' has no attribute {name!r}")


__all__ = ["__version__", "run_consumer"]
