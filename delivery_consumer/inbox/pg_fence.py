"""The fence's serial lock on PostgreSQL: session-level advisory locks on the batch's entities.

On SQLite one process at a time runs the fence's claim, call and completion on a
database (an OFD lock on the file). Several ``run`` processes share a PostgreSQL
inbox, so the lock is narrower there: one per ``<entity key>:<step>`` of the batch,
keyed by the consumer's schema too, taken in one statement in the order of the
keys (two batches never wait for each other in a circle) on the inbox's own
connection and held across the claim's transaction, the calls and the
completion's transaction. Session-level, because the calls are made outside any
transaction; a process that dies leaves its locks to the server, which drops them
with its session. Why per entity and not per fence key: docs/fence.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import orjson

from .pg import psycopg_module, translate

if TYPE_CHECKING:
    from .pg import PgInboxDB

#: One advisory lock per name, keyed by the schema (consumers sharing a database do not wait for
#: each other), in the order of the keys; the prefix keeps them apart from the eventIds' locks.
LOCK: Final = (
    "SELECT count(pg_advisory_lock(k)) FROM (SELECT DISTINCT hashtextextended('delivery_consumer.fence:'"
    " || current_schema() || ':' || value, 0) AS k FROM json_array_elements_text(CAST(%s AS json)) AS ids"
    " ORDER BY k) AS s"
)
#: Every session-level advisory lock of the connection (the fence's are its only ones).
UNLOCK: Final = "SELECT pg_advisory_unlock_all()"


class AdvisorySerial:
    """``with AdvisorySerial(db, names):`` -- the fence's serial lock on *names* (``<entity key>:<step>``).

    :meth:`held` says whether the lock is still this process's: False once the
    connection it was taken on was lost (then the server has dropped it, and
    another run may hold it). :meth:`committed` sends an unsynced transaction's
    COMMIT still pending on the connection (the claim's, an in-flight note), so
    that it is committed before a call is made."""

    __slots__ = ("_db", "_names", "_raw")

    def __init__(self, db: PgInboxDB, names: Iterable[str]) -> None:
        self._db = db
        self._names = sorted(set(names))
        self._raw: Any = None

    def __enter__(self) -> AdvisorySerial:
        if not self._names:
            return self
        psycopg = psycopg_module()
        try:
            raw = self._db.raw()  # a pending COMMIT goes first: nothing is left open while waiting
        except psycopg.Error as exc:
            raise translate(exc, self._db.label) from None
        try:
            raw.execute(LOCK, (orjson.dumps(self._names).decode(),))
        except psycopg.Error as exc:
            self._release(raw)
            raise translate(exc, self._db.label) from None
        self._raw = raw
        return self

    def held(self) -> bool:
        raw = self._raw
        if not self._names:
            return True
        return raw is not None and self._db.conn.raw is raw and not raw.closed and not raw.broken

    def committed(self) -> None:
        psycopg = psycopg_module()
        try:
            self._db.connected()
        except psycopg.Error as exc:
            raise translate(exc, self._db.label) from None

    def __exit__(self, *exc: object) -> None:
        raw, self._raw = self._raw, None
        if raw is None or self._db.conn.raw is not raw or raw.closed:
            return  # the session is gone, and its locks with it
        self._release(raw)

    def _release(self, raw: Any) -> None:
        """Unlock; when that fails, end the session (the server drops its locks with it): a lock
        left held would keep every other run of the consumer waiting."""
        try:
            if self._db.conn.commit_pending:
                self._db.connected()
            raw.execute(UNLOCK)
        except Exception:
            self._db.rollback()
            raw.close()


__all__ = ["LOCK", "UNLOCK", "AdvisorySerial"]
