"""A declared event type of the material types' size, and its consumer, for the benchmarks.

``item.published`` / ``item.withdrawn`` keyed by ``itemId``, with a revision,
``data`` of the material schema; the consumer ``items`` keeps the latest
revision of each item with ``state.RevisionTable``, as the catalog does.
Loaded by ``DELIVERY_PLUGINS=_declared`` with ``bench/`` on ``PYTHONPATH``.
:func:`declared` turns a material envelope of ``_stream.py`` into this type.
"""

from __future__ import annotations

from typing import Any

from delivery_consumer.consumers import register
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.envelope import Envelope, load_schema
from delivery_consumer.model.event_types import EventType, EventTypes
from delivery_consumer.model.state import RevisionTable

PUBLISHED, WITHDRAWN = "item.published", "item.withdrawn"
_DATA = load_schema()["properties"]["data"]
TYPES = EventTypes([EventType(PUBLISHED, key="itemId", data=_DATA), EventType(WITHDRAWN, key="itemId", data=_DATA)])
TABLE = RevisionTable("items", key="item_id", state=("title", "url", "published"))
MIGRATIONS = ("""
    CREATE TABLE items (
        item_id     TEXT PRIMARY KEY,
        revision    INTEGER NOT NULL,
        title       TEXT NOT NULL,
        url         TEXT NOT NULL,
        published   INTEGER NOT NULL,
        event_id    TEXT NOT NULL,
        occurred_at TEXT NOT NULL
    ) STRICT;
""",)


def _state(env: Envelope) -> tuple[str, str, int]:
    data = env.data
    return (data["title"], data["url"], int(env.type == PUBLISHED))


apply, apply_many = TABLE.effect(_state)


def declared(env: dict[str, Any]) -> dict[str, Any]:
    """The material envelope *env* as an item event (same values, same size)."""
    out = {**env, "type": PUBLISHED if env["type"] == "material.published" else WITHDRAWN}
    out["itemId"] = out.pop("articleId")
    return out


SPEC = register(ConsumerSpec(name="items", apply=apply, apply_many=apply_many, migrations=MIGRATIONS,
                             event_types=TYPES, binding_keys=("item.*",), tables=("items",)), replace=True)
