"""A consumer's inbox in PostgreSQL (psycopg 3, the ``postgres`` extra).

The same applier as SQLite's (``inbox/apply.py``): :class:`PgTransaction`
overrides only the steps its dialect words otherwise -- BEGIN/COMMIT, the
statements whose functions differ, how an error is sorted -- and takes a
transaction-level advisory lock on each eventId of a batch before its
receipts are read, so that two processes never both apply one event.

* :class:`PgConnection` -- what an effect is handed: ``execute``,
  ``executemany`` with SQLite's ``?`` parameters (translated once per
  statement text), ``dialect == "postgres"``;
* :class:`PgInboxDB` -- a consumer's inbox in one schema of a database
  (several consumers share a database, one schema each), migrated under an
  advisory lock; :func:`portable_ddl` turns a consumer's SQLite migrations
  into PostgreSQL's where it gives no ``postgres_migrations``.

Why and what differs: docs/postgres-inbox.md.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from functools import lru_cache
from typing import Any, Final

import orjson

from ..amqp.partitions import Identity, identity_from_meta
from ..model.contract import ConsumerSpec, Outcome
from ..model.envelope import Envelope
from ..model.errors import ConfigError, DatabaseError, DeliveryError, Rejection, StoreUnavailable, WrongDatabase
from ..store.dbfile import ContentTags, FileGuard
from ..store.postgres import connect as _connect
from ..store.postgres import is_url, redact
from ..store.postgres import psycopg_module as _psycopg_module
from ..store.postgres import translate as _translate
from ..store.sqlite import now_iso
from ..version import __version__
from .apply import Transaction
from .database import CONSUMER_VERSION_KEY, DATABASE_ID, SCHEMA_BY_KEY, SEAL_KEY, IntegrityCheck, SpecLookup

#: The dialect an effect reads from ``conn.dialect`` (``contract.dialect``).
DIALECT: Final = "postgres"

#: Forward-only migrations of the inbox's own tables on PostgreSQL, one list of
#: statements per entry; ``meta.store_version`` is the number applied. The same
#: tables and columns as SQLite's (times as the same ISO-8601 text), with a
#: ``seq`` where SQLite has its rowid; no receipt counters (``inbox stats``
#: counts over the ``received_at`` index instead).
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE meta (key text PRIMARY KEY, value text NOT NULL)",
        """CREATE TABLE inbox (
            event_id      text PRIMARY KEY,
            seq           bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
            fingerprint   text NOT NULL,
            result        text NOT NULL,
            event_type    text NOT NULL,
            received_at   text NOT NULL,
            partition_key text,
            meta          text,
            origin        text
        )""",
        "CREATE INDEX inbox_received_at ON inbox (received_at)",
        """CREATE TABLE rejected (
            id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            code          text NOT NULL,
            reason        text NOT NULL,
            event_id      text,
            fingerprint   text,
            body_sha256   text,
            source        text,
            attempts      integer NOT NULL DEFAULT 0,
            dead_letter   text,
            rejected_at   text NOT NULL,
            resolved_at   text,
            partition_key text,
            origin        text
        )""",
        "CREATE INDEX rejected_event_id ON rejected (event_id)",
        "CREATE INDEX rejected_at ON rejected (rejected_at)",
        """CREATE TABLE deliveries (
            key          text PRIMARY KEY,
            event_id     text,
            deliveries   bigint NOT NULL,
            redeliveries bigint NOT NULL,
            attempts     bigint NOT NULL,
            crashes      bigint NOT NULL DEFAULT 0,
            first_at     text NOT NULL,
            last_at      text NOT NULL,
            last_outcome text
        )""",
        "CREATE INDEX deliveries_last_at ON deliveries (last_at)",
        "CREATE TABLE in_flight (owner text PRIMARY KEY, keys text NOT NULL, started_at text NOT NULL)",
        "CREATE TABLE ce_sources (source text PRIMARY KEY, first_at text NOT NULL)",
    ),
)
STORE_VERSION: Final = len(MIGRATIONS)
_STORE_VERSION_KEY: Final = "store_version"

_USER: Final = "the inbox"


def psycopg_module() -> Any:
    """psycopg, or DatabaseError naming the extra to install."""
    return _psycopg_module("a consumer's inbox on PostgreSQL")


def translate(exc: BaseException, label: str) -> DeliveryError:
    """A psycopg error as the project's (:func:`..store.postgres.translate`): StoreUnavailable (an
    outage, a serialization failure, a deadlock, a lost connection: wait, spend nothing) or
    DatabaseError (bad credentials, a standby, no such database: exit 2)."""
    return _translate(exc, label, user=_USER)


_NUMBERED: Final = re.compile(r"\?(\d+)")


@lru_cache(maxsize=1024)
def rewrite(sql: str) -> tuple[str, tuple[int, ...] | None]:
    """SQLite's ``?`` and ``?N`` parameters as psycopg's ``%s``, once per
    statement text: the text, and for ``?N`` the parameter taken by each
    ``%s`` in turn (None: in order). A ``%`` of the text is doubled. A ``?``
    inside a string literal is not a parameter in SQLite: keep it out of
    literals (none of the toolkit's statements has one)."""
    out = sql.replace("%", "%%")
    if not _NUMBERED.search(out):
        return out.replace("?", "%s"), None
    order: list[int] = []

    def numbered(match: re.Match[str]) -> str:
        order.append(int(match.group(1)) - 1)
        return "%s"

    return _NUMBERED.sub(numbered, out), tuple(order)


def _bind(params: Any, order: tuple[int, ...] | None) -> Any:
    if order is None or isinstance(params, Mapping):
        return params
    return [params[i] for i in order]


class PgConnection:
    """What an effect is handed on PostgreSQL (``contract.Connection``): the
    consumer's psycopg connection, inside the store's transaction, spoken to
    in SQLite's parameter style. ``raw`` is psycopg's own connection, for
    what an effect does in PostgreSQL's own way (``%s`` parameters).

    Inside the store's transaction psycopg's errors go on as they are (the
    applier tells an event's from the transaction's); outside it (a read
    between batches) a lost connection is opened again first, and an error
    leaves as the project's (StoreUnavailable: run waits)."""

    dialect: Final = DIALECT
    __slots__ = ("_db", "_raw", "begin", "commit_pending", "in_transaction", "last")

    def __init__(self, db: PgInboxDB) -> None:
        self._db = db
        self._raw: Any = None
        #: Set by the store's transaction from its start to its end.
        self.in_transaction = False
        #: The transaction's opening statements not sent yet (BEGIN, the eventId locks) with
        #: their parameters: they go with its first statement, in one round trip (a pipeline).
        self.begin: list[tuple[str, Any]] | None = None
        #: An unsynced transaction's COMMIT not sent yet: it goes first with the next
        #: statement (nothing is acknowledged on such a transaction; see PgTransaction).
        self.commit_pending = False
        #: Statements whose result nobody reads, sent with the transaction's COMMIT (:meth:`at_commit`).
        self.last: list[tuple[str, Any]] = []

    @property
    def raw(self) -> Any:
        return self._raw

    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        if self.in_transaction:
            if self.begin is not None:
                return self._first(lambda raw: _execute(raw, sql, parameters))
            return _execute(self._raw, sql, parameters)
        return self._outside(lambda raw: _execute(raw, sql, parameters))

    def executemany(self, sql: str, parameters: Iterable[Any], /) -> Any:
        if self.in_transaction:
            if self.begin is not None:
                return self._first(lambda raw: _executemany(raw, sql, parameters))
            return _executemany(self._raw, sql, parameters)
        return self._outside(lambda raw: _executemany(raw, sql, parameters))

    def at_commit(self, sql: str, parameters: Any = (), /) -> None:
        """Run *sql* at the end of the store's transaction, in one round trip with its COMMIT
        (a write whose result nobody reads: its failure fails the commit). Outside a
        transaction, at once."""
        if self.in_transaction:
            self.last.append((sql, parameters))
        else:
            self.execute(sql, parameters)

    def _first(self, work: Callable[[Any], Any]) -> Any:
        """The transaction's opening statements and its first one, in one round trip."""
        raw, begin = self._raw, self.begin or []
        if self.commit_pending:
            begin = [("COMMIT", ()), *begin]
            self.commit_pending = False
        self.begin = None
        with raw.pipeline():
            for statement, parameters in begin:
                _execute(raw, statement, parameters)
            return work(raw)

    def execute_all(self, statements: Sequence[tuple[str, Any]]) -> None:
        """*statements* (text, parameters) in the store's transaction, in one round trip."""
        if self.begin is not None:  # nothing sent yet: they go with the opening statements
            self.begin.extend(statements[:-1])
            sql, parameters = statements[-1]
            self.execute(sql, parameters)
            return
        with self._raw.pipeline():
            for sql, parameters in statements:
                _execute(self._raw, sql, parameters)

    def _outside(self, work: Callable[[Any], Any]) -> Any:
        psycopg = psycopg_module()
        raw = self._db.connected()
        try:
            return work(raw)
        except psycopg.Error as exc:
            raise translate(exc, self._db.label) from None


def _execute(raw: Any, sql: str, parameters: Any) -> Any:
    if not parameters:  # psycopg reads no placeholder (nor %) in a statement without parameters
        return raw.execute(sql)
    text, order = rewrite(sql)
    return raw.execute(text, _bind(parameters, order))


def _executemany(raw: Any, sql: str, parameters: Iterable[Any]) -> Any:
    text, order = rewrite(sql)
    cur = raw.cursor()
    cur.executemany(text, parameters if order is None else (_bind(row, order) for row in parameters))
    return cur


_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def schema_for(consumer: str, partition: Identity | None = None) -> str:
    """The schema of *consumer*'s inbox (of one partition's): ``dc_<name>``,
    ``-`` as ``_``, and ``_p<N>of<count>`` for a partition."""
    name = "dc_" + re.sub(r"[^A-Za-z0-9_]", "_", consumer).lower()
    if partition is not None:
        name += f"_p{partition.partition}of{partition.count}"
    return name[:63]


def split_url(url: str) -> tuple[str, str | None]:
    """*url* without a ``schema=`` query parameter (libpq knows none), and that schema."""
    base, _, query = url.partition("?")
    kept, schema = [], None
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key == "schema":
            schema = value
        else:
            kept.append(item)
    return base + ("?" + "&".join(kept) if kept else ""), schema


# -- migrations of a consumer's own tables -------------------------------------------

_TABLE_OPTIONS: Final = re.compile(r"\)\s*(?:STRICT|WITHOUT\s+ROWID)(?:\s*,\s*(?:STRICT|WITHOUT\s+ROWID))*", re.I)
_TYPES: Final = (
    (re.compile(r"\bINTEGER\s+PRIMARY\s+KEY\b(\s+AUTOINCREMENT\b)?", re.I),
     "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b", re.I), "BIGINT"),
    (re.compile(r"\bREAL\b", re.I), "DOUBLE PRECISION"),
    (re.compile(r"\bBLOB\b", re.I), "BYTEA"),
    (re.compile(r"\bANY\b(?=\s*(?:,|\)|NOT|NULL|DEFAULT|CHECK))", re.I), "TEXT"),
)


def portable_ddl(script: str) -> str:
    """A consumer's SQLite migration as PostgreSQL's: the table options
    ``STRICT`` and ``WITHOUT ROWID`` dropped, ``INTEGER`` as ``BIGINT``
    (SQLite's integers are 64-bit), ``INTEGER PRIMARY KEY`` as an identity,
    ``REAL`` and ``BLOB`` as ``DOUBLE PRECISION`` and ``BYTEA``. Enough for
    the tables the docs show; anything else belongs in ``postgres_migrations``."""
    out = _TABLE_OPTIONS.sub(")", script)
    for pattern, replacement in _TYPES:
        out = pattern.sub(replacement, out)
    return out


def consumer_migrations(spec: ConsumerSpec) -> Sequence[str]:
    """The consumer's migrations on PostgreSQL: its own, or its SQLite ones translated."""
    if spec.postgres_migrations is not None:
        return spec.postgres_migrations
    return [portable_ddl(script) for script in spec.migrations]


# -- the transaction -------------------------------------------------------------------

_IDS: Final = "SELECT value FROM json_array_elements_text(CAST(? AS json))"


class PgTransaction(Transaction):
    """:class:`~.apply.Transaction` on PostgreSQL: READ COMMITTED, each batch's
    eventIds locked (``pg_advisory_xact_lock``, in one order) before their
    receipts are read, so that a second process applying one of them waits
    for the first's commit and then reads its receipt (each statement of READ
    COMMITTED sees what committed before it began)."""

    __slots__ = ("_ids", "_unsynced")
    CHECKS_FILE = False
    RECEIPTS_SELECT = f"SELECT event_id, fingerprint, result FROM inbox WHERE event_id IN ({_IDS})"
    SOURCE_INSERT = "INSERT INTO ce_sources (source, first_at) VALUES (?, ?) ON CONFLICT (source) DO NOTHING"
    DELIVERY_UPSERT = (
        "INSERT INTO deliveries AS d (key, event_id, deliveries, redeliveries, attempts, crashes,"
        " first_at, last_at, last_outcome) VALUES (?1, ?2, GREATEST(1, ?3), ?4, ?5, 0,"
        " CASE WHEN ?3 > 1 THEN coalesce((SELECT LEAST(received_at, ?6) FROM inbox WHERE event_id = ?2), ?6)"
        " ELSE ?6 END, ?6, ?7)"
        " ON CONFLICT (key) DO UPDATE SET"
        " deliveries = GREATEST(d.deliveries + ?8, ?3),"
        " redeliveries = d.redeliveries + ?4 * ?8,"
        " attempts = GREATEST(d.attempts, excluded.attempts),"
        " event_id = coalesce(excluded.event_id, d.event_id),"
        " last_at = excluded.last_at, last_outcome = excluded.last_outcome"
        " RETURNING deliveries, attempts, crashes"
    )
    #: The optimistic batch's receipts as one statement over one JSON array of rows (RECEIPT_INSERT's
    #: parameters, a row each, in order): psycopg's executemany sends and the server runs one
    #: statement per row, and the client's share of that was the largest cost of the store's path.
    RECEIPTS_INSERT = (
        "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at, partition_key, meta, origin)"
        " SELECT r->>0, r->>1, r->>2, r->>3, r->>4, r->>5, NULLIF(r->>6, ''), NULLIF(r->>7, '')"
        " FROM jsonb_array_elements(CAST(? AS jsonb)) AS r"
    )
    #: One advisory lock per eventId, keyed by the schema too (consumers sharing a
    #: database do not wait for each other), taken in the order of the keys.
    LOCK_IDS = ("SELECT count(pg_advisory_xact_lock(k)) FROM (SELECT DISTINCT"
                f" hashtextextended(current_schema() || ':' || value, 0) AS k FROM ({_IDS}) AS ids ORDER BY k) AS s")

    def __init__(self, db: PgInboxDB, now: str = "", *, unsynced: bool = False) -> None:
        super().__init__(db, now)
        spec = db.spec
        if spec.postgres_apply is not None:
            self.effect, self.apply_many_fn = spec.postgres_apply, None
        self._ids: str | None = None
        self._unsynced = unsynced

    def __enter__(self) -> Transaction:
        db: PgInboxDB = self.db  # type: ignore[assignment]
        try:
            db.connected(flush=False)
            # Sent with the transaction's first statement (PgConnection.begin).
            if self._unsynced:  # nothing is acknowledged on it
                self.conn.begin = [("BEGIN", ()), ("SET LOCAL synchronous_commit = off", ())]
            else:
                self.conn.begin = [("BEGIN", ())]
            self.conn.in_transaction = True
            self.now = now_iso()
        except Exception as exc:
            db.rollback()
            raise self._translated(exc) from None
        except BaseException:
            db.rollback()
            raise
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        db: PgInboxDB = self.db  # type: ignore[assignment]
        conn = self.conn
        last, conn.last = conn.last, []
        if exc is None and last:  # the statements left for the end, then the COMMIT: one round trip
            self._commit(db, lambda: conn.execute_all([*last, ("COMMIT", ())]))
            conn.in_transaction = False
            return
        conn.in_transaction = False
        if conn.begin is not None:  # not begun: no statement was sent
            conn.begin = None
            if exc is None:
                return
        elif exc is None and self._unsynced:
            # Its COMMIT goes first with the connection's next statement (the batch's locks
            # and receipts read: one round trip less), so before anything the batch does.
            self.conn.commit_pending = True
            return
        elif exc is None:
            self._commit(db, lambda: db.raw_in_transaction().execute("COMMIT"))
            return
        db.rollback()
        if isinstance(exc, psycopg_module().Error):
            raise self._translated(exc) from None

    def _commit(self, db: PgInboxDB, send: Callable[[], object]) -> None:
        """*send* the COMMIT; on any failure roll back and raise (a database error as the store's)."""
        try:
            send()
        except BaseException as error:
            db.rollback()
            if isinstance(error, Exception):
                raise self._translated(error) from None
            raise

    def _translated(self, exc: Exception) -> Exception:
        return translate(exc, str(self.db.path)) if isinstance(exc, psycopg_module().Error) else exc

    def apply_many(self, items: Sequence[Envelope | Rejection]) -> list[Outcome]:
        ids = [item.event_id for item in items if isinstance(item, Envelope)]
        if ids:
            self._ids = orjson.dumps(ids).decode()
            self._lock()
        return super().apply_many(items)

    def _write_receipts(self, rows: list[tuple[Any, ...]]) -> None:
        self.conn.execute(self.RECEIPTS_INSERT, (orjson.dumps(rows).decode(),))

    def _lock(self) -> None:
        """Lock the batch's eventIds: with the receipts' read that follows when the transaction has
        sent nothing yet (one round trip; the read's snapshot is taken after the locks, as the
        server runs a pipeline's statements in order), else now."""
        if self.conn.begin is not None:
            self.conn.begin.append((self.LOCK_IDS, (self._ids,)))
        else:
            self.conn.execute(self.LOCK_IDS, (self._ids,))

    def _restart(self) -> None:
        db: PgInboxDB = self.db  # type: ignore[assignment]
        try:
            db.raw_in_transaction().execute("ROLLBACK")
            self.conn.begin = [("BEGIN", ())]  # with the next statement
            if self._ids:
                self._lock()
        except Exception as exc:
            raise self._translated(exc) from None
        self._known = None

    @staticmethod
    def _raise_if_whole(exc: Exception) -> None:
        psycopg = psycopg_module()
        if isinstance(exc, psycopg.Error) and not isinstance(exc, psycopg.IntegrityError | psycopg.DataError):
            raise exc

    @staticmethod
    def _unstorable(exc: BaseException) -> bool:
        # A value its column's type refuses, out of range, a NUL in a text: the same bytes fail
        # the same way every time (class 22, data exception).
        psycopg = psycopg_module()
        return isinstance(exc, OverflowError | psycopg.DataError)

# -- the database ----------------------------------------------------------------------


class PgInboxDB:
    """A consumer's inbox in a PostgreSQL schema: the :class:`~.apply.Store` of
    :class:`PgTransaction`. One instance per thread; the connection is
    autocommit with explicit transactions, opened again at the next
    transaction once it was lost (the batch then waits: StoreUnavailable)."""

    #: The SQLite file's guard: none (no file can be replaced under a PostgreSQL database).
    guard: FileGuard | None = None

    def __init__(self, url: str, schema: str, spec: ConsumerSpec, readonly: bool) -> None:
        self.url = url
        self.schema = schema
        self.spec = spec
        self.readonly = readonly
        self.label = f"{redact(url)} (schema {schema})"
        self.partition: Identity | None = None
        self.created = False
        self.note: str | None = None
        self.count_due = 0.0
        self.clock_base = time.time() - time.monotonic()
        self.tags: ContentTags | None = None
        # The SQLite guards' counterparts: none needed (docs/postgres-inbox.md).
        self.integrity: IntegrityCheck | None = None
        self.superseded: threading.Event | None = None
        self.taken_over: Callable[[], bool] | None = None
        self._raw: Any = None
        self._conn = PgConnection(self)

    # -- the connection --

    @property
    def path(self) -> str:
        """The database for messages: its URL without the password, and the schema."""
        return self.label

    @property
    def conn(self) -> PgConnection:
        return self._conn

    @property
    def cursor(self) -> PgConnection:
        return self._conn

    @property
    def consumer(self) -> str:
        return self.spec.name

    def raw(self) -> Any:
        """The psycopg connection (opened again when it was lost)."""
        return self.connected()

    def raw_in_transaction(self) -> Any:
        """The psycopg connection of the open transaction, as it is (never opened again:
        a transaction does not go on on another connection)."""
        if self._raw is None:
            raise StoreUnavailable(f"{self.label}: the connection was lost", code="database-unavailable")
        return self._raw

    def connected(self, *, flush: bool = True) -> Any:
        """The psycopg connection, opened now when there is none or it was lost; with
        *flush*, an unsynced transaction's COMMIT still to send is sent first."""
        raw = self._raw
        if raw is not None and not raw.closed and not raw.broken:
            if flush and self._conn.commit_pending:
                self._conn.commit_pending = False
                raw.execute("COMMIT")
            return raw
        self._conn.commit_pending = False  # lost with the connection: as if it had not been
        with suppress(Exception):
            if raw is not None:
                raw.close()
        raw = _connect(self.url, self.label, user=_USER, application_name=f"delivery-consumer {self.spec.name}",
                       readonly=self.readonly, setup=(f'SET search_path TO "{self.schema}"',), prepare_threshold=1)
        self._raw = raw
        self._conn._raw = raw
        return raw

    def rollback(self) -> None:
        """Roll back the open transaction, if any; quietly (the connection may be gone). The one
        open may be an unsynced transaction whose COMMIT is still to send: it is committed."""
        pending = self._conn.commit_pending
        self._conn.in_transaction = False
        self._conn.begin = None
        self._conn.commit_pending = False
        self._conn.last = []
        raw = self._raw
        if raw is None or raw.closed:
            return
        with suppress(Exception):
            raw.execute("COMMIT" if pending else "ROLLBACK")

    # -- opening ---------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url: str,
        spec: ConsumerSpec | None = None,
        *,
        lookup: SpecLookup | None = None,
        consumer: str | None = None,
        create: bool = False,
        readonly: bool = False,
        partition: Identity | None = None,
        unpartitioned: bool = False,
        schema: str | None = None,
    ) -> PgInboxDB:
        """Open (with *create*: make or migrate) *spec*'s inbox in the database *url*.

        The schema is ``schema=`` of the URL, else *schema*, else
        :func:`schema_for` the consumer (and partition). Refuses a schema that
        is another consumer's or another partition's, or newer than this release."""
        url, named = split_url(url)
        name = spec.name if spec is not None else consumer
        if name is None:
            raise DatabaseError(f"{redact(url)}: give the consumer whose inbox this is")
        schema = named or schema or schema_for(name, partition)
        if not _IDENT.fullmatch(schema):
            raise ConfigError(f"{redact(url)}: schema {schema!r} is not a plain SQL identifier")
        if spec is None:
            if lookup is None:
                raise DatabaseError(f"{redact(url)}: give the spec of consumer {name!r}")
            spec = lookup(name)
        db = cls(url, schema, spec, readonly)
        try:
            db.connected()
            if readonly:
                db._check_readable()
            else:
                db._prepare_writable(create, partition)
            meta = db.meta()
            stored = meta.get("consumer")
            if stored != spec.name:
                raise WrongDatabase(f"{db.label}: this inbox belongs to consumer {stored!r}, not {spec.name!r}")
            recorded = identity_from_meta(meta)
            if (partition is not None or unpartitioned) and recorded != partition:
                what = recorded.describe() if recorded else f"the unpartitioned {spec.name!r}"
                asked = partition.describe() if partition else "the unpartitioned consumer"
                raise DatabaseError(f"{db.label}: this inbox is {what}, not {asked}")
            db.partition = recorded
        except BaseException:
            db.close()
            raise
        return db

    def _exists(self) -> bool:
        row = self.raw().execute("SELECT to_regclass(%s)", (f'"{self.schema}".meta',)).fetchone()
        return row[0] is not None

    def _check_readable(self) -> None:
        if not self._exists():
            raise DatabaseError(f"{self.label}: no inbox here (run creates one, or init)")
        version = int(self.meta().get(_STORE_VERSION_KEY, "0"))
        if version != STORE_VERSION:
            raise DatabaseError(f"{self.label}: inbox schema version {version}, this release knows {STORE_VERSION}")

    def _prepare_writable(self, create: bool, partition: Identity | None) -> None:
        """Create or migrate the schema, under an advisory lock (several runs starting at once)."""
        psycopg = psycopg_module()
        raw, spec = self.raw(), self.spec
        try:
            with raw.transaction():
                raw.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                            (f"delivery_consumer.inbox:{self.schema}",))
                exists = self._exists()
                if not exists and not create:
                    raise DatabaseError(f"{self.label}: no inbox here (create it with init, or run)")
                if not exists:
                    raw.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                    version = 0
                else:
                    row = raw.execute("SELECT value FROM meta WHERE key = %s", (_STORE_VERSION_KEY,)).fetchone()
                    version = int(row[0]) if row else 0
                    stored = raw.execute("SELECT value FROM meta WHERE key = 'consumer'").fetchone()
                    if stored is not None and stored[0] != spec.name:
                        raise WrongDatabase(
                            f"{self.label}: this inbox belongs to consumer {stored[0]!r}, not {spec.name!r}")
                if version > STORE_VERSION:
                    raise DatabaseError(f"{self.label}: inbox schema version {version} was written by a later "
                                        f"release; this delivery-consumer {__version__} knows {STORE_VERSION}")
                for script in MIGRATIONS[version:]:
                    for statement in script:
                        raw.execute(statement)
                put = ("INSERT INTO meta (key, value) VALUES (%s, %s)"
                       " ON CONFLICT (key) DO UPDATE SET value = excluded.value")
                keep = "INSERT INTO meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING"
                if version == 0:
                    self.created = True
                    rows = [("consumer", spec.name), ("created_at", now_iso()),
                            ("created_by", f"delivery-consumer {__version__}"), (CONSUMER_VERSION_KEY, "0")]
                    if partition is not None:
                        rows += [("partition", str(partition.partition)), ("partition_count", str(partition.count))]
                    raw.cursor().executemany(keep, rows)
                raw.execute(put, (_STORE_VERSION_KEY, str(STORE_VERSION)))
                raw.execute(keep, (SEAL_KEY, os.urandom(32).hex()))
                raw.execute(keep, (DATABASE_ID, os.urandom(16).hex()))
                row = raw.execute("SELECT value FROM meta WHERE key = %s", (CONSUMER_VERSION_KEY,)).fetchone()
                applied = int(row[0]) if row else 0
                scripts = consumer_migrations(spec)
                for ddl in scripts[applied:]:
                    raw.execute(ddl)  # several statements: no parameters
                if len(scripts) > applied or version != STORE_VERSION:
                    raw.execute(put, (CONSUMER_VERSION_KEY, str(max(applied, len(scripts)))))
                    raw.execute(put, (SCHEMA_BY_KEY, f"delivery-consumer {__version__}"))
                for check in spec.checks:
                    try:
                        check(self._conn)
                    except ConfigError as exc:
                        raise ConfigError(f"{self.label}: {exc}") from None
        except psycopg.Error as exc:
            raise translate(exc, self.label) from None

    # -- use -------------------------------------------------------------------------

    def transaction(self) -> Transaction:
        """One write transaction (BEGIN ... COMMIT; READ COMMITTED, eventIds locked)."""
        if self.readonly:
            raise DatabaseError(f"{self.label}: opened read-only")
        return PgTransaction(self)

    def unsynced_transaction(self) -> Transaction:
        """A write transaction committed with ``synchronous_commit = off``: nothing is acknowledged on it."""
        if self.readonly:
            raise DatabaseError(f"{self.label}: opened read-only")
        return PgTransaction(self, unsynced=True)

    def check_file(self) -> None:
        """Nothing to check: no file can be replaced under a PostgreSQL database."""

    def watch_content(self, tags: object = None) -> None:
        """Nothing to watch (SQLite's content tags have no PostgreSQL counterpart)."""

    def check_integrity(self, limit_s: float) -> bool:
        """PostgreSQL checks its own pages (checksums, WAL): nothing to do here."""
        return True

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        psycopg = psycopg_module()
        try:
            return list(self.raw().execute(sql, params).fetchall())
        except psycopg.Error as exc:
            raise translate(exc, self.label) from None

    def meta(self) -> dict[str, str]:
        """The inbox's identity and versions."""
        return {str(k): str(v) for k, v in self._read("SELECT key, value FROM meta")}

    def database_id(self) -> str:
        rows = self._read("SELECT value FROM meta WHERE key = %s", (DATABASE_ID,))
        return str(rows[0][0]) if rows else ""

    def high_water(self) -> int:
        """The ``seq`` of the newest receipt (0: none yet)."""
        return int(self._read("SELECT coalesce(max(seq), 0) FROM inbox")[0][0])

    def forget_in_flight(self, owner: str) -> None:
        """Delete *owner*'s in-flight note on a connection of its own (another thread's call; best effort)."""
        psycopg = psycopg_module()
        with suppress(psycopg.Error), psycopg.connect(self.url, autocommit=True, connect_timeout=2) as conn:
            conn.execute(f'DELETE FROM "{self.schema}".in_flight WHERE owner = %s', (owner,))

    def close(self) -> None:
        raw, self._raw = self._raw, None
        if raw is not None:
            with suppress(Exception):
                raw.close()

    def __enter__(self) -> PgInboxDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DIALECT", "MIGRATIONS", "STORE_VERSION", "PgConnection", "PgInboxDB", "PgTransaction",
           "consumer_migrations", "is_url", "portable_ddl", "redact", "rewrite", "schema_for", "split_url", "translate"]
