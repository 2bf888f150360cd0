"""delivery-consumer: RabbitMQ consumers that survive redelivery, duplicates,
out-of-order revisions and crashes, with one SQLite database per consumer.

Follow an event by names: bytes -> :mod:`.envelope` -> :func:`.inbox.apply_batch`
-> :mod:`.consumers` (``catalog``, ``audit``, ...) -> receipt -> commit ->
:mod:`.amqp.consumer` acks (docs/architecture.md).
"""

__version__ = "0.1.0"
