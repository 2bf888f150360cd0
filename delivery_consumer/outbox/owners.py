"""Who holds a lease, and whether that process is still alive.

A running dispatcher registers in ``outbox_owners``: its owner id (the
``lease_owner`` it writes), host name and boot id, pid and the process start
time (``/proc/<pid>/stat`` field 22, so a reused pid is not mistaken for
it), and a heartbeat that a thread refreshes every ``heartbeat_s``
(:class:`Heartbeat`). Another dispatcher takes its leases back **at once**
(:func:`reap`) when it is known dead:

* same host, boot and pid namespace: the pid is gone, a zombie, or another
  process; a running one is alive; a stopped one (SIGSTOP) is judged by its
  heartbeat; same host, earlier boot: dead too;
* another host: the heartbeat is older than ``STALE_BEATS`` beats.

A lease whose owner is not registered (older code, a bare ``Dispatcher``
driven by hand) still ends only at ``lease_until``. A process that is merely
stopped (SIGSTOP, a paused VM) looks dead after the stale time: its rows go
again, as duplicates the consumer's inbox absorbs, never as a loss (its late
marks cannot undo the other's, see the dispatcher).
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from ..model.errors import DeliveryError, safe_reason
from ..store.liveness import GONE, RUNNING, boot_id, proc_start, process_state
from ..store.sqlite import age_s, now_iso
from .db import OutboxDb, as_db
from .table import MAX_ERROR_CHARS

log = logging.getLogger("delivery_consumer.dispatch")

#: An owner whose heartbeat is older than this many of its own beats is dead.
STALE_BEATS: Final = 5


@dataclass(frozen=True, slots=True)
class Identity:
    """This process as an owner of leases."""

    owner: str
    host: str
    boot_id: str | None
    pid: int
    proc_start: str | None

    @classmethod
    def mine(cls, owner: str) -> Identity:
        pid = os.getpid()
        return cls(owner, socket.gethostname(), boot_id(), pid, proc_start(pid))


def death(me: Identity, host: str, boot: str | None, pid: int, started: str | None,
          heartbeat_s: float, heartbeat_at: str, now: float) -> str | None:
    """Why the registered owner is known dead (None: alive, or cannot tell).

    On this host (same boot and pid namespace) the process itself answers: a
    running one is alive whatever its heartbeat (a long producer transaction
    may starve the heartbeat's writes); a stopped one (SIGSTOP) is judged by
    its heartbeat. Elsewhere only the heartbeat tells."""
    same_boot = boot is not None and me.boot_id is not None and boot.split()[0] == me.boot_id.split()[0]
    if host == me.host and boot is not None and boot == me.boot_id:
        state, why = process_state(pid, started)
        if state == GONE:
            return f"its process {pid} on {host} {why}"
        if state == RUNNING:
            return None
    elif host == me.host and boot is not None and me.boot_id is not None and not same_boot:
        return f"{host} was restarted since it registered"
    silent = age_s(heartbeat_at, now)
    if silent > STALE_BEATS * heartbeat_s:
        return f"no heartbeat for {silent:.0f}s"
    return None


def register(conn: Any, me: Identity, heartbeat_s: float, now: float) -> None:
    """Record this dispatcher (and forget owners that are dead and hold nothing)."""
    stamp = now_iso(now)
    with as_db(conn).transaction() as db:
        db.execute(
            "INSERT INTO outbox_owners (owner, host, boot_id, pid, proc_start, heartbeat_s, started_at,"
            " heartbeat_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (owner) DO UPDATE SET host = excluded.host,"
            " boot_id = excluded.boot_id, pid = excluded.pid, proc_start = excluded.proc_start,"
            " heartbeat_s = excluded.heartbeat_s, started_at = excluded.started_at,"
            " heartbeat_at = excluded.heartbeat_at",
            (me.owner, me.host, me.boot_id, me.pid, me.proc_start, heartbeat_s, stamp, stamp))


def unregister(conn: Any, owner: str) -> None:
    """A clean exit: give back every lease still held and leave the table."""
    with as_db(conn).transaction() as conn:
        conn.execute("UPDATE outbox SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = ?"
                     " AND status = 'pending'", (owner,))
        conn.execute("DELETE FROM outbox_owners WHERE owner = ?", (owner,))


def reap(conn: Any, me: Identity, now: float) -> int:
    """Take back the leases of every registered owner known dead; returns
    how many rows were freed. Each freed row records why in ``last_error``."""
    conn = as_db(conn)
    others = conn.execute(
        "SELECT owner, host, boot_id, pid, proc_start, heartbeat_s, heartbeat_at FROM outbox_owners"
        " WHERE owner != ?", (me.owner,)).fetchall()
    dead = [(owner, why) for owner, host, boot, pid, started, beat_s, beat_at in others
            if (why := death(me, host, boot, pid, started, beat_s, beat_at, now)) is not None]
    if not dead:
        return 0
    freed = 0
    with conn.transaction():
        for owner, why in dead:
            reason = safe_reason(f"lease of {owner} taken back: {why}", MAX_ERROR_CHARS)
            cur = conn.execute(
                "UPDATE outbox SET lease_owner = NULL, lease_until = NULL, last_error = ?"
                " WHERE lease_owner = ? AND status = 'pending'", (reason, owner))
            freed += cur.rowcount
            conn.execute("DELETE FROM outbox_owners WHERE owner = ?", (owner,))
            if cur.rowcount:
                log.warning("took back %d rows leased by %s: %s", cur.rowcount, owner, why)
    return freed


class Heartbeat:
    """A thread that refreshes the owner's heartbeat every ``interval_s``
    on its own connection (*open* makes it), whatever the dispatcher is
    waiting for (a broker confirm, a busy database). Re-registers if someone
    removed the row."""

    def __init__(self, open: Callable[[], OutboxDb], me: Identity, interval_s: float,
                 clock: Callable[[], float]) -> None:
        self.open, self.me, self.interval_s, self.clock = open, me, interval_s, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        conn: OutboxDb | None = None
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    if conn is None:
                        conn = self.open()
                    cur = conn.execute("UPDATE outbox_owners SET heartbeat_at = ? WHERE owner = ?",
                                       (now_iso(self.clock()), self.me.owner))
                    if cur.rowcount == 0:
                        register(conn, self.me, self.interval_s, self.clock())
                except (sqlite3.Error, DeliveryError) as exc:  # busy, full or away: the next beat tries again
                    log.debug("heartbeat not written: %s", exc)
        finally:
            if conn is not None:
                conn.close()


__all__ = ["STALE_BEATS", "Heartbeat", "Identity", "boot_id", "death", "proc_start", "reap", "register",
           "unregister"]
