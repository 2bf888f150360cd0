"""PostgreSQL as the inbox and the outbox both use it (psycopg 3, the ``postgres`` extra).

What their backends (``inbox/pg.py``, ``outbox/pg.py``) share: psycopg imported on first use (an
error naming the extra when it is missing), a URL told from a file, its password kept out of
messages, a psycopg error sorted into the project's (an outage waits, a configuration error exits
2: docs/postgres-inbox.md and docs/outbox.md), and a connection opened the same way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from ..model.errors import DatabaseError, DeliveryError, StoreUnavailable

#: The URL schemes of a PostgreSQL database (``--db``, ``--outbox``, the deployment file).
SCHEMES: Final = ("postgresql://", "postgres://")

#: SQLSTATE classes that are the environment's fault (a lost connection, a serialization failure
#: or deadlock, no resources, a lock not available, an operator's shutdown): wait, spend nothing.
TRANSIENT_CLASSES: Final = ("08", "40", "53", "55", "57", "58")
#: Bad credentials, no such database, no privilege: a configuration error.
AUTH: Final = ("28000", "28P01", "3D000", "42501")
READ_ONLY: Final = "25006"
UNDEFINED_TABLE: Final = "42P01"
#: libpq's connection failures carry no SQLSTATE: these words mean a configuration error.
CONFIG_WORDS: Final = ("password authentication failed", "role", "does not exist", "no pg_hba.conf entry",
                       "authentication", "invalid connection option", "invalid dsn", "missing \"=\"",
                       "invalid integer value", "invalid sslmode")


def psycopg_module(what: str = "a database on PostgreSQL") -> Any:
    """psycopg, or DatabaseError naming the extra to install (*what* needs it)."""
    try:
        import psycopg
    except ImportError:  # pragma: no cover - the extra is missing
        raise DatabaseError(f"{what} needs psycopg 3: pip install 'delivery-consumer[postgres]'") from None
    return psycopg


def is_url(target: object) -> bool:
    """Whether *target* (a ``--db`` or ``--outbox`` value) names a PostgreSQL database rather than a file."""
    return isinstance(target, str) and target.startswith(SCHEMES)


def redact(url: str) -> str:
    """*url* without its password, for messages and logs."""
    return re.sub(r"(://[^:/@?]*):[^@/?]*@", r"\1@", url)


def translate(exc: BaseException, label: str, *, user: str, missing_table: str | None = None) -> DeliveryError:
    """A psycopg error as the project's: StoreUnavailable (an outage, a timeout, a serialization
    failure or deadlock, a lost connection: wait, spend nothing) or DatabaseError (exit 2: a
    standby, bad credentials, no such database). *user* ("the inbox") is named when the database
    is read-only; *missing_table*, when given, says what an undefined table means."""
    state = getattr(exc, "sqlstate", None) or ""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if state == READ_ONLY:
        return DatabaseError(f"{label}: the database is read-only (a standby, or default_transaction_read_only is"
                             f" on): {user} needs the primary")
    if state in AUTH:
        return DatabaseError(f"{label}: {text}")
    if state == UNDEFINED_TABLE and missing_table is not None:
        return DatabaseError(f"{label}: {missing_table} ({text})")
    if state[:2] in TRANSIENT_CLASSES:
        return StoreUnavailable(f"{label}: {text}", code="database-unavailable")
    psycopg = psycopg_module()
    if not state and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        lowered = text.lower()
        if any(word in lowered for word in CONFIG_WORDS) and "the database system" not in lowered:
            return DatabaseError(f"{label}: {text}")
        return StoreUnavailable(f"{label}: {text}", code="database-unavailable")
    return DatabaseError(f"{label}: {text}")


def connect(url: str, label: str, *, user: str, application_name: str, readonly: bool = False,
            setup: Sequence[str] = (), **options: Any) -> Any:
    """An autocommit psycopg connection to *url* (10 s to connect), *setup*'s statements run on it,
    and with *readonly* every transaction of the session READ ONLY; a failure as :func:`translate`'s
    (the connection closed)."""
    psycopg = psycopg_module()
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=10, application_name=application_name,
                               **options)
    except psycopg.Error as exc:
        raise translate(exc, label, user=user) from None
    try:
        for statement in setup:
            conn.execute(statement)
        if readonly:
            conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    except psycopg.Error as exc:
        conn.close()
        raise translate(exc, label, user=user) from None
    return conn


__all__ = ["AUTH", "CONFIG_WORDS", "READ_ONLY", "SCHEMES", "TRANSIENT_CLASSES", "connect", "is_url",
           "psycopg_module", "redact", "translate"]
