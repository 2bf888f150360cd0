"""A consumer of the tests' own event types: orders keyed by ``orderId``, with a revision.

Importing it registers the consumer (``DELIVERY_PLUGINS=orders_consumer`` in
another process, with ``tests/`` on ``PYTHONPATH``) and declares its types to
producers (``event_types.declare``), so that ``publish`` and
``outbox.enqueue`` accept them too. Its table keeps the latest revision of
each order (``state.RevisionTable``).
"""

from __future__ import annotations

from delivery_consumer.consumers import register

try:
    from delivery_consumer import ConsumerSpec, Envelope, EventType, EventTypes, RevisionTable, View, declare
except ImportError:  # the previous release (tests/core/test_previous_release.py) has only these paths
    from delivery_consumer.contract import ConsumerSpec, View
    from delivery_consumer.envelope import Envelope
    from delivery_consumer.event_types import EventType, EventTypes, declare
    from delivery_consumer.state import RevisionTable

DATA = {
    "type": "object",
    "required": ["status", "totalCents"],
    "properties": {
        "status": {"type": "string", "enum": ["placed", "paid", "shipped", "cancelled"]},
        "totalCents": {"type": "integer", "minimum": 0},
    },
}
TYPES = EventTypes([EventType("order.placed", key="orderId", data=DATA),
                    EventType("order.changed", key="orderId", data=DATA)])

MIGRATIONS = ("""
    CREATE TABLE orders (
        order_id    TEXT PRIMARY KEY,
        revision    INTEGER NOT NULL,
        status      TEXT NOT NULL,
        total_cents INTEGER NOT NULL,
        event_id    TEXT NOT NULL,
        occurred_at TEXT NOT NULL
    ) STRICT;
""",)
TABLE = RevisionTable("orders", key="order_id", state=("status", "total_cents"))


def state(env: Envelope) -> tuple[str, int]:
    return (env.data["status"], env.data["totalCents"])


apply, apply_many = TABLE.effect(state)


SPEC = ConsumerSpec(
    name="orders",
    apply=apply,
    apply_many=apply_many,
    migrations=MIGRATIONS,
    event_types=TYPES,
    binding_keys=("order.*",),
    description="test-only: the latest revision of each order",
    tables=("orders",),
    view=View(table="orders", columns=("order_id", "revision", "status", "total_cents", "event_id"),
              order=("order_id",), key="order_id", key_column="order_id", event="event_id"),
)

register(SPEC, replace=True)
declare(*TYPES)
