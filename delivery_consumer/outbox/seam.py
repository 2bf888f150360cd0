"""The outbox's storage seam: what the shared code asks of a connection, whichever
database holds the outbox (SQLite: :mod:`.db`; PostgreSQL: :mod:`.pg`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..model import contract


class Cursor(contract.Cursor, Protocol):
    """What the shared code reads of a cursor (sqlite3's and psycopg's both have it): an effect's, and close."""

    def close(self) -> None: ...


class WakeListener(Protocol):
    """A dispatcher's wake-up source: :meth:`fileno` is readable when rows were committed."""

    def fileno(self) -> int: ...

    def drain(self) -> int: ...

    def close(self) -> None: ...

    @property
    def broken(self) -> bool: ...


class OutboxDb(Protocol):
    """One connection to an outbox, whichever database holds it."""

    @property
    def kind(self) -> str:
        """``sqlite`` or ``postgres``."""

    @property
    def label(self) -> str:
        """The database for messages: a file path, or a URL without its password."""

    @property
    def seq_in_sql(self) -> str:
        """``seq`` is one of the seqs given as one parameter (:meth:`seqs`)."""

    @property
    def body_sql(self) -> str:
        """What the claim's scan reads of the body: ``body``, or its size (the claim then reads the bodies
        of the rows it took apart)."""

    @property
    def created_ms_sql(self) -> str:
        """``created_at`` as milliseconds since the epoch (an SQL expression)."""

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Cursor: ...

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Cursor: ...

    def scan(self, sql: str, params: Sequence[Any] = (), chunk: int = 1000) -> Cursor:
        """Rows of a long SELECT, fetched as they are read (inside a transaction)."""

    def transaction(self) -> AbstractContextManager[OutboxDb]:
        """A write transaction; database errors leave as DeliveryError (StoreUnavailable: wait)."""

    def snapshot(self) -> AbstractContextManager[None]:
        """Several reads from one snapshot."""

    def seqs(self, seqs: Iterable[int]) -> Any: ...

    def lock_claims(self) -> None:
        """Inside a claim's transaction: one claim at a time per outbox."""

    def reopen(self) -> OutboxDb:
        """Another connection to the same outbox (the heartbeat thread's)."""

    def listener(self) -> WakeListener | None:
        """Wake-ups from producers' commits (None: poll only)."""

    def check_alive(self) -> None:
        """Raise DatabaseLost when the database was replaced under us (SQLite's file)."""

    def close(self) -> None: ...


__all__ = ["Cursor", "OutboxDb", "WakeListener"]
