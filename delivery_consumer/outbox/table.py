"""The outbox table in the producer's database: schema, connection,
transaction and :func:`enqueue`.

The outbox is a guest in the producer's database, so it does not touch
``PRAGMA user_version`` (the producer's own): its schema version is the key
``version`` of the table ``outbox_meta``, with forward-only migrations like
the store's. A database written by older code is upgraded when it is opened
for writing; a newer one is refused.

``outbox`` (STRICT), one row per eventId; ``seq`` is the creation order.
``status`` is the row's place in the stream, plain SQL for anyone reading it:

* ``pending`` -- waits for the dispatcher (maybe leased, in backoff, or held
  behind an earlier row of its article);
* ``published`` -- confirmed by the broker (``published_at``);
* ``quarantined`` -- left the stream after a permanent failure, or after
  ``max_attempts`` transient ones (``quarantined_at``, ``quarantine_reason``);
  ``outbox requeue`` puts it back (``requeued_at``, ``requeued_by``);
* ``dropped`` -- given up on purpose by a person (``dropped_at``,
  ``dropped_by``, ``drop_reason``).
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any, Final

from ..model.envelope import Envelope, from_mapping, parse
from ..model.errors import EVENT_ID_REUSED, DatabaseError, OutboxError, Rejection
from ..model.event_types import EventTypes
from ..observability import tracing
from ..store import sqlite
from ..store.sqlite import DEFAULT_BUSY_TIMEOUT_MS, now_iso
from . import wake

#: Forward-only migrations of the outbox tables; ``outbox_meta.version`` is
#: the number applied. Never edit an entry: append one.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE outbox_meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) STRICT;
    CREATE TABLE outbox (
        seq             INTEGER PRIMARY KEY AUTOINCREMENT,
        event_id        TEXT NOT NULL UNIQUE,
        routing_key     TEXT NOT NULL,
        ordering_key    TEXT NOT NULL,
        body            BLOB NOT NULL,
        fingerprint     TEXT NOT NULL,
        created_at      TEXT NOT NULL,
        attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
        last_error      TEXT,
        last_attempt_at TEXT,
        next_attempt_at TEXT,
        lease_owner     TEXT,
        lease_until     TEXT,
        published_at    TEXT
    ) STRICT;
    CREATE INDEX outbox_unpublished ON outbox (seq) WHERE published_at IS NULL;
    CREATE INDEX outbox_published_at ON outbox (published_at) WHERE published_at IS NOT NULL;
    """,
    # Quarantine, drop and requeue; the failures that count toward quarantine
    # (an outage does not); the dispatchers' identities and heartbeats, so
    # that the leases of a dead one are taken back at once. status has no
    # CHECK: SQLite evaluates it on every mark, a cost the dispatcher can
    # measure (bench/bench_dispatch.py --ab-ref --db-only); only this package
    # writes the column.
    """
    ALTER TABLE outbox ADD COLUMN status TEXT NOT NULL DEFAULT 'pending';
    UPDATE outbox SET status = 'published' WHERE published_at IS NOT NULL;
    ALTER TABLE outbox ADD COLUMN failures INTEGER NOT NULL DEFAULT 0 CHECK (failures >= 0);
    ALTER TABLE outbox ADD COLUMN quarantined_at TEXT;
    ALTER TABLE outbox ADD COLUMN quarantine_reason TEXT;
    ALTER TABLE outbox ADD COLUMN requeued_at TEXT;
    ALTER TABLE outbox ADD COLUMN requeued_by TEXT;
    ALTER TABLE outbox ADD COLUMN dropped_at TEXT;
    ALTER TABLE outbox ADD COLUMN dropped_by TEXT;
    ALTER TABLE outbox ADD COLUMN drop_reason TEXT;
    DROP INDEX outbox_unpublished;
    CREATE INDEX outbox_pending ON outbox (seq) WHERE status = 'pending';
    CREATE INDEX outbox_quarantined ON outbox (seq) WHERE status = 'quarantined';
    CREATE TABLE outbox_owners (
        owner        TEXT PRIMARY KEY,
        host         TEXT NOT NULL,
        boot_id      TEXT,
        pid          INTEGER NOT NULL,
        proc_start   TEXT,
        heartbeat_s  REAL NOT NULL CHECK (heartbeat_s > 0),
        started_at   TEXT NOT NULL,
        heartbeat_at TEXT NOT NULL
    ) STRICT;
    """,
)
VERSION: Final = len(MIGRATIONS)

#: Longest ``last_error`` / ``quarantine_reason`` kept (``outbox list`` shows them).
MAX_ERROR_CHARS: Final = 160

#: AMQP 0-9-1 short strings (routing keys, message ids) are at most 255 bytes.
MAX_ROUTING_KEY_BYTES: Final = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def routing_key_problem(key: object) -> str | None:
    """Why *key* cannot be a routing key (None when it can): AMQP carries it
    as a short string (at most 255 UTF-8 bytes); control characters are
    refused as well (they break logs, and nobody binds to them on purpose)."""
    if not isinstance(key, str):
        return f"routing key must be a string, not {type(key).__name__}"
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "routing key is not valid UTF-8 (it contains a lone surrogate)"
    if size > MAX_ROUTING_KEY_BYTES:
        return f"routing key is {size} bytes in UTF-8, over AMQP's limit of {MAX_ROUTING_KEY_BYTES}"
    if _CONTROL.search(key):
        return "routing key contains a control character"
    return None


# -- the database ----------------------------------------------------------------


def connect(
    path: Path | str, *, readonly: bool = False, install_tables: bool = True,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
) -> sqlite3.Connection:
    """Open the producer's database through :func:`delivery_consumer.store.sqlite.connect`.

    Autocommit mode with explicit ``BEGIN IMMEDIATE`` / ``COMMIT`` (see
    :func:`transaction`), WAL with ``synchronous=FULL`` (a row the producer
    committed survives power loss), ``busy_timeout``. Writable connections
    create the file and install (or upgrade) the outbox tables
    (``install_tables=False`` to leave that to the caller); read-only ones
    (``mode=ro``) require them.
    """
    path = Path(path)
    if readonly and not path.is_dir() and not path.is_file():
        raise DatabaseError(f"{path}: no such database")
    if not readonly and not path.is_dir():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatabaseError(f"{path}: cannot create its directory: {exc.strerror or exc}") from None

    def check(conn: sqlite3.Connection) -> None:
        if not readonly:
            _check_foreign(conn, path)
            return
        version = installed_version(conn)
        if version == 0:
            _check_foreign(conn, path)
            raise DatabaseError(f"{path}: no outbox in this database")
        if version > VERSION:
            raise DatabaseError(f"{path}: outbox schema version {version} is newer than this code's {VERSION}")
        if version < VERSION:
            raise DatabaseError(f"{path}: outbox schema version {version} is older than this code's {VERSION};"
                                " open it once for writing (e.g. run dispatch) to upgrade it")

    conn = sqlite.connect(path, readonly=readonly, busy_timeout_ms=busy_timeout_ms, check=check)
    if install_tables and not readonly:
        with sqlite.closed_on_failure(conn, path):
            install(conn)
    return conn


def _check_foreign(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse a consumer's inbox database before switching anything in it."""
    names = sqlite.table_names(conn)
    if "inbox" in names and "meta" in names:
        raise DatabaseError(f"{path}: this is a consumer's inbox database, not a producer's")


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK``) on *conn*, as
    :func:`delivery_consumer.store.sqlite.transaction` but with a finer wait for
    the write lock (:func:`_begin`); after a COMMIT that enqueued rows the
    dispatchers on this host are woken (:func:`notify`).

    Transactions do not nest: on a connection with a transaction already
    open this raises :class:`OutboxError` and leaves that transaction as it
    is (open, with everything written in it), so the caller decides. Only
    what this call began is ever rolled back.
    """
    if conn.in_transaction:
        raise OutboxError("outbox.transaction cannot be nested: this connection already has an open transaction"
                          " (call outbox.enqueue inside it instead)")
    key = id(conn)
    _owed.discard(key)
    try:
        _begin(conn)
    except sqlite3.Error as exc:  # nothing was begun: nothing to roll back
        raise sqlite.translate(exc, sqlite.path_of(conn)) from None
    try:
        yield conn
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        _owed.discard(key)
        sqlite.rollback(conn)
        raise sqlite.translate(exc, sqlite.path_of(conn)) from None
    except BaseException:
        _owed.discard(key)
        sqlite.rollback(conn)
        raise
    if key in _owed:  # committed with rows in it: wake the dispatchers now, not at their next poll
        notify(conn)


#: SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ... 100 ms between
#: tries: a producer and a dispatcher taking turns on the write lock hundreds
#: of times a second would each wait tens of milliseconds behind the other's
#: sub-millisecond transactions. ``BEGIN IMMEDIATE`` is retried from this
#: pause, doubled up to the longest, within the connection's busy timeout.
_FIRST_PAUSE_S: Final = 0.0002
_LONGEST_PAUSE_S: Final = 0.0005


def _begin(conn: sqlite3.Connection) -> None:
    """``BEGIN IMMEDIATE``, retried every few hundred microseconds while
    another connection holds the write lock, up to *conn*'s busy timeout."""
    timeout_ms = int(conn.execute("PRAGMA busy_timeout").fetchone()[0])
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        deadline = time.monotonic() + timeout_ms / 1000
        pause = _FIRST_PAUSE_S
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF != _SQLITE_BUSY or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, _LONGEST_PAUSE_S)
    finally:
        with suppress(sqlite3.Error):
            conn.execute(f"PRAGMA busy_timeout = {timeout_ms}")


_SQLITE_BUSY: Final = 5

#: id() of the connections whose open transaction enqueued a row (sqlite3
#: connections take no attributes and no weak references); a stale entry
#: costs at most one needless wake-up.
_owed: set[int] = set()


def notify(conn: sqlite3.Connection) -> int:
    """Tell the dispatchers on this host that *conn*'s database has rows
    waiting; returns how many were told.

    :func:`transaction` calls it after a COMMIT that enqueued rows. A
    producer that enqueues inside its own transaction and commits it itself
    calls it after that COMMIT; without it the rows wait for the
    dispatcher's next poll (``dispatch --poll``). Best-effort: never blocks,
    never raises, and a call before the COMMIT wakes a dispatcher too early
    to see the rows.
    """
    _owed.discard(id(conn))
    path = wake.database_file(conn)
    return 0 if path is None else wake.notify_path(path)


def installed_version(conn: sqlite3.Connection) -> int:
    """The outbox schema version of the database (0: not installed)."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'outbox_meta'"
    ).fetchone()
    if exists is None:
        return 0
    row = conn.execute("SELECT value FROM outbox_meta WHERE key = 'version'").fetchone()
    return int(row[0]) if row else 0


def install(conn: Any) -> int:
    """Create or upgrade the outbox tables; returns the version now installed.

    Runs inside the caller's open transaction if there is one (the caller
    commits), otherwise in its own ``BEGIN IMMEDIATE`` transaction.
    Idempotent. Refuses a database whose outbox is newer than this code.
    *conn* may also be a psycopg 3 connection (:func:`.pg.install`).
    """
    if not isinstance(conn, sqlite3.Connection):
        from . import pg

        return pg.install(conn)
    with nullcontext(conn) if conn.in_transaction else sqlite.transaction(conn):
        version = installed_version(conn)
        sqlite.migrate(conn, MIGRATIONS, version, what="outbox schema")
        if version < VERSION:
            conn.execute("INSERT OR REPLACE INTO outbox_meta (key, value) VALUES ('version', ?)", (str(VERSION),))
            if version == 0:
                conn.execute("INSERT INTO outbox_meta (key, value) VALUES ('created_at', ?)", (now_iso(),))
    return VERSION


# -- enqueue ------------------------------------------------------------------------


def enqueue(
    conn: Any, envelope: Envelope | Mapping[str, Any] | bytes, *, routing_key: str | None = None,
    types: EventTypes | None = None,
) -> bool:
    """Add *envelope* to the outbox inside the caller's open transaction.

    The envelope (an :class:`Envelope`, a dict or raw JSON bytes) is validated
    against its declared type (:class:`Rejection` otherwise) and stored as its
    canonical bytes. *types*: the producer's declared event types (default:
    ``event_types.default_types()``, the material types plus the installed
    and declared ones); an Envelope was validated already. The routing key
    defaults to the event type; one AMQP
    cannot carry (over 255 UTF-8 bytes, control characters) is refused with
    :class:`OutboxError`. The ordering key is the type's key (``articleId``,
    ``orderId``, ...): the dispatcher keeps each key's events in order and
    routes them to its partition slot.

    Returns True when a row was added, False when the same eventId is already
    there with the same fingerprint (a no-op). The same eventId with another
    body raises :class:`Rejection` ``event-id-reused``; the caller's
    transaction is left open for it to roll back.

    *conn*: the sqlite3 connection of the producer's open transaction, or a
    psycopg 3 connection (or a SQLAlchemy ``Session`` / ``Connection`` on
    psycopg) inside the application's transaction (docs/outbox.md).

    Raises :class:`OutboxError` outside a transaction (the row would commit
    on its own, apart from the producer's change it must go with), on a
    database without the outbox installed, and for an envelope that is not an
    Envelope, a mapping or bytes.
    """
    if not isinstance(conn, sqlite3.Connection):  # psycopg, or SQLAlchemy on psycopg
        from . import pg

        env, key = _prepared(envelope, routing_key, types)
        stored_pg = pg.enqueue_row(conn, env.event_id, key, env.key, env.canonical, env.fingerprint)
        if stored_pg is None:
            return True
        return _reused(env, stored_pg)
    if not conn.in_transaction:
        raise OutboxError("enqueue needs the caller's open transaction (BEGIN IMMEDIATE first)")
    env, key = _prepared(envelope, routing_key, types)
    try:
        cur = conn.execute(
            "INSERT INTO outbox (event_id, routing_key, ordering_key, body, fingerprint, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (event_id) DO NOTHING",
            (env.event_id, key, env.key, env.canonical, env.fingerprint, now_iso()),
        )
    except sqlite3.OperationalError as exc:
        if installed_version(conn) == 0:
            raise OutboxError(f"{sqlite.path_of(conn)}: the outbox is not installed in this database"
                              " (open it with outbox.connect, or call outbox.install first)") from None
        raise sqlite.translate(exc, sqlite.path_of(conn)) from None
    if cur.rowcount == 1:
        if len(_owed) > 10_000:
            _owed.clear()
        _owed.add(id(conn))
        return True
    row = conn.execute("SELECT fingerprint FROM outbox WHERE event_id = ?", (env.event_id,)).fetchone()
    return _reused(env, row[0] if row else "?")


def _prepared(envelope: Envelope | Mapping[str, Any] | bytes, routing_key: str | None,
              types: EventTypes | None) -> tuple[Envelope, str]:
    """The validated envelope (with the current trace context) and its routing key, whichever database."""
    if isinstance(envelope, Envelope):
        env = envelope
    elif isinstance(envelope, bytes | bytearray | memoryview):
        env = parse(bytes(envelope), types=types)
    elif isinstance(envelope, Mapping):
        env = from_mapping(envelope, types)
    else:
        raise OutboxError(f"enqueue takes an Envelope, a dict or JSON bytes, not {type(envelope).__name__}")
    env = tracing.stamp(env)  # the current trace context into meta.traceparent (outside the fingerprint)
    key = env.type if routing_key is None or routing_key == "" else routing_key
    problem = routing_key_problem(key)
    if problem is not None:
        raise OutboxError(f"cannot enqueue {env.event_id}: {problem}")
    return env, key


def _reused(env: Envelope, stored_fingerprint: str) -> bool:
    """False (a no-op) when the stored row has *env*'s fingerprint; else ``event-id-reused``."""
    if stored_fingerprint == env.fingerprint:
        return False
    stored = stored_fingerprint[:12]
    raise Rejection(
        EVENT_ID_REUSED,
        f"eventId is already in the outbox with fingerprint {stored}…, this body differs",
        event_id=env.event_id,
        fingerprint=env.fingerprint,
    )


__all__ = [
    "MAX_ERROR_CHARS",
    "MAX_ROUTING_KEY_BYTES",
    "MIGRATIONS",
    "VERSION",
    "OutboxError",
    "connect",
    "enqueue",
    "install",
    "installed_version",
    "notify",
    "routing_key_problem",
    "transaction",
]
