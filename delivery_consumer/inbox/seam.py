"""The inbox's storage seam: what the applier and ``run`` ask of a consumer's database,
whichever holds it (SQLite: :class:`~.database.ConsumerDB`; PostgreSQL: :class:`~.pg.PgInboxDB`).

The applier's part is :class:`~.apply.Store` (one path for every event: the backend's
transaction words only its dialect's steps); :class:`InboxDB` adds what ``run`` opens,
watches and closes. The SQLite-only guards (the file's identity, its content tags, the
integrity check) are no-ops on PostgreSQL: docs/postgres-inbox.md says why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .apply import Store

if TYPE_CHECKING:
    from pathlib import Path

    from ..model.contract import Connection, ConsumerSpec
    from ..store.dbfile import ContentTags, FileGuard
    from .database import IntegrityCheck


class InboxReader(Protocol):
    """What the operator's reads (``inbox/reports.py``, ``history.py``, ``views.py``) ask of an
    open inbox, on either backend: each read words its SQL for the connection's dialect."""

    spec: ConsumerSpec
    readonly: bool
    #: A note for the operator about how the inbox was opened (None: nothing to say).
    note: str | None

    @property
    def conn(self) -> Connection: ...

    @property
    def path(self) -> Path | str: ...

    @property
    def consumer(self) -> str: ...

    def meta(self) -> dict[str, str]: ...

    def close(self) -> None: ...


class InboxDB(Store, Protocol):
    """A consumer's open inbox, as ``run`` uses it."""

    #: Whether the open made it (a new, empty inbox).
    created: bool
    #: The whole integrity check still running (SQLite); None when there is nothing to wait for.
    integrity: IntegrityCheck | None
    #: Set once another run took the database over (SQLite's writer lock); None on PostgreSQL.
    superseded: threading.Event | None
    taken_over: Callable[[], bool] | None

    @property
    def guard(self) -> FileGuard | None:
        """The file's identity as opened (SQLite); None on PostgreSQL."""
        ...

    def meta(self) -> dict[str, str]: ...

    def database_id(self) -> str: ...

    def high_water(self) -> int: ...

    def watch_content(self, tags: ContentTags | None = None) -> None: ...

    def check_integrity(self, limit_s: float) -> bool: ...

    def close(self) -> None: ...


__all__ = ["InboxDB", "InboxReader", "Store"]
