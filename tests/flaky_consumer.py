"""A test-only consumer whose effect fails on demand, to drive ``run``'s
failure paths with real processes (loaded with ``DELIVERY_PLUGINS=flaky_consumer``).

It records envelopes like ``audit`` (table ``flaky``) but looks at the title:

* ``transient:N`` -- raise TransientError on the first N tries of that
  event. Tries are counted in a file per eventId under ``$FLAKY_DIR``
  (outside the database, so a rollback cannot undo the count);
* ``poison`` -- SIGKILL the process, every time (a message that crashes the
  consumer before any code can count it); an in-process harness replaces
  :data:`die` with what ends its emulated process;
* ``outage:N`` -- fail as the disk full would (SQLITE_FULL at the write) on the
  first N tries: the database as a whole, not the event;
* ``stall`` -- write ``$FLAKY_DIR/stalled`` and wait until ``$FLAKY_DIR/release``
  exists (a worker stuck inside a batch).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from delivery_consumer.consumers import register
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.envelope import Envelope
from delivery_consumer.model.errors import TransientError

MIGRATIONS = (
    """
    CREATE TABLE flaky (
        event_id    TEXT PRIMARY KEY,
        article_id  TEXT NOT NULL,
        revision    INTEGER NOT NULL,
        title       TEXT NOT NULL
    ) STRICT;
    """,
)


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


#: What a ``poison`` event does: kill the process.
die: Callable[[], None] = _sigkill


def disk_full() -> sqlite3.OperationalError:
    """The error SQLite raises for a write to a full disk (SQLITE_FULL)."""
    error = sqlite3.OperationalError("database or disk is full")
    error.sqlite_errorcode = 13  # type: ignore[attr-defined]
    error.sqlite_errorname = "SQLITE_FULL"  # type: ignore[attr-defined]
    return error


def _tries(event_id: str) -> int:
    directory = Path(os.environ.get("FLAKY_DIR", "."))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{event_id}.tries"
    tries = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(tries))
    return tries


def apply(conn: sqlite3.Connection, env: Envelope) -> str:
    """Record the envelope, or fail as its title asks."""
    title = str(env.data["title"])
    if title == "poison":
        die()
    if title == "stall":
        directory = Path(os.environ.get("FLAKY_DIR", "."))
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "stalled").touch()
        while not (directory / "release").exists():
            time.sleep(0.05)
    if title.startswith("transient:"):
        failures = int(title.split(":", 1)[1])
        tries = _tries(env.event_id)
        if tries <= failures:
            raise TransientError(f"flaky dependency unavailable (try {tries})", code="dependency-down")
    if title.startswith("outage:") and _tries(env.event_id) <= int(title.split(":", 1)[1]):
        raise disk_full()
    conn.execute(
        "INSERT INTO flaky (event_id, article_id, revision, title) VALUES (?, ?, ?, ?)",
        (env.event_id, env.key, env.revision, title),
    )
    return "recorded"


SPEC = register(
    ConsumerSpec(
        name="flaky",
        apply=apply,
        migrations=MIGRATIONS,
        binding_keys=("#",),
        description="test-only: fails on demand (transient:N, poison)",
        tables=("flaky",),
    )
)
