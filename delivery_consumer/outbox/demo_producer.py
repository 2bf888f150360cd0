"""A small demo producer: its own ``material`` table plus the outbox.

What ``delivery-consumer produce`` runs, and what docs/outbox.md shows: the
producer's change and its event are written in **one** transaction, so
either both exist or neither does::

    BEGIN IMMEDIATE
      SELECT revision FROM material WHERE article_id = ?     -- next revision
      INSERT ... ON CONFLICT DO UPDATE material               -- the producer's own state
      INSERT INTO outbox (...)                                 -- the event, same revision
    COMMIT

The ``material`` table has the columns of the catalog projection, so after
``dispatch`` and ``run --consumer catalog`` the two can be compared row for
row. This module is the host of the database: its schema version is
``PRAGMA user_version`` (the outbox keeps its own in ``outbox_meta``).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .. import outbox
from ..model.envelope import Envelope, from_mapping
from ..model.errors import ConfigError, DatabaseError
from ..model.event_ids import new_event_id
from ..store import sqlite
from ..store.sqlite import now_iso

PUBLISHED = "material.published"
WITHDRAWN = "material.withdrawn"

#: Forward-only migrations of the producer's own table (``user_version``).
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE material (
        article_id TEXT PRIMARY KEY,
        revision   INTEGER NOT NULL CHECK (revision >= 1),
        title      TEXT NOT NULL,
        url        TEXT NOT NULL,
        published  INTEGER NOT NULL CHECK (published IN (0, 1)),
        event_id   TEXT NOT NULL,
        updated_at TEXT NOT NULL
    ) STRICT;
    """,
)


def open_db(path: Path | str) -> sqlite3.Connection:
    """Open (creating) a demo producer database: material table and outbox."""
    conn = outbox.connect(path, install_tables=False)
    with sqlite.closed_on_failure(conn, path), outbox.transaction(conn):
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version and version <= len(MIGRATIONS) and "material" not in sqlite.table_names(conn):
            raise DatabaseError(f"{path}: not a demo producer database (user_version {version}, no material)")
        applied = sqlite.migrate(conn, MIGRATIONS, version, what="producer schema")
        conn.execute(f"PRAGMA user_version = {applied}")
        outbox.install(conn)
    return conn


@dataclass(frozen=True, slots=True)
class Produced:
    """The event written with a material change."""

    envelope: Envelope
    enqueued: bool


def rfc3339(when: float | None = None) -> str:
    """Now as an RFC 3339 UTC timestamp with milliseconds (``...Z``)."""
    return now_iso(time.time() if when is None else when)


def produce(
    conn: sqlite3.Connection,
    article_id: str,
    *,
    title: str | None = None,
    url: str | None = None,
    withdraw: bool = False,
    event_id: str | None = None,
) -> Produced:
    """Write the next revision of *article_id* and its event, in one transaction.

    Publishing needs a title and url; withdrawing keeps the stored ones
    unless given. The envelope is validated before anything is written.
    """
    with outbox.transaction(conn):
        row = conn.execute("SELECT revision, title, url FROM material WHERE article_id = ?",
                           (article_id,)).fetchone()
        if row is not None:
            title = row[1] if title is None else title
            url = row[2] if url is None else url
        if title is None or url is None:
            raise ConfigError(f"article {article_id!r} is new: give its title and url")
        revision = 1 if row is None else int(row[0]) + 1
        env = from_mapping({
            "eventId": event_id or new_event_id(),
            "type": WITHDRAWN if withdraw else PUBLISHED,
            "articleId": article_id,
            "revision": revision,
            "occurredAt": rfc3339(),
            "data": {"title": title, "url": url},
        })
        conn.execute(
            "INSERT INTO material (article_id, revision, title, url, published, event_id, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (article_id) DO UPDATE SET revision = excluded.revision,"
            " title = excluded.title, url = excluded.url, published = excluded.published,"
            " event_id = excluded.event_id, updated_at = excluded.updated_at",
            (article_id, revision, title, url, int(not withdraw), env.event_id, now_iso()),
        )
        enqueued = outbox.enqueue(conn, env)
    return Produced(env, enqueued)


__all__ = ["MIGRATIONS", "Produced", "open_db", "produce", "rfc3339"]
