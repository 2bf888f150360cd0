"""The consumer's SQLite database and the transaction boundary of an event.

One database per consumer. For every event, one write transaction
(``BEGIN IMMEDIATE``) reads the inbox receipt, runs the consumer's effect,
writes the receipt and commits; only then may a delivery be acknowledged.

* same eventId, same fingerprint -> ``duplicate:<stored result>``, nothing
  else changes;
* same eventId, another fingerprint -> rejection ``event-id-reused``;
* otherwise the consumer's ``apply`` decides the result.

A batch is one transaction and one fsync (:meth:`Transaction.apply_many`):
applied first without savepoints, with the SQL per batch; if any event
fails, rolled back and applied again with a SAVEPOINT per event, so a
rejected event never undoes its neighbours. Rejections are written to
``rejected`` in the same transaction.

Connections: made in the thread that uses them, never shared (Python's
``check_same_thread``), in autocommit mode (``isolation_level=None``) with
explicit BEGIN IMMEDIATE / COMMIT: on Python 3.11 the default mode issues a
*deferred* BEGIN only before the first write, so the inbox SELECT would run
outside the transaction, and a deferred read->write upgrade in WAL fails at
once with SQLITE_BUSY without waiting (https://sqlite.org/lang_transaction.html).
Durability: WAL with ``synchronous=FULL``: the WAL is synced at every commit,
so an acknowledged event survives power loss; NORMAL would not
(https://sqlite.org/pragma.html#pragma_synchronous).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import orjson

from . import __version__, consumers
from .consumers import ConsumerSpec
from .envelope import Envelope
from .errors import (
    EVENT_ID_REUSED,
    WRONG_PARTITION,
    DatabaseError,
    DeliveryError,
    Rejection,
    StoreUnavailable,
    TransientError,
    safe_reason,
)
from .partitions import Identity, identity_from_meta, misplaced

#: How long a writer waits for another writer before giving up (ms). Kept well
#: below the AMQP heartbeat (60 s) so that waiting never costs the connection.
DEFAULT_BUSY_TIMEOUT_MS = 5000

#: Pages of WAL after which a commit runs a checkpoint (SQLite's default: 1000).
WAL_AUTOCHECKPOINT_PAGES = 10_000
#: Page cache of a writable connection, KiB (SQLite's default: 2000).
CACHE_KIB = 64 * 1024

#: Forward-only migrations of the store's own tables. ``PRAGMA user_version``
#: is the number of entries applied. Never edit an entry: append one.
#: ``inbox`` is a rowid table on purpose: rows are appended in rowid order and
#: only the small (eventId -> rowid) index takes random inserts. As a WITHOUT
#: ROWID table every receipt landed on a random 4 KiB leaf: 100k receipts in
#: batches of 500 cost 9.5 us per insert and 27.6 us per commit, against 5.9
#: and 8.1 us as a rowid table.
CORE_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) STRICT;
    CREATE TABLE inbox (
        event_id    TEXT PRIMARY KEY,
        fingerprint TEXT NOT NULL,
        result      TEXT NOT NULL,
        event_type  TEXT NOT NULL,
        received_at TEXT NOT NULL
    ) STRICT;
    CREATE INDEX inbox_received_at ON inbox (received_at);
    CREATE TABLE rejected (
        id          INTEGER PRIMARY KEY,
        code        TEXT NOT NULL,
        reason      TEXT NOT NULL,
        event_id    TEXT,
        fingerprint TEXT,
        body_sha256 TEXT,
        source      TEXT,
        attempts    INTEGER NOT NULL DEFAULT 0,
        dead_letter TEXT,
        rejected_at TEXT NOT NULL,
        resolved_at TEXT
    ) STRICT;
    CREATE INDEX rejected_event_id ON rejected (event_id);
    CREATE INDEX rejected_at ON rejected (rejected_at);
    CREATE TABLE deliveries (
        key          TEXT PRIMARY KEY,
        event_id     TEXT,
        deliveries   INTEGER NOT NULL,
        redeliveries INTEGER NOT NULL,
        attempts     INTEGER NOT NULL,
        crashes      INTEGER NOT NULL DEFAULT 0,
        first_at     TEXT NOT NULL,
        last_at      TEXT NOT NULL,
        last_outcome TEXT
    ) STRICT, WITHOUT ROWID;
    CREATE INDEX deliveries_last_at ON deliveries (last_at);
    """,
    # The key that places an event in a partition (its articleId), kept with
    # its receipt so that changing the partition count can move receipts
    # with their article (partitions.py). NULL in receipts written before.
    """
    ALTER TABLE inbox ADD COLUMN partition_key TEXT;
    """,
    # What each process is handling now (InFlight): one row per live process.
    """
    CREATE TABLE in_flight (
        owner      TEXT PRIMARY KEY,
        keys       TEXT NOT NULL,
        started_at TEXT NOT NULL
    ) STRICT;
    """,
    # Receipts are appended in time order along the rowid, so prune finds a
    # time by binary search on the rowid (retention.py); the index was one
    # more page written and synced by every commit.
    """
    DROP INDEX inbox_received_at;
    """,
)
STORE_VERSION = len(CORE_MIGRATIONS)
_CONSUMER_VERSION_KEY = "consumer_schema_version"

# SQLite primary result codes (https://sqlite.org/rescode.html) that are failures
# of the environment, not of any event: busy/locked past the timeout, read-only,
# I/O error, disk full, cannot open. Anything else (corrupt, not a database,
# a schema error) makes the database unusable: DatabaseError.
_ENVIRONMENT_CODES = {5: "database-busy", 6: "database-busy", 8: "database-read-only", 10: "io-error",
                      13: "disk-full", 14: "cannot-open"}


def now_iso(when: float | None = None) -> str:
    """UTC time as ``YYYY-MM-DDTHH:MM:SS.mmmZ`` (sorts as text)."""
    global _last_second
    when = time.time() if when is None else when
    second = int(when)
    # Every transaction stamps its receipts: format the date and time once
    # per second, not once per transaction (bench/bench_replay.py).
    cached = _last_second
    if second != cached[0] or when < 0:
        cached = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)))
        if when >= 0:
            _last_second = cached
    return cached[1] + f".{int(when % 1 * 1000):03d}Z"


_last_second: tuple[int, str] = (-1, "")


def inbox_rowid_before(conn: sqlite3.Connection, cutoff: str) -> int:
    """A rowid bound: the receipts at or below it are those received before *cutoff*.

    Receipts are appended in time order, so ``received_at < cutoff`` holds
    for a prefix of the rowids: a binary search over the rowid finds its end
    in ~log2(n) lookups, with no index on ``received_at``. Callers keep
    testing ``received_at`` too: if the clock ever went back, the prefix
    found may be off by the receipts written meanwhile (prune then keeps some
    old receipts longer and never deletes a younger one; a count of recent
    receipts may miss some written while the clock was behind).
    """
    ((low, high),) = conn.execute("SELECT min(rowid), max(rowid) FROM inbox").fetchall()
    if low is None:
        return 0
    high += 1  # the first rowid whose next receipt is not older than cutoff
    while low < high:
        middle = (low + high) // 2
        row = conn.execute(
            "SELECT rowid, received_at FROM inbox WHERE rowid >= ? ORDER BY rowid LIMIT 1", (middle,)
        ).fetchone()
        if row is None or row[1] >= cutoff:
            high = middle
        else:
            low = row[0] + 1
    return int(low) - 1


def default_db_path(consumer: str) -> Path:
    """Where a consumer's database lives unless told otherwise."""
    return Path("state") / consumer / "inbox.db"


def translate(exc: sqlite3.Error, path: Path | str) -> DatabaseError | StoreUnavailable:
    """Map an sqlite3 error to the project's own: the environment's (StoreUnavailable, a
    TransientError: try again later) or fatal."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in _ENVIRONMENT_CODES:
        return StoreUnavailable(f"{path}: {exc}", code=_ENVIRONMENT_CODES[code & 0xFF])
    return DatabaseError(f"{path}: {exc}")


@dataclass(slots=True)
class Outcome:
    """What happened to one event in a transaction."""

    event_id: str | None
    result: str | None = None
    rejection: Rejection | None = None
    transient: TransientError | None = None

    @property
    def status(self) -> str:
        """The result, the rejection code, or ``transient:<code>``."""
        if self.result is not None:
            return self.result
        if self.rejection is not None:
            return self.rejection.code
        assert self.transient is not None
        return f"transient:{self.transient.code}"


def _statements(script: str) -> Iterator[str]:
    """Split an SQL script into statements (executescript would COMMIT)."""
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer.strip()
            buffer = ""
    if buffer.strip():
        raise ValueError(f"incomplete SQL statement in migration: {buffer.strip()[:60]!r}")


class ConsumerDB:
    """An open consumer database: its connection, path and consumer spec.

    Use :meth:`open`; one instance per thread. Read-only instances (for the
    inspect commands) open the file with ``mode=ro`` and autocommit, so they
    never hold a write lock nor a long read snapshot.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path, spec: ConsumerSpec, readonly: bool):
        self.conn = conn
        self.path = path
        self.spec = spec
        self.readonly = readonly
        #: The partition this database serves (None: an unpartitioned consumer).
        self.partition: Identity | None = None

    # -- opening ---------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: Path | str | None = None,
        consumer: str | None = None,
        *,
        create: bool = False,
        readonly: bool = False,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        partition: Identity | None = None,
        unpartitioned: bool = False,
    ) -> ConsumerDB:
        """Open (and with ``create`` make) the database of *consumer*.

        Either argument may be omitted: the path defaults to
        ``state/<consumer>/inbox.db``; the consumer defaults to the one the
        database records. Raises :class:`DatabaseError` for a missing,
        foreign, corrupt, newer or other consumer's database -- and, with
        *partition*, for a database of another partition or count (a new one
        records *partition*); with *unpartitioned*, for any partition's.
        """
        if path is None:
            if consumer is None:
                raise DatabaseError("give a consumer name or a database path")
            path = default_db_path(consumer)
        path = Path(path)
        if path.is_dir():
            raise DatabaseError(f"{path}: is a directory, not a database file")
        exists = path.exists()
        if not exists and (readonly or not create):
            hint = f" (create it with: delivery-consumer init --consumer {consumer or 'NAME'} --db {path})"
            raise DatabaseError(f"{path}: no such database{hint}")
        if not exists:
            if consumer is None:
                raise DatabaseError(f"{path}: no such database; give --consumer to create it")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except FileExistsError:  # mkdir's own message would be "File exists"
                raise DatabaseError(f"{path}: cannot create its directory: {path.parent} is not a directory") from None
            except OSError as exc:
                raise DatabaseError(f"{path}: cannot create its directory: {exc.strerror or exc}") from None
        spec = consumers.get(consumer) if consumer is not None else None
        conn = cls._connect(path, readonly, busy_timeout_ms)
        try:
            if readonly:
                stored = cls._check_readable(conn, path)
            else:
                stored = cls._prepare_writable(conn, path, consumer, spec, partition)
            if consumer is not None and stored != consumer:
                raise DatabaseError(
                    f"{path}: this database belongs to consumer {stored!r}, not {consumer!r}"
                )
            if partition is not None or unpartitioned:
                cls._check_partition(conn, path, stored, partition)
            spec = spec or consumers.get(stored)
            if readonly:
                cls._check_consumer_version(conn, path, spec)
        except sqlite3.Error as exc:
            conn.close()
            raise DatabaseError(f"{path}: cannot use this database: {exc}") from None
        except BaseException:
            conn.close()
            raise
        db = cls(conn, path, spec, readonly)
        try:
            db.partition = identity_from_meta(db.meta())
        except sqlite3.Error as exc:
            conn.close()
            raise DatabaseError(f"{path}: cannot use this database: {exc}") from None
        return db

    @staticmethod
    def _connect(path: Path, readonly: bool, busy_timeout_ms: int) -> sqlite3.Connection:
        try:
            if readonly:
                uri = f"file:{quote(str(path.resolve()))}?mode=ro"
                conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=busy_timeout_ms / 1000)
            else:
                conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_ms / 1000)
                # Refuse a foreign, newer or corrupt file before the switch to
                # WAL below, which is persistent: refusing must not modify it.
                try:
                    ConsumerDB._stored_consumer(conn, path)
                except BaseException:
                    conn.close()
                    raise
                # Persistent; a no-op when the file is already in WAL mode.
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode != "wal":
                    raise DatabaseError(f"{path}: cannot switch to WAL mode (got {mode!r})")
                conn.execute("PRAGMA synchronous = FULL")
                # A writer's commit pays for the automatic checkpoint: checkpoint
                # every ~40 MB of WAL instead of every 4 MB (fewer, larger copies
                # of pages that change again and again), and keep the hot b-tree
                # pages of the inbox and the effect tables in memory: the receipt
                # lookups are random by eventId. Both are per-connection, not
                # persistent. (No mmap: an I/O error on a mapped page is a SIGBUS,
                # not an exception, https://sqlite.org/mmap.html.)
                conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
                conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            return conn
        except sqlite3.Error as exc:
            raise DatabaseError(f"{path}: cannot open database: {exc}") from None

    @staticmethod
    def _stored_consumer(conn: sqlite3.Connection, path: Path) -> str | None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > STORE_VERSION:
            raise DatabaseError(
                f"{path}: database schema version {version} is newer than this "
                f"delivery-consumer ({__version__}) understands ({STORE_VERSION}); upgrade it"
            )
        if version == 0:
            tables = conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()[0]
            if tables:
                raise DatabaseError(f"{path}: not a delivery-consumer database")
            return None
        row = conn.execute("SELECT value FROM meta WHERE key = 'consumer'").fetchone()
        if row is None:
            raise DatabaseError(f"{path}: not a delivery-consumer database (no consumer recorded)")
        return str(row[0])

    @classmethod
    def _check_readable(cls, conn: sqlite3.Connection, path: Path) -> str:
        stored = cls._stored_consumer(conn, path)
        if stored is None:
            raise DatabaseError(f"{path}: empty database; run delivery-consumer init first")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version < STORE_VERSION:
            raise DatabaseError(f"{path}: schema version {version} is old; run init to upgrade it")
        return stored

    @staticmethod
    def _check_consumer_version(conn: sqlite3.Connection, path: Path, spec: ConsumerSpec) -> None:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (_CONSUMER_VERSION_KEY,)).fetchone()
        version = int(row[0]) if row else 0
        if version != len(spec.migrations):
            state = "newer" if version > len(spec.migrations) else "older"
            raise DatabaseError(
                f"{path}: the {spec.name} tables are at version {version}, {state} than this "
                f"delivery-consumer's {len(spec.migrations)}"
                + ("; run init to upgrade them" if state == "older" else "")
            )

    @staticmethod
    def _check_partition(conn: sqlite3.Connection, path: Path, consumer: str, wanted: Identity | None) -> None:
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('partition', 'partition_count')"))
        stored = identity_from_meta(meta)
        if stored == wanted:
            return
        what = f"{stored.describe()} of consumer {consumer!r}" if stored else f"the unpartitioned {consumer!r}"
        asked = wanted.describe() if wanted else "the unpartitioned consumer"
        raise DatabaseError(f"{path}: this database is {what}, not {asked}")

    @classmethod
    def _prepare_writable(
        cls, conn: sqlite3.Connection, path: Path, consumer: str | None, spec: ConsumerSpec | None,
        partition: Identity | None = None,
    ) -> str:
        """Check identity and run pending migrations, all under one write lock."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            stored = cls._stored_consumer(conn, path)
            if stored is None:
                if consumer is None or spec is None:
                    raise DatabaseError(f"{path}: empty database; give --consumer to initialise it")
                stored = consumer
            elif consumer is not None and stored != consumer:
                raise DatabaseError(
                    f"{path}: this database belongs to consumer {stored!r}, not {consumer!r}"
                )
            spec = spec or consumers.get(stored)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for script in CORE_MIGRATIONS[version:]:
                for statement in _statements(script):
                    conn.execute(statement)
            if version == 0:
                conn.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [
                        ("consumer", stored),
                        ("created_at", now_iso()),
                        ("created_by", f"delivery-consumer {__version__}"),
                        (_CONSUMER_VERSION_KEY, "0"),
                        *([("partition", str(partition.partition)), ("partition_count", str(partition.count))]
                          if partition is not None else []),
                    ],
                )
            conn.execute(f"PRAGMA user_version = {STORE_VERSION}")
            row = conn.execute(
                "SELECT value FROM meta WHERE key = ?", (_CONSUMER_VERSION_KEY,)
            ).fetchone()
            applied = int(row[0]) if row else 0
            if applied > len(spec.migrations):
                raise DatabaseError(
                    f"{path}: the {spec.name} tables are at version {applied}, newer than "
                    f"this delivery-consumer's {len(spec.migrations)}; upgrade it"
                )
            for script in spec.migrations[applied:]:
                for statement in _statements(script):
                    conn.execute(statement)
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                (_CONSUMER_VERSION_KEY, str(len(spec.migrations))),
            )
            conn.execute("COMMIT")
            return stored
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # -- use -------------------------------------------------------------------

    @property
    def consumer(self) -> str:
        return self.spec.name

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ConsumerDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transaction(self) -> Transaction:
        """One write transaction: ``with db.transaction() as tx:`` runs
        BEGIN IMMEDIATE ... COMMIT, or ROLLBACK when the block raises.

        sqlite3 errors leave as :class:`TransientError` (busy past the
        timeout, disk full, I/O error: the caller may retry the whole batch)
        or :class:`DatabaseError` (the database is unusable).
        """
        if self.readonly:
            raise DatabaseError(f"{self.path}: opened read-only")
        return Transaction(self)

    def _rollback(self) -> None:
        if self.conn.in_transaction:
            # SQLite may already have rolled back by itself (e.g. SQLITE_FULL).
            with suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")

    def meta(self) -> dict[str, str]:
        """The database's identity and versions."""
        return dict(self.conn.execute("SELECT key, value FROM meta").fetchall())


_RECEIPT_SELECT = "SELECT fingerprint, result FROM inbox WHERE event_id = ?"
_RECEIPTS_SELECT = (
    "SELECT event_id, fingerprint, result FROM inbox WHERE event_id IN (SELECT value FROM json_each(?))"
)
_RECEIPT_INSERT = (
    "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at, partition_key)"
    " VALUES (?, ?, ?, ?, ?, ?)"
)


class _Fallback(Exception):
    """The optimistic batch met a failing event: apply it event by event.

    *env* and *outcome*: the event whose effect failed and how, when known.
    """

    def __init__(self, env: Envelope | None = None, outcome: Outcome | None = None) -> None:
        super().__init__()
        self.env = env
        self.outcome = outcome


def _duplicate(receipt: tuple[str, str], env: Envelope) -> str:
    """The answer to an event whose eventId has a receipt (fingerprint, result):
    ``duplicate:<result>``, or rejection ``event-id-reused`` for another body."""
    if receipt[0] == env.fingerprint:
        return "duplicate:" + str(receipt[1])
    raise Rejection(
        EVENT_ID_REUSED,
        f"eventId was first received with fingerprint {receipt[0][:12]}…, this body differs",
        event_id=env.event_id,
        fingerprint=env.fingerprint,
    )


class Transaction:
    """The write transaction of a :meth:`ConsumerDB.transaction` block.

    A plain class rather than a ``@contextmanager`` generator: at
    ``--batch 1`` it is entered once per event, and the generator machinery
    showed in the profile (bench/bench_replay.py).
    """

    __slots__ = ("_known", "conn", "db", "now", "spec")

    def __init__(self, db: ConsumerDB, now: str = ""):
        self.db = db
        self.conn = db.conn
        self.spec = db.spec
        self.now = now
        #: Receipts read ahead by :meth:`prefetch` (eventId -> (fingerprint, result)).
        self._known: dict[str, tuple[str, str]] | None = None

    def __enter__(self) -> Transaction:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.now = now_iso()
        except sqlite3.Error as exc:
            self.db._rollback()
            raise translate(exc, self.db.path) from None
        except BaseException:
            self.db._rollback()
            raise
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self.conn.execute("COMMIT")
                return
            except sqlite3.Error as error:
                exc = error
            except BaseException:
                self.db._rollback()
                raise
        self.db._rollback()
        if isinstance(exc, sqlite3.Error):
            raise translate(exc, self.db.path) from None
        # Any other exception goes on as it is.

    def apply(self, env: Envelope) -> Outcome:
        """Apply one event under its own savepoint; never raises for the event.

        A rejection or a transient failure rolls the event's changes back to
        its savepoint and is returned in the :class:`Outcome`; the rest of the
        transaction goes on. sqlite3 errors propagate: they concern the whole
        transaction (except a constraint failing on the event's own writes).
        """
        conn = self.conn
        conn.execute("SAVEPOINT event")
        try:
            result = self._apply(env)
        except Exception as exc:
            outcome = self._failure(env, exc)
            self._undo()
            return outcome
        conn.execute("RELEASE event")
        return Outcome(env.event_id, result=result)

    def _failure(self, env: Envelope, exc: Exception) -> Outcome:
        """The outcome of an event whose effect raised *exc*; raises *exc*
        again when it concerns the whole transaction."""
        if isinstance(exc, Rejection):
            return Outcome(env.event_id, rejection=exc)
        if isinstance(exc, TransientError):
            return Outcome(env.event_id, transient=exc)
        # A bug in an effect: retried, then dead-lettered. A constraint
        # failing on the event's own writes (IntegrityError) aborted only that
        # statement: it is this event's bug. Other sqlite3 errors (busy, disk
        # full, I/O) concern the transaction.
        if isinstance(exc, sqlite3.Error) and not isinstance(exc, sqlite3.IntegrityError):
            raise exc
        reason = f"{type(exc).__name__} in {self.spec.name} effect: {exc}"
        return Outcome(env.event_id, transient=TransientError(reason, code="handler-error"))

    def _undo(self) -> None:
        self.conn.execute("ROLLBACK TO event")
        self.conn.execute("RELEASE event")

    def apply_many(self, items: Sequence[Envelope | Rejection]) -> list[Outcome]:
        """Apply a batch; the first thing done in the transaction.

        Optimistic: receipts read in one statement, the fresh events applied
        together (the consumer's ``apply_many``, else ``apply`` in turn) with
        no savepoint, their receipts written by one ``executemany``. When any
        event fails (a rejection, a transient or an effect's error), the
        transaction is rolled back and begun again, and the batch is applied
        event by event under savepoints (:meth:`apply`): the outcomes and the
        database are those of the per-event path, which
        ``tests/test_batch_apply.py`` checks. Parse rejections in *items*
        become rejection outcomes; recording them is the caller's.
        """
        try:
            return self._optimistic(items)
        except _Fallback as fallback:
            failed, failure = fallback.env, fallback.outcome
        self._restart()
        envs = [item for item in items if not isinstance(item, Rejection)]
        if len(envs) > 1:
            self.prefetch(envs)
        outcomes: list[Outcome] = []
        for item in items:
            if isinstance(item, Rejection):
                outcomes.append(Outcome(item.event_id, rejection=item))
            elif item is failed and failure is not None:
                # The effect already answered for this event, after the same
                # events before it: not called twice for one delivery.
                outcomes.append(failure)
                failed = None
            else:
                outcomes.append(self.apply(item))
        return outcomes

    def _optimistic(self, items: Sequence[Envelope | Rejection]) -> list[Outcome]:
        conn = self.conn
        envs = [item for item in items if not isinstance(item, Rejection)]
        if len(envs) == 1:
            row = conn.execute(_RECEIPT_SELECT, (envs[0].event_id,)).fetchone()
            known = {} if row is None else {envs[0].event_id: row}
        else:
            ids = orjson.dumps([env.event_id for env in envs]).decode()
            known = {row[0]: row[1:] for row in conn.execute(_RECEIPTS_SELECT, (ids,))}
        # Each item is answered now (a receipt, a parse rejection) or by the
        # effect: index of its fresh event, the first with its eventId.
        outcomes: list[Outcome | int] = []
        fresh: list[Envelope] = []
        first: dict[str, int] = {}
        for item in items:
            if isinstance(item, Rejection):
                outcomes.append(Outcome(item.event_id, rejection=item))
                continue
            row = known.get(item.event_id)
            if row is not None:
                try:
                    outcomes.append(Outcome(item.event_id, result=_duplicate(row, item)))
                except Rejection as rej:
                    outcomes.append(Outcome(item.event_id, rejection=rej))
                continue
            index = first.get(item.event_id)
            if index is None:
                first[item.event_id] = len(fresh)
                outcomes.append(len(fresh))
                fresh.append(item)
            elif fresh[index].fingerprint == item.fingerprint:
                outcomes.append(~index)  # a duplicate of a fresh event of this batch
            else:
                raise _Fallback  # event-id-reused within the batch: rare, let the per-event path say it
        if not fresh:
            return outcomes  # type: ignore[return-value]
        part = self.db.partition
        if part is not None and any(misplaced(env.article_id, part) for env in fresh):
            raise _Fallback  # the per-event path rejects the misplaced event alone
        spec, now = self.spec, self.now
        try:
            if spec.apply_many is not None:
                results = spec.apply_many(conn, fresh)
            else:
                results = []
                for env in fresh:
                    try:
                        results.append(spec.apply(conn, env))
                    except Exception as exc:
                        raise _Fallback(env, self._failure(env, exc)) from None
            # Inside the try: an effect's bad result (None) fails here, as
            # the per-event path's receipt INSERT does.
            conn.executemany(_RECEIPT_INSERT, [
                (env.event_id, env.fingerprint, result, env.type, now, env.article_id)
                for env, result in zip(fresh, results, strict=True)
            ])
        except _Fallback:
            raise
        except Exception as exc:
            if isinstance(exc, sqlite3.Error) and not isinstance(exc, sqlite3.IntegrityError):
                raise
            raise _Fallback from None
        return [
            o if isinstance(o, Outcome)
            else Outcome(fresh[o].event_id, result=results[o]) if o >= 0
            else Outcome(fresh[~o].event_id, result="duplicate:" + results[~o])
            for o in outcomes
        ]

    def _restart(self) -> None:
        """Roll the transaction back and begin it again (same receipt time)."""
        try:
            self.conn.execute("ROLLBACK")
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise translate(exc, self.db.path) from None
        self._known = None

    def prefetch(self, envs: Sequence[Envelope]) -> None:
        """Read the receipts of a whole batch in one statement.

        :meth:`apply` then looks receipts up in memory instead of one SELECT
        per event. Exact because the transaction holds the write lock (BEGIN
        IMMEDIATE): no other writer can add a receipt meanwhile, and receipts
        written in this transaction are added as they are written.
        """
        ids = orjson.dumps([env.event_id for env in envs]).decode()
        self._known = {
            event_id: (fingerprint, result)
            for event_id, fingerprint, result in self.conn.execute(_RECEIPTS_SELECT, (ids,))
        }

    def _apply(self, env: Envelope) -> str:
        conn = self.conn
        known = self._known
        if known is None:
            row = conn.execute(_RECEIPT_SELECT, (env.event_id,)).fetchone()
        else:
            row = known.get(env.event_id)
        if row is not None:
            return _duplicate(row, env)
        part = self.db.partition
        if part is not None and (why := misplaced(env.article_id, part)):
            raise Rejection(WRONG_PARTITION, why, event_id=env.event_id, fingerprint=env.fingerprint)
        result = self.spec.apply(conn, env)
        conn.execute(_RECEIPT_INSERT, (env.event_id, env.fingerprint, result, env.type, self.now, env.article_id))
        if known is not None:
            known[env.event_id] = (env.fingerprint, result)
        return result

    def record_rejection(
        self,
        rejection: Rejection,
        *,
        source: str | None = None,
        body_sha256: str | None = None,
        attempts: int = 0,
        dead_letter: str | None = None,
    ) -> int:
        """Write one row to ``rejected``; returns its id."""
        cur = self.conn.execute(
            "INSERT INTO rejected (code, reason, event_id, fingerprint, body_sha256, source,"
            " attempts, dead_letter, rejected_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                rejection.code,
                rejection.reason,
                rejection.event_id,
                rejection.fingerprint,
                body_sha256,
                safe_reason(source) if source else None,
                attempts,
                dead_letter,
                self.now,
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def record_delivery(
        self,
        key: str,
        event_id: str | None,
        *,
        redelivered: bool,
        attempt: int,
        outcome: str,
        count: bool = True,
        delivered_hint: int = 0,
    ) -> DeliveryCount:
        """Count one broker delivery of *key* durably and store its outcome.

        *attempt* is the try number the delivery carries (1 for the first
        publication, 2 after one retry tier, ...); stored counts never
        decrease, so a crash or a lost header cannot reset them.
        *delivered_hint* is what the broker says (``x-delivery-count + 1``).
        ``count=False`` only updates the outcome of a delivery counted
        earlier. Crashes are not counted here: see :class:`InFlight`.
        """
        row = self.conn.execute(
            "INSERT INTO deliveries (key, event_id, deliveries, redeliveries, attempts, crashes,"
            " first_at, last_at, last_outcome) VALUES (?1, ?2, max(1, ?3), ?4, ?5, 0, ?6, ?6, ?7)"
            " ON CONFLICT (key) DO UPDATE SET"
            " deliveries = max(deliveries + ?8, ?3),"
            " redeliveries = redeliveries + ?4 * ?8,"
            " attempts = max(attempts, excluded.attempts),"
            " event_id = coalesce(excluded.event_id, event_id),"
            " last_at = excluded.last_at, last_outcome = excluded.last_outcome"
            " RETURNING deliveries, attempts, crashes",
            (key, event_id, delivered_hint, int(redelivered), attempt, self.now, outcome, int(count)),
        ).fetchone()
        return DeliveryCount(int(row[0]), int(row[1]), int(row[2]))

    def record_interruption(self, key: str, *, crashed: bool) -> None:
        """The process handling a delivery of *key* died: count that delivery
        and leave the key open (:data:`OPEN_OUTCOMES`), a crash if it was
        handled alone (*crashed*), else one suspect of a batch."""
        self.conn.execute(
            "INSERT INTO deliveries (key, event_id, deliveries, redeliveries, attempts, crashes, first_at, last_at,"
            " last_outcome) VALUES (?1, NULL, 1, 0, 1, ?2, ?3, ?3, ?4)"
            " ON CONFLICT (key) DO UPDATE SET deliveries = deliveries + 1, crashes = crashes + ?2,"
            " last_at = ?3, last_outcome = ?4",
            (key, int(crashed), self.now, CRASHED if crashed else INTERRUPTED),
        )


@dataclass(frozen=True, slots=True)
class DeliveryCount:
    """Durable counters of one message key after a delivery was recorded."""

    deliveries: int
    attempts: int
    crashes: int


def apply_event(db: ConsumerDB, env: Envelope, *, source: str | None = None) -> str:
    """Apply one envelope in its own transaction and return its result.

    Raises :class:`Rejection` (already recorded in ``rejected`` and
    committed) or :class:`TransientError` (nothing committed).
    """
    with db.transaction() as tx:
        outcome = tx.apply(env)
        if outcome.rejection is not None:
            tx.record_rejection(outcome.rejection, source=source)
    if outcome.rejection is not None:
        raise outcome.rejection
    if outcome.transient is not None:
        raise outcome.transient
    assert outcome.result is not None
    return outcome.result


#: Called inside a batch's transaction once its outcomes are known, before
#: the commit: what a caller writes beside the batch (run counts deliveries).
BatchHook = Callable[["Transaction", list[Outcome]], None]


def apply_batch(
    db: ConsumerDB,
    items: Sequence[Envelope | Rejection],
    *,
    sources: Sequence[str | None] | None = None,
    body_digests: Sequence[str | None] | None = None,
    record_rejections: bool = True,
    before_commit: BatchHook | None = None,
) -> list[Outcome]:
    """Apply a batch in one transaction (:meth:`Transaction.apply_many`) and return outcomes.

    The one place a batch is applied (replay and run). *items* may contain
    rejections found before the store (a body that did not parse): they are
    recorded in ``rejected`` with the others, with the matching entry of
    *sources* and *body_digests* -- unless ``record_rejections`` is False
    (run records them once their dead-letter copy is confirmed).
    *before_commit* writes what goes with the batch. The outcomes are in
    the order of *items*; the transaction commits once.
    """
    with db.transaction() as tx:
        outcomes = tx.apply_many(items)
        if record_rejections:
            for i, outcome in enumerate(outcomes):
                if outcome.rejection is not None:
                    tx.record_rejection(
                        outcome.rejection,
                        source=sources[i] if sources is not None else None,
                        body_sha256=body_digests[i] if body_digests is not None else None,
                    )
        if before_commit is not None:
            before_commit(tx, outcomes)
    return outcomes


# -- effects outside the database (fence.py) ---------------------------------------
# An effect in another system (an HTTP call) cannot join the transaction, so
# such a consumer is applied in several transactions around the call
# (delivery_consumer/fence.py). These are the store's pieces it uses: the
# receipt check and write of Transaction._apply, and the delivery counting of
# run, taken apart.


@dataclass(frozen=True, slots=True)
class DeliveryMark:
    """What :meth:`Transaction.record_delivery` needs to count one broker
    delivery, read from the delivery before its batch is applied."""

    key: str
    redelivered: bool
    attempt: int
    #: False when the delivery was already counted (run's isolated redeliveries).
    count: bool = True
    delivered_hint: int = 0

    def record(self, tx: Transaction, event_id: str | None, outcome: str, *, again: bool = False) -> DeliveryCount:
        """Count the delivery with *outcome*; ``again`` only updates the outcome
        of a delivery this batch counted already (``in-flight`` before a call)."""
        return tx.record_delivery(
            self.key, event_id, redelivered=self.redelivered, attempt=self.attempt, outcome=outcome,
            count=self.count and not again, delivered_hint=self.delivered_hint,
        )


#: The last outcome of a delivery whose process died while handling it, as
#: older versions wrote it (now: CRASHED or INTERRUPTED).
IN_FLIGHT = "in-flight"


# -- what is under way: poison detection (run) ----------------------------------------
# A message is poison when it, alone, kills the process. Before each batch (and
# before each call of an external effect) the process notes the keys it is
# about to handle in ``in_flight``, under its own name, in a commit without
# fsync (a process crash keeps it; see UnsyncedTransaction); the batch's own
# commit deletes the note. A note whose owner is gone is what a crash leaves:
# InFlight.reap turns it into per-key state in ``deliveries`` -- a crash for
# the key handled alone, a suspect (no crash) for each key of a batch. run
# then handles open keys one at a time. A live owner's note (an orphan, a
# process whose channel dropped) is never taken for a crash.

#: A key that was handled alone when its process died (``crashes`` + 1).
CRASHED = "crashed"
#: A key that was one of a batch when its process died: a suspect, not a crash.
INTERRUPTED = "interrupted"
#: Last outcomes of a key whose next delivery must be handled alone.
OPEN_OUTCOMES = (CRASHED, INTERRUPTED, IN_FLIGHT)


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a Linux process, None if none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields[0].decode(), fields[19].decode()  # fields 3 and 22 of proc(5)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:8]
    except OSError:
        return "-"


def process_owner(pid: int | None = None) -> str:
    """A name of process *pid* (default: this one) that no later process shares:
    ``<boot id>:<pid>:<start time>`` (a pid alone is reused)."""
    pid = os.getpid() if pid is None else pid
    stat = _proc_stat(pid)
    return f"{_boot_id()}:{pid}:{stat[1] if stat else '-'}"


def owner_alive(owner: str) -> bool:
    """Whether the process named *owner* (:func:`process_owner`) still runs (a zombie does not)."""
    boot, _, rest = owner.partition(":")
    pid_text, _, start = rest.partition(":")
    if boot != _boot_id() or not pid_text.isdigit():
        return False
    stat = _proc_stat(int(pid_text))
    if stat is None:
        if start != "-":
            return False
        try:  # no /proc: only the pid can be checked
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[1] == start and stat[0] != "Z"


class InFlight:
    """This process's durable note of the deliveries it is handling now."""

    def __init__(self, db: ConsumerDB, owner: str | None = None) -> None:
        self.db = db
        self.owner = owner or process_owner()

    def mark(self, keys: Sequence[str]) -> None:
        """Note *keys* as under way, in a commit of its own (not synced)."""
        with unsynced_transaction(self.db) as tx:
            self.mark_in(tx, keys)

    def mark_in(self, tx: Transaction, keys: Sequence[str]) -> None:
        """Note *keys* as under way in *tx* (committed with it)."""
        tx.conn.execute("INSERT OR REPLACE INTO in_flight (owner, keys, started_at) VALUES (?, ?, ?)",
                        (self.owner, orjson.dumps(list(keys)).decode(), tx.now))

    def clear(self, tx: Transaction) -> None:
        """Nothing is under way any more once *tx* commits (the batch's own transaction)."""
        tx.conn.execute("DELETE FROM in_flight WHERE owner = ?", (self.owner,))

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
                    tx.record_interruption(key, crashed=len(keys) == 1)
        return len(dead)

    def open_keys(self, keys: Sequence[str]) -> dict[str, int]:
        """Those of *keys* whose last delivery ended with its process (to be
        handled alone), with their crash counts; one query."""
        if not keys:
            return {}
        placeholders = ", ".join("?" * len(OPEN_OUTCOMES))
        return {
            str(key): int(crashes) for key, crashes in self.db.conn.execute(
                "SELECT key, crashes FROM deliveries WHERE key IN (SELECT value FROM json_each(?))"
                f" AND last_outcome IN ({placeholders})",
                (orjson.dumps(list(keys)).decode(), *OPEN_OUTCOMES),
            )
        }

    def release(self) -> None:
        """Delete this process's note at a clean exit (best effort: a note
        left behind is settled by the next process as an interruption)."""
        with suppress(DeliveryError), self.db.transaction() as tx:
            self.clear(tx)


def forget_in_flight(path: Path, owner: str) -> None:
    """Delete *owner*'s note from another thread than the one that owns the
    database connection (a process leaving on purpose); best effort, quick."""
    with suppress(sqlite3.Error):
        conn = sqlite3.connect(path, isolation_level=None, timeout=0.5)
        try:
            conn.execute("DELETE FROM in_flight WHERE owner = ?", (owner,))
        finally:
            conn.close()


def _give_up(exc: StoreUnavailable) -> None:
    raise exc


@dataclass(frozen=True, slots=True)
class WorkHooks:
    """What ``run`` lends an effect applied in several transactions (fence.py)."""

    #: Where to note the delivery being called (None: not noted).
    in_flight: InFlight | None = None
    #: True once the process is stopping for good: start no more calls.
    abandoned: Callable[[], bool] = lambda: False
    #: Given a failure of the database as a whole, returns when it is worth
    #: trying again, or raises (the default: at once).
    wait_for_store: Callable[[StoreUnavailable], None] = _give_up


def receipt_of(tx: Transaction, env: Envelope) -> str | None:
    """``duplicate:<result>`` when *env* has a receipt, None when it has none.

    Raises :class:`Rejection` ``event-id-reused`` when the receipt is of
    another body (the same check as :meth:`Transaction.apply`).
    """
    row = tx.conn.execute("SELECT fingerprint, result FROM inbox WHERE event_id = ?", (env.event_id,)).fetchone()
    return None if row is None else _duplicate(row, env)


def has_receipt(db: ConsumerDB, event_id: str) -> bool:
    """Whether *event_id* has a receipt (read outside any transaction)."""
    return db.conn.execute("SELECT 1 FROM inbox WHERE event_id = ?", (event_id,)).fetchone() is not None


def write_receipt(tx: Transaction, env: Envelope, result: str) -> bool:
    """Write the receipt of *env*; False when it already had one (written by
    another process since :func:`receipt_of` looked), which is kept."""
    cur = tx.conn.execute(
        "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at, partition_key)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (event_id) DO NOTHING",
        (env.event_id, env.fingerprint, result, env.type, tx.now, env.article_id),
    )
    return cur.rowcount == 1


class UnsyncedTransaction(Transaction):
    """A write transaction whose COMMIT is not synced (``synchronous=NORMAL``
    for this transaction only; the connection goes back to FULL after it).

    Only for a transaction that nothing is acknowledged on. It survives a
    crash of the process like any commit (the WAL is in the OS's cache), and
    the next ordinary commit makes it durable too: that commit syncs the WAL
    file, which holds this transaction's frames before its own
    (https://sqlite.org/wal.html, https://sqlite.org/pragma.html#pragma_synchronous).
    Only a power loss before that next commit can lose it. The fence's claim
    uses it (fence.py says why that loss is harmless there).
    """

    __slots__ = ()

    def __enter__(self) -> Transaction:
        try:
            self.conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            raise translate(exc, self.db.path) from None
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._restore()

    def _restore(self) -> None:
        try:
            self.conn.execute("PRAGMA synchronous = FULL")  # what every writable connection uses (_connect)
        except sqlite3.Error as exc:
            # Left at NORMAL, later commits could be acknowledged without being durable.
            raise DatabaseError(f"{self.db.path}: cannot restore PRAGMA synchronous: {exc}") from None


def unsynced_transaction(db: ConsumerDB) -> UnsyncedTransaction:
    """``with unsynced_transaction(db) as tx:`` -- see :class:`UnsyncedTransaction`."""
    if db.readonly:
        raise DatabaseError(f"{db.path}: opened read-only")
    return UnsyncedTransaction(db)


__all__ = [
    "CRASHED",
    "INTERRUPTED",
    "OPEN_OUTCOMES",
    "ConsumerDB",
    "DeliveryMark",
    "InFlight",
    "Outcome",
    "Transaction",
    "WorkHooks",
    "apply_batch",
    "apply_event",
    "default_db_path",
    "forget_in_flight",
    "has_receipt",
    "inbox_rowid_before",
    "now_iso",
    "owner_alive",
    "process_owner",
    "receipt_of",
    "unsynced_transaction",
    "write_receipt",
]
