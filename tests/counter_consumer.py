"""A third consumer that exists only in the tests: events counted per article.

It proves that adding a consumer is one module plus its registration, with no
change to the store: this module is all there is. Importing it registers the
consumer, which is how ``DELIVERY_PLUGINS=counter_consumer`` loads it in
another process (with ``tests/`` on ``PYTHONPATH``); its view gives it
``counter list|show`` and its rows in ``trace``.

Counting is the kind of effect that is *not* idempotent by itself (unlike the
catalog's revision check), so it shows the inbox absorbing every duplicate.
Its SQL is portable (the upsert names the stored row by its table), so it
runs on a PostgreSQL inbox too.
"""

from __future__ import annotations

from delivery_consumer.consumers import register
from delivery_consumer.model.contract import Connection, ConsumerSpec, View
from delivery_consumer.model.envelope import Envelope

RESULT = "counted"

MIGRATIONS = (
    """
    CREATE TABLE counter (
        article_id    TEXT PRIMARY KEY,
        events        INTEGER NOT NULL,
        last_event_id TEXT NOT NULL
    ) STRICT;
    """,
)


def apply(conn: Connection, env: Envelope) -> str:
    """Add one to the article's count."""
    conn.execute(
        "INSERT INTO counter (article_id, events, last_event_id) VALUES (?, 1, ?)"
        " ON CONFLICT (article_id) DO UPDATE SET events = counter.events + 1,"
        " last_event_id = excluded.last_event_id",
        (env.key, env.event_id),
    )
    return RESULT


SPEC = ConsumerSpec(
    name="counter",
    apply=apply,
    migrations=MIGRATIONS,
    description="test-only: number of distinct events per article",
    tables=("counter",),
    view=View(
        table="counter",
        columns=("article_id", "events", "last_event_id"),
        order=("-events", "article_id"),
        key="article_id",
        key_column="article_id",
        event="last_event_id",
        empty="nothing counted yet",
    ),
)

register(SPEC, replace=True)
