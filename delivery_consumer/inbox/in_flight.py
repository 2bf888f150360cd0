"""What each process is handling now, durably: how ``run`` tells a poison message.

A message is poison when it, alone, kills the process. Before each batch
(and before each call of an external effect) the process notes the keys it
is about to handle in ``in_flight``, under its own name, in a commit without
fsync (a process crash keeps it; see ``apply.UnsyncedTransaction``); the
batch's own commit deletes the note. A note whose owner is gone is what a
crash leaves: :meth:`InFlight.reap` turns it into per-key state in
``deliveries`` -- a crash for the key handled alone, a suspect (no crash)
for each key of a batch. run then handles open keys one at a time. A live
owner's note (an orphan, a process whose channel dropped) is never taken for
a crash.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import orjson

from ..model.errors import DatabaseError, DeliveryError
from ..store import liveness, sqlite
from .apply import Store, Transaction, unsynced_transaction
from .dialect import words_for

#: The last outcome of a delivery whose process died while handling it, as
#: older versions wrote it (now: CRASHED or INTERRUPTED).
IN_FLIGHT = "in-flight"

#: A key that was handled alone when its process died (``crashes`` + 1).
CRASHED = "crashed"
#: A key that was one of a batch when its process died: a suspect, not a crash.
INTERRUPTED = "interrupted"
#: Last outcomes of a key whose next delivery must be handled alone.
OPEN_OUTCOMES = (CRASHED, INTERRUPTED, IN_FLIGHT)


def _boot() -> str:
    """The first 8 characters of the boot id, ``-`` without /proc."""
    boot = liveness.boot_id()
    return "-" if boot is None else boot[:8]


def _namespace() -> str | None:
    """This pid namespace's number (``4026531836`` of ``pid:[4026531836]``), None when unknown."""
    namespace = liveness.pid_namespace()
    return None if namespace is None else namespace.removeprefix("pid:[").removesuffix("]")


def process_owner(pid: int | None = None) -> str:
    """A name of process *pid* (default: this one, in this pid namespace)
    that no later process shares: ``<boot id>/<pid namespace>:<pid>:<start
    time>`` (a pid alone is reused, and means something only in its namespace)."""
    pid = os.getpid() if pid is None else pid
    namespace = _namespace()
    boot = _boot() if namespace is None else f"{_boot()}/{namespace}"
    return f"{boot}:{pid}:{liveness.proc_start(pid) or '-'}"


def owner_alive(owner: str) -> bool:
    """Whether the process named *owner* (:func:`process_owner`) may still run:
    False once it exited (a zombie too) or its pid names another process, or
    after a reboot. A process of another pid namespace (another container
    on this host) cannot be seen from here: it is never judged dead (its
    note waits; a name of older releases carries no namespace, it is taken
    for this one)."""
    boot_part, _, rest = owner.partition(":")
    pid_text, _, start = rest.partition(":")
    boot, _, namespace = boot_part.partition("/")
    if boot != _boot() or not pid_text.isdigit():
        return False
    mine = _namespace()
    if namespace and mine is not None and namespace != mine:
        return True
    state, _ = liveness.process_state(int(pid_text), None if start == "-" else start)
    return state != liveness.GONE


class InFlight:
    """This process's durable note of the deliveries it is handling now."""

    def __init__(self, db: Store, owner: str | None = None) -> None:
        self.db = db
        self.owner = owner or process_owner()

    def mark(self, keys: Sequence[str]) -> None:
        """Note *keys* as under way, in a commit of its own (not synced)."""
        with unsynced_transaction(self.db) as tx:
            self.mark_in(tx, keys)

    def mark_in(self, tx: Transaction, keys: Sequence[str]) -> None:
        """Note *keys* as under way in *tx* (committed with it)."""
        tx.conn.execute("INSERT INTO in_flight (owner, keys, started_at) VALUES (?, ?, ?) ON CONFLICT (owner)"
                        " DO UPDATE SET keys = excluded.keys, started_at = excluded.started_at",
                        (self.owner, orjson.dumps(list(keys)).decode(), tx.now))

    def clear(self, tx: Transaction) -> None:
        """Nothing is under way any more once *tx* commits (the batch's own transaction)."""
        # PostgreSQL's connection sends it with the COMMIT, in one round trip (inbox/pg.py).
        at_commit = getattr(tx.conn, "at_commit", None)
        (at_commit or tx.conn.execute)("DELETE FROM in_flight WHERE owner = ?", (self.owner,))

    def reap(self) -> int:
        """Settle the notes of processes that are gone; how many there were.

        Each key of a note gets one more delivery in ``deliveries`` and an
        open outcome: ``crashed`` (crashes + 1) when the note held that key
        alone (copies of one message are one piece of work), ``interrupted``
        when it held several.
        """
        others = self.db.conn.execute("SELECT owner FROM in_flight WHERE owner != ?", (self.owner,)).fetchall()
        dead = [owner for (owner,) in others if not owner_alive(owner)]
        if not dead:
            return 0
        with self.db.transaction() as tx:
            for owner in dead:
                row = tx.conn.execute("DELETE FROM in_flight WHERE owner = ? RETURNING keys", (owner,)).fetchone()
                if row is None:  # another process settled it first
                    continue
                keys = set(orjson.loads(row[0]))
                for key in keys:
                    self._count_interruption(tx, key, crashed=len(keys) == 1)
        return len(dead)

    @staticmethod
    def _count_interruption(tx: Transaction, key: str, *, crashed: bool) -> None:
        """The process handling a delivery of *key* died: count that delivery
        and leave the key open (:data:`OPEN_OUTCOMES`), a crash if it was
        handled alone (*crashed*), else one suspect of a batch."""
        tx.conn.execute(
            "INSERT INTO deliveries AS d (key, event_id, deliveries, redeliveries, attempts, crashes, first_at,"
            " last_at, last_outcome) VALUES (?1, NULL, 1, 0, 1, ?2, ?3, ?3, ?4)"
            " ON CONFLICT (key) DO UPDATE SET deliveries = d.deliveries + 1, crashes = d.crashes + ?2,"
            " last_at = ?3, last_outcome = ?4",
            (key, int(crashed), tx.now, CRASHED if crashed else INTERRUPTED),
        )

    def open_keys(self, keys: Sequence[str]) -> dict[str, int]:
        """Those of *keys* whose last delivery ended with its process (to be
        handled alone), with their crash counts; one query."""
        if not keys:
            return {}
        placeholders = ", ".join("?" * len(OPEN_OUTCOMES))
        conn = self.db.conn
        each = words_for(self.db).texts_table
        return {
            str(key): int(crashes) for key, crashes in conn.execute(
                f"SELECT key, crashes FROM deliveries WHERE key IN ({each}) AND last_outcome IN ({placeholders})",
                (orjson.dumps(list(keys)).decode(), *OPEN_OUTCOMES),
            )
        }

    def forget(self) -> None:
        """Delete this process's note from another thread than the one that owns the
        database connection (a process leaving on purpose); best effort, quick."""
        own = getattr(self.db, "forget_in_flight", None)  # a backend with its own way (PostgreSQL)
        if own is not None:
            own(self.owner)
        else:
            forget_in_flight(Path(self.db.path), self.owner)

    def release(self) -> None:
        """Delete this process's note at a clean exit (best effort: a note
        left behind is settled by the next process as an interruption)."""
        with suppress(DeliveryError), self.db.transaction() as tx:
            self.clear(tx)


def forget_in_flight(path: Path, owner: str) -> None:
    """Delete *owner*'s note from another thread than the one that owns the
    database connection (a process leaving on purpose); best effort, quick."""
    with suppress(sqlite3.Error, DatabaseError):
        conn = sqlite.connect(path, busy_timeout_ms=500)
        try:
            conn.execute("DELETE FROM in_flight WHERE owner = ?", (owner,))
        finally:
            conn.close()


__all__ = [
    "CRASHED",
    "INTERRUPTED",
    "OPEN_OUTCOMES",
    "InFlight",
    "forget_in_flight",
    "owner_alive",
    "process_owner",
]
