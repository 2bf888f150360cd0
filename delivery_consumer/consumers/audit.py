"""The audit log: every distinct envelope stored exactly once.

The primary key on ``event_id`` is a second line of defence behind the inbox:
even after ``inbox prune`` removed an old receipt, a late redelivery finds the
audit row, writes no second one and is answered ``recorded`` again (or
rejected ``event-id-reused`` when the body differs).
"""

from __future__ import annotations

import orjson

from ..model.contract import Connection, ConsumerSpec, View
from ..model.envelope import Envelope
from ..model.errors import EVENT_ID_REUSED, Rejection

MIGRATIONS = (
    """
    CREATE TABLE audit (
        event_id    TEXT PRIMARY KEY,
        event_type  TEXT NOT NULL,
        article_id  TEXT NOT NULL,
        revision    INTEGER NOT NULL,
        occurred_at TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        envelope    TEXT NOT NULL
    ) STRICT;
    """,
)

_INSERT = """
INSERT INTO audit (event_id, event_type, article_id, revision, occurred_at, fingerprint, envelope)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (event_id) DO NOTHING
"""


def apply(conn: Connection, env: Envelope) -> str:
    """Store the canonical envelope once; see the module docstring."""
    cur = conn.execute(
        _INSERT,
        (
            env.event_id,
            env.type,
            env.key,
            env.revision,
            env.occurred_at,
            env.fingerprint,
            env.canonical.decode("utf-8"),
        ),
    )
    if cur.rowcount == 1:
        return "recorded"
    (stored,) = conn.execute(
        "SELECT fingerprint FROM audit WHERE event_id = ?", (env.event_id,)
    ).fetchone()
    if stored != env.fingerprint:
        raise Rejection(
            EVENT_ID_REUSED,
            "eventId already recorded in audit with another body",
            event_id=env.event_id,
            fingerprint=env.fingerprint,
        )
    return "recorded"


SPEC = ConsumerSpec(
    name="audit",
    apply=apply,
    migrations=MIGRATIONS,
    binding_keys=("#",),
    description="append-only log of every distinct envelope",
    tables=("audit",),
    view=View(
        table="audit",
        columns=("event_id", "event_type", "article_id", "revision", "occurred_at", "fingerprint", "envelope"),
        order=("-rowid",),
        key="event_id",
        brief=("event_id", "event_type", "article_id", "revision", "occurred_at"),
        filters={"type": "event_type"},
        limit=50,
        rename={"event_type": "type"},
        decode={"envelope": orjson.loads},
        empty="the audit log is empty",
    ),
)
