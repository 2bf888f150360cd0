"""delivery-consumer: RabbitMQ consumers that survive redelivery, duplicates,
out-of-order revisions and crashes, with one SQLite database per consumer.

Follow an event by names: bytes -> :mod:`.envelope` -> :func:`.inbox.apply_batch`
-> :mod:`.consumers` (``catalog``, ``audit``, ...) -> receipt -> commit ->
:mod:`.amqp.consumer` acks (docs/architecture.md).
"""

#: Raised on every release that changes the database schema or the wire
#: contract (CHANGELOG.md); a database records the release that last migrated it.
__version__ = "0.2.0"
