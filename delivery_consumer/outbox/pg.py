"""The outbox in the producer's own PostgreSQL (psycopg 3, the ``postgres`` extra).

The tables are those of the SQLite outbox (the same columns, the same
``status`` values, timestamps as the same ISO-8601 UTC text), so the
dispatcher, the owners' table and the operator's queries are shared
(:mod:`.db`). What is PostgreSQL's own:

* :func:`install` -- the schema, versioned in ``outbox_meta`` like SQLite's,
  under an advisory lock (two installers at once);
* :func:`enqueue_row` -- the INSERT on the caller's psycopg connection (or
  SQLAlchemy ``Session`` / ``Connection`` on psycopg), refused outside an
  open transaction;
* :class:`PgDb` -- the dispatcher's connection: claims serialised by an
  advisory transaction lock, errors mapped to the project's (an outage or a
  timeout is waited out, a standby or bad credentials exit 2), a lost
  connection reopened at the next statement;
* :class:`PgListener` -- ``LISTEN``: a statement trigger on ``outbox``
  notifies every dispatcher on every host at commit.

Design notes: docs/outbox.md, "the outbox in the producer's own PostgreSQL".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final

from ..model.errors import DatabaseError, DeliveryError, OutboxError
from ..store.postgres import connect as _connect
from ..store.postgres import psycopg_module, redact
from ..store.postgres import translate as _translate
from ..store.sqlite import now_iso

if TYPE_CHECKING:
    import psycopg

    from .seam import Cursor, OutboxDb

#: The channel the outbox's trigger notifies (payload: the table's schema).
CHANNEL: Final = "delivery_consumer_outbox"

#: Forward-only migrations of the PostgreSQL outbox; ``outbox_meta.version``
#: is the number applied. Each entry is a list of statements.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE outbox_meta (key text PRIMARY KEY, value text NOT NULL)",
        """CREATE TABLE outbox (
            seq               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            event_id          text NOT NULL UNIQUE,
            routing_key       text NOT NULL,
            ordering_key      text NOT NULL,
            body              bytea NOT NULL,
            fingerprint       text NOT NULL,
            created_at        text NOT NULL,
            attempts          integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
            last_error        text,
            last_attempt_at   text,
            next_attempt_at   text,
            lease_owner       text,
            lease_until       text,
            published_at      text,
            status            text NOT NULL DEFAULT 'pending'
                              CHECK (status IN ('pending', 'published', 'quarantined', 'dropped')),
            failures          integer NOT NULL DEFAULT 0 CHECK (failures >= 0),
            quarantined_at    text,
            quarantine_reason text,
            requeued_at       text,
            requeued_by       text,
            dropped_at        text,
            dropped_by        text,
            drop_reason       text
        )""",
        "CREATE INDEX outbox_pending ON outbox (seq) WHERE status = 'pending'",
        "CREATE INDEX outbox_quarantined ON outbox (seq) WHERE status = 'quarantined'",
        "CREATE INDEX outbox_published_at ON outbox (published_at) WHERE published_at IS NOT NULL",
        """CREATE TABLE outbox_owners (
            owner        text PRIMARY KEY,
            host         text NOT NULL,
            boot_id      text,
            pid          integer NOT NULL,
            proc_start   text,
            heartbeat_s  double precision NOT NULL CHECK (heartbeat_s > 0),
            started_at   text NOT NULL,
            heartbeat_at text NOT NULL
        )""",
        # One notification per committing transaction (PostgreSQL folds equal
        # ones), delivered at COMMIT, to every listening dispatcher on any host.
        f"""CREATE FUNCTION outbox_wake() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_notify('{CHANNEL}', TG_TABLE_SCHEMA); RETURN NULL; END $$""",
        "CREATE TRIGGER outbox_wake AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION outbox_wake()",
    ),
)
VERSION: Final = len(MIGRATIONS)

_USER: Final = "the outbox"


def _psycopg() -> Any:
    return psycopg_module("the outbox on PostgreSQL")


def translate(exc: Exception, label: str) -> DeliveryError:
    """A psycopg error as the project's (:func:`..store.postgres.translate`): StoreUnavailable
    (wait) or DatabaseError (exit 2: a standby, bad credentials, no outbox)."""
    return _translate(exc, label, user=_USER, missing_table="no outbox in this database")


_NUMBERED = re.compile(r"\?(\d+)")
_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


@lru_cache(maxsize=256)
def rewrite(sql: str) -> tuple[str, bool]:
    """SQLite's parameter style (``?``, ``?1``, ``:name``) as psycopg's; True
    when the parameters must be given as a mapping ``{"p1": ...}``."""
    numbered = bool(_NUMBERED.search(sql))
    out = sql.replace("%", "%%")
    out = _NUMBERED.sub(lambda m: f"%(p{m.group(1)})s", out)
    named = bool(_NAMED.search(out))
    out = _NAMED.sub(lambda m: f"%({m.group(1)})s", out)
    out = out.replace("?", "%s")
    return out, numbered or named


def _params(params: Sequence[Any] | Mapping[str, Any], mapped: bool) -> Any:
    if mapped and not isinstance(params, Mapping):
        return {f"p{i}": value for i, value in enumerate(params, 1)}
    return params


def _transaction_open(conn: Any) -> bool:
    """Whether the psycopg connection *conn* has a transaction open (and not failed)."""
    from psycopg.pq import TransactionStatus

    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise OutboxError("enqueue: the caller's transaction has failed already (roll it back)")
    return bool(status == TransactionStatus.INTRANS)


def driver(conn: Any) -> tuple[Any, bool]:
    """The psycopg connection behind *conn* (psycopg's own, a SQLAlchemy
    ``Session`` or ``Connection`` on psycopg) and whether its transaction is open."""
    psycopg = _psycopg()
    if isinstance(conn, psycopg.Connection):
        return conn, _transaction_open(conn)
    if type(conn).__module__.startswith("sqlalchemy."):
        # SQLAlchemy begins the DBAPI transaction at its first statement: its own
        # flag says whether the application's transaction is open.
        in_tx = bool(conn.in_transaction())
        sa_conn = conn.connection() if hasattr(conn, "get_bind") else conn
        raw = sa_conn.connection.driver_connection
        if isinstance(raw, psycopg.Connection):
            return raw, in_tx
    raise OutboxError(f"enqueue takes a sqlite3 or psycopg 3 connection, or a SQLAlchemy Session or Connection on"
                      f" psycopg, not {type(conn).__module__}.{type(conn).__name__}")


def installed_version(conn: Any) -> int:
    """The outbox schema version of the database behind the psycopg connection *conn* (0: none)."""
    from psycopg.rows import tuple_row

    cur = conn.cursor(row_factory=tuple_row)
    if cur.execute("SELECT to_regclass('outbox_meta')").fetchone()[0] is None:
        return 0
    row = cur.execute("SELECT value FROM outbox_meta WHERE key = 'version'").fetchone()
    return int(row[0]) if row else 0


def install(conn: Any, label: str = "postgresql") -> int:
    """Create or upgrade the outbox tables through the psycopg connection *conn*
    (in the caller's open transaction if there is one, else in its own)."""
    from psycopg.rows import tuple_row

    psycopg = _psycopg()
    try:
        with nullcontext() if _transaction_open(conn) else conn.transaction():
            cur = conn.cursor(row_factory=tuple_row)
            cur.execute("SELECT pg_advisory_xact_lock(hashtext('delivery_consumer.outbox.install:'"
                        " || current_schema()))")
            version = installed_version(conn)
            if version > VERSION:
                raise DatabaseError(f"{label}: outbox schema version {version} is newer than this code's {VERSION}")
            for script in MIGRATIONS[version:]:
                for statement in script:
                    cur.execute(statement)
            if version < VERSION:
                cur.execute("INSERT INTO outbox_meta (key, value) VALUES ('version', %s)"
                            " ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(VERSION),))
                if version == 0:
                    cur.execute("INSERT INTO outbox_meta (key, value) VALUES ('created_at', %s)", (now_iso(),))
    except psycopg.Error as exc:
        raise translate(exc, label) from None
    return VERSION


def enqueue_row(conn: Any, event_id: str, routing_key: str, ordering_key: str, body: bytes,
                fingerprint: str) -> str | None:
    """INSERT the row in the caller's open transaction; None when added, else
    the fingerprint already stored under *event_id*."""
    from psycopg.rows import tuple_row

    psycopg = _psycopg()
    raw, in_tx = driver(conn)
    if not in_tx:
        raise OutboxError("enqueue needs the caller's open transaction (psycopg: `with conn.transaction():`,"
                          " SQLAlchemy: `with session.begin():`)")
    cur = raw.cursor(row_factory=tuple_row)
    try:
        cur.execute("INSERT INTO outbox (event_id, routing_key, ordering_key, body, fingerprint, created_at)"
                    " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (event_id) DO NOTHING",
                    (event_id, routing_key, ordering_key, body, fingerprint, now_iso()))
        if cur.rowcount == 1:
            return None
        row = cur.execute("SELECT fingerprint FROM outbox WHERE event_id = %s", (event_id,)).fetchone()
    except psycopg.errors.UndefinedTable:
        raise OutboxError("the outbox is not installed in this database (call outbox.install(conn) first);"
                          " the transaction is aborted: roll it back") from None
    except psycopg.Error as exc:
        raise translate(exc, "postgresql") from None
    return str(row[0]) if row else "?"


class PgListener:
    """``LISTEN`` on a connection of its own; :meth:`fileno` is readable when a
    producer committed rows (or when the connection broke: :attr:`broken`)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.broken = False

    @classmethod
    def open(cls, url: str) -> PgListener | None:
        psycopg = _psycopg()
        try:
            conn = psycopg.connect(url, autocommit=True, connect_timeout=10,
                                   application_name="delivery-consumer dispatch (listen)")
            conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error:
            return None
        return cls(conn)

    def fileno(self) -> int:
        return int(self._conn.pgconn.socket)

    def drain(self) -> int:
        """Read every notification waiting; how many (at least 1 when the
        connection broke, so that the dispatcher looks at once)."""
        psycopg = _psycopg()
        pgconn = self._conn.pgconn
        try:
            pgconn.consume_input()
        except psycopg.Error:
            self.broken = True
            return 1
        n = 0
        while pgconn.notifies() is not None:
            n += 1
        return n

    def close(self) -> None:
        with suppress(Exception):
            self._conn.close()


class PgDb:
    """:class:`~.db.OutboxDb` on PostgreSQL: the dispatcher's (or an operator
    command's) own connection, autocommit with explicit transactions; a lost
    connection is reopened at the next statement."""

    kind: Final = "postgres"
    seq_in_sql: Final = "seq = ANY(CAST(? AS bigint[]))"
    body_sql: Final = "octet_length(body)"
    created_ms_sql: Final = "CAST(round(extract(epoch FROM CAST(created_at AS timestamptz)) * 1000) AS bigint)"

    def __init__(self, url: str, *, readonly: bool = False) -> None:
        self.url = url
        self.label = redact(url)
        self.readonly = readonly
        self._conn: Any = None

    # -- the connection --

    def raw(self) -> psycopg.Connection[Any]:
        """The open psycopg connection (reopened when it was lost)."""
        if self._conn is None or self._conn.closed:
            conn = _connect(self.url, self.label, user=_USER, application_name="delivery-consumer outbox",
                            readonly=self.readonly)
            if not self.readonly:
                psycopg = _psycopg()
                try:
                    standby, read_only = conn.execute(
                        "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')").fetchone()
                except psycopg.Error as exc:
                    conn.close()
                    raise translate(exc, self.label) from None
                if standby or read_only == "on":
                    conn.close()
                    why = "a standby" if standby else "default_transaction_read_only is on"
                    raise DatabaseError(f"{self.label}: the database is read-only ({why}):"
                                        " the outbox needs a writable primary")
            self._conn = conn
        return self._conn  # type: ignore[no-any-return]

    def _fail(self, exc: Exception) -> DeliveryError:
        conn = self._conn
        if conn is not None and (conn.closed or conn.broken):
            with suppress(Exception):
                conn.close()
            self._conn = None
        return translate(exc, self.label)

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Cursor:
        psycopg = _psycopg()
        query, mapped = rewrite(sql)
        try:
            return self.raw().execute(query, _params(params, mapped))
        except psycopg.Error as exc:
            raise self._fail(exc) from None

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Cursor:
        psycopg = _psycopg()
        query, mapped = rewrite(sql)
        rows = [_params(row, mapped) for row in rows]
        cur = self.raw().cursor()
        if not rows:
            return cur
        try:
            cur.executemany(query, rows)
        except psycopg.Error as exc:
            raise self._fail(exc) from None
        return cur

    def scan(self, sql: str, params: Sequence[Any] = (), chunk: int = 1000) -> Cursor:
        psycopg = _psycopg()
        query, mapped = rewrite(sql)
        cur = self.raw().cursor(name="outbox_scan")
        cur.itersize = max(chunk, 100)
        try:
            cur.execute(query, _params(params, mapped))
        except psycopg.Error as exc:
            raise self._fail(exc) from None
        return cur

    @property
    def in_transaction(self) -> bool:
        from psycopg.pq import TransactionStatus

        return self._conn is not None and self._conn.info.transaction_status != TransactionStatus.IDLE

    @contextmanager
    def transaction(self) -> Iterator[OutboxDb]:
        psycopg = _psycopg()
        if self.in_transaction:
            raise OutboxError("outbox transactions do not nest")
        self.execute("BEGIN")
        try:
            yield self
            self.execute("COMMIT")
        except psycopg.Error as exc:
            self._rollback()
            raise self._fail(exc) from None
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        if self._conn is not None and not self._conn.closed:
            with suppress(Exception):
                self._conn.execute("ROLLBACK")

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        if self.in_transaction:
            yield
            return
        self.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            yield
        finally:
            self._rollback()

    def seqs(self, seqs: Iterable[int]) -> list[int]:
        return list(seqs)

    def lock_claims(self) -> None:
        # Claims see each other's leases: the per-key order needs that (see docs).
        self.execute("SELECT pg_advisory_xact_lock(hashtext('delivery_consumer.outbox.claim:' || current_schema()))")

    def reopen(self) -> OutboxDb:
        return PgDb(self.url, readonly=self.readonly)

    def listener(self) -> PgListener | None:
        return PgListener.open(self.url)

    def check_alive(self) -> None:
        """A server's database cannot be swapped under an open connection."""

    def close(self) -> None:
        if self._conn is not None:
            with suppress(Exception):
                self._conn.close()
            self._conn = None


def connect(url: str, *, readonly: bool = False, install_tables: bool = True) -> PgDb:
    """The outbox at *url*, connected now (DatabaseError: bad credentials, a
    standby, no outbox when read-only; StoreUnavailable: the server is down)."""
    db = PgDb(url, readonly=readonly)
    conn = db.raw()
    try:
        version = installed_version(conn)
    except Exception as exc:
        db.close()
        raise translate(exc, db.label) from None
    if readonly:
        if version == 0:
            db.close()
            raise DatabaseError(f"{db.label}: no outbox in this database")
        if version != VERSION:
            db.close()
            raise DatabaseError(f"{db.label}: outbox schema version {version}, this code's is {VERSION}")
    elif install_tables and version != VERSION:
        try:
            install(conn, db.label)
        except BaseException:
            db.close()
            raise
    return db


__all__ = ["CHANNEL", "MIGRATIONS", "VERSION", "PgDb", "PgListener", "connect", "driver", "enqueue_row", "install",
           "installed_version", "redact", "rewrite", "translate"]
