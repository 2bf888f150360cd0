"""The consumer's database: open it, check whose it is, migrate it.

One database per consumer (or per partition of one). :meth:`ConsumerDB.open`
refuses a file that is not this consumer's -- missing, foreign, a producer's,
corrupt, newer, another consumer's or another partition's -- and brings an
older one up to date under one write lock. Transactions on it:
``inbox/apply.py``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..amqp.partitions import Identity, identity_from_meta
from ..model.contract import ConsumerSpec
from ..model.errors import (
    ConfigError,
    DatabaseError,
    DatabaseLost,
    StoreUnavailable,
    TakenOver,
    WrongDatabase,
    safe_reason,
)
from ..store import sqlite
from ..store.dbfile import ContentTags, FileGuard, SerialLock, check_one_name, open_elsewhere
from ..store.placement import default_db
from ..store.sqlite import DEFAULT_BUSY_TIMEOUT_MS, now_iso
from ..version import __version__
from .apply import Transaction, UnsyncedTransaction

#: Pages of WAL after which a commit runs a checkpoint (SQLite's default: 1000).
WAL_AUTOCHECKPOINT_PAGES = 10_000
#: Page cache of a writable connection, KiB (SQLite's default: 2000).
CACHE_KIB = 64 * 1024
# A writer's commit pays for the automatic checkpoint: checkpoint every ~40 MB
# of WAL instead of every 4 MB (fewer, larger copies of pages that change again
# and again), and keep the hot b-tree pages of the inbox and the effect tables
# in memory: the receipt lookups are random by eventId. Both per connection.
# (No mmap: an I/O error on a mapped page is a SIGBUS, not an exception,
# https://sqlite.org/mmap.html.)
_WRITER_PRAGMAS = (f"wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}", f"cache_size = -{CACHE_KIB}")

#: Forward-only migrations of the store's own tables. ``PRAGMA user_version``
#: is the number of entries applied. Never edit an entry: append one.
#: ``inbox`` is a rowid table on purpose: rows are appended in rowid order and
#: only the small (eventId -> rowid) index takes random inserts; as a WITHOUT
#: ROWID table every receipt would land on a random leaf page.
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
    # The envelope's meta (correlationId, causationId, traceparent) as JSON,
    # recorded with the receipt for trace. NULL when the event had none.
    """
    ALTER TABLE inbox ADD COLUMN meta TEXT;
    """,
    # Receipt counters (inbox/counters.py): per (minute, result), kept by the
    # writers a batch at a time; per (hour, result) and per result (the hour
    # '~', after every hour: the current hour's rows and the totals share the
    # last page), kept equal to their sums by triggers. Backfilled from the
    # receipts already there.
    """
    CREATE TABLE inbox_minutes (
        minute TEXT NOT NULL,
        result TEXT NOT NULL,
        n      INTEGER NOT NULL,
        PRIMARY KEY (minute, result)
    ) STRICT, WITHOUT ROWID;
    CREATE TABLE inbox_hours (
        hour   TEXT NOT NULL,
        result TEXT NOT NULL,
        n      INTEGER NOT NULL,
        PRIMARY KEY (hour, result)
    ) STRICT, WITHOUT ROWID;
    CREATE TRIGGER inbox_minutes_added AFTER INSERT ON inbox_minutes BEGIN
        INSERT INTO inbox_hours (hour, result, n) VALUES (substr(new.minute, 1, 13), new.result, new.n)
            ON CONFLICT (hour, result) DO UPDATE SET n = n + excluded.n;
        INSERT INTO inbox_hours (hour, result, n) VALUES ('~', new.result, new.n)
            ON CONFLICT (hour, result) DO UPDATE SET n = n + excluded.n;
    END;
    CREATE TRIGGER inbox_minutes_changed AFTER UPDATE OF n ON inbox_minutes BEGIN
        UPDATE inbox_hours SET n = n + new.n - old.n WHERE hour = substr(new.minute, 1, 13) AND result = new.result;
        UPDATE inbox_hours SET n = n + new.n - old.n WHERE hour = '~' AND result = new.result;
    END;
    CREATE TRIGGER inbox_minutes_removed AFTER DELETE ON inbox_minutes BEGIN
        UPDATE inbox_hours SET n = n - old.n WHERE hour = substr(old.minute, 1, 13) AND result = old.result;
        UPDATE inbox_hours SET n = n - old.n WHERE hour = '~' AND result = old.result;
    END;
    INSERT INTO inbox_minutes (minute, result, n)
        SELECT substr(received_at, 1, 16), result, count(*) FROM inbox GROUP BY 1, 2;
    """,
    # The writers fold receipts into the counters at most every second, not at
    # every commit (the extra pages made every synced commit dearer): the
    # receipts above last_rowid are not counted yet, and the readers add them.
    """
    CREATE TABLE inbox_counted (
        only      INTEGER PRIMARY KEY CHECK (only = 1),
        last_rowid INTEGER NOT NULL
    ) STRICT;
    INSERT INTO inbox_counted (only, last_rowid) VALUES (1, coalesce((SELECT max(rowid) FROM inbox), 0));
    """,
    # An event that came as a CloudEvent keeps the source and id its producer
    # sent ({"id", "source"} as JSON) with its receipt and its rejection, a
    # rejection the key of its event too; and every CloudEvents source seen is
    # listed once, so that trace finds an event by the id its producer knows
    # (the eventId is derived from source and id). NULL before, and for envelopes.
    """
    ALTER TABLE inbox ADD COLUMN origin TEXT;
    ALTER TABLE rejected ADD COLUMN origin TEXT;
    ALTER TABLE rejected ADD COLUMN partition_key TEXT;
    CREATE TABLE ce_sources (
        source   TEXT PRIMARY KEY,
        first_at TEXT NOT NULL
    ) STRICT, WITHOUT ROWID;
    """,
)
STORE_VERSION = len(CORE_MIGRATIONS)
#: The ``meta`` key of the consumer's seal key (hex), made by the first writable open.
SEAL_KEY = "seal_key"
#: The ``meta`` key of the database's identity (32 hex digits), made by the first writable open:
#: a copy or a backup of it has the same, a new database another (restores: ``acked.py``).
DATABASE_ID = "database_id"
#: The ``meta`` key of the newest receipt's rowid as prune found it before deleting (ConsumerDB.high_water).
HIGH_WATER = "high_water"
#: The ``meta`` key naming the release that last migrated the database ("delivery-consumer X.Y.Z").
SCHEMA_BY_KEY = "schema_by"
_CONSUMER_VERSION_KEY = "consumer_schema_version"
#: The ``meta`` key of the consumer's own tables' schema version (how many of its migrations ran).
CONSUMER_VERSION_KEY = _CONSUMER_VERSION_KEY

#: Resolves the consumer a database records to its spec (the registry's ``get``).
SpecLookup = Callable[[str], ConsumerSpec]


class ConsumerDB:
    """An open consumer database: its connection, path and consumer spec.

    Use :meth:`open`; one instance per thread (connections are never shared).
    Read-only instances (for the inspect commands) open the file with
    ``mode=ro`` and autocommit, so they never hold a write lock nor a long
    read snapshot.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path, spec: ConsumerSpec, readonly: bool):
        self.conn = conn
        #: The store's own statements of a transaction (BEGIN, receipts, COMMIT) run on
        #: this one cursor: ``conn.execute`` makes a cursor per statement.
        self.cursor = conn.cursor()
        self.path = path
        self.spec = spec
        self.readonly = readonly
        #: The partition this database serves (None: an unpartitioned consumer).
        self.partition: Identity | None = None
        #: Whether :meth:`open` created the file (it did not exist).
        self.created = False
        #: What a reader should know about the file (its consumer's tables are newer than the
        #: consumer installed here), or None.
        self.note: str | None = None
        #: The file's identity as opened (writable opens): every synced commit
        #: checks that the path still names it (:meth:`check_file`).
        self.guard: FileGuard | None = None
        #: When (time.monotonic) the next commit folds new receipts into the counters.
        self.count_due = 0.0
        #: Wall clock minus monotonic clock at open (inbox/apply.py notes a jump of the wall clock).
        self.clock_base = time.time() - time.monotonic()
        #: Whether another run took the database over (WriterLock.taken_over): asked when the
        #: content check fails, since the new holder's tags are not this writer's.
        self.taken_over: Callable[[], bool] | None = None
        #: Set once another run took the database over from this frozen one (WriterLock.superseded).
        self.superseded: threading.Event | None = None
        #: The content tags of the file's one writer (:meth:`watch_content`); None for others.
        self.tags: ContentTags | None = None
        self._serial: SerialLock | None = None
        #: The whole integrity check still running in the background (nothing is acknowledged
        #: before it passed: the worker asks it); None when the file was checked at open.
        self.integrity: IntegrityCheck | None = None

    # -- opening ---------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: Path | str | None = None,
        spec: ConsumerSpec | None = None,
        *,
        lookup: SpecLookup | None = None,
        create: bool = False,
        readonly: bool = False,
        busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
        partition: Identity | None = None,
        unpartitioned: bool = False,
        empty_ok: bool = False,
    ) -> ConsumerDB:
        """Open (and with ``create`` make) the database of the consumer *spec*.

        Either may be omitted: the path defaults to ``state/<consumer>/inbox.db``;
        without *spec*, the consumer is the one the database records, resolved
        by *lookup*. Raises :class:`DatabaseError` for a missing, foreign,
        corrupt, newer or other consumer's database -- and, with *partition*,
        for a database of another partition or count (a new one records
        *partition*); with *unpartitioned*, for any partition's. An existing
        file that holds no database (0 bytes, no tables: a failed recovery, a
        truncated copy) is refused unless *empty_ok* (``init``, or the writer
        lock that made the file just now), and a writable open refuses a file
        with more than one name (hard links: SQLite journals per name).
        """
        consumer = spec.name if spec is not None else None
        if path is None:
            if consumer is None:
                raise DatabaseError("give a consumer name or a database path")
            path = default_db(consumer)
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
        checked = path
        if exists and not readonly:
            try:
                check_one_name(path)
            except FileNotFoundError:
                exists = False

        was_empty = [False]

        def refuse_foreign(conn: sqlite3.Connection) -> None:
            # Before the switch to WAL, which is persistent: refusing must not modify the file.
            was_empty[0] = cls._recorded_consumer(conn, checked) is None
            if was_empty[0] and exists and not empty_ok and not open_elsewhere(checked):
                raise DatabaseError(
                    f"{checked}: this file holds no database ({checked.stat().st_size} bytes, no tables) where one "
                    f"was expected: not adopted as a new one. A failed recovery or copy leaves such a file: restore "
                    f"a backup or recover the old file (docs/failures.md, \"Restores\"); if a new, empty database "
                    f"is meant, delete the file (run creates one) or run init on it")

        conn = sqlite.connect(path, readonly=readonly, busy_timeout_ms=busy_timeout_ms,
                              check=None if readonly else refuse_foreign, pragmas=() if readonly else _WRITER_PRAGMAS)
        with sqlite.closed_on_failure(conn, path):
            if readonly:
                stored = cls._check_readable(conn, path)
            else:
                stored = cls._prepare_writable(conn, path, spec, lookup, partition)
            if consumer is not None and stored != consumer:
                raise WrongDatabase(
                    f"{path}: this database belongs to consumer {stored!r}, not {consumer!r}"
                )
            if partition is not None or unpartitioned:
                cls._check_partition(conn, path, stored, partition)
            if spec is None:
                spec = cls._resolve(path, stored, lookup)
            note = cls._check_consumer_version(conn, path, spec) if readonly else None
            db = cls(conn, path, spec, readonly)
            db.note = note
            db.partition = identity_from_meta(db.meta())
            db.created = not exists or was_empty[0]
            if not readonly:
                db.guard = FileGuard(path)
        return db

    @staticmethod
    def _resolve(path: Path, consumer: str, lookup: SpecLookup | None) -> ConsumerSpec:
        if lookup is None:
            raise DatabaseError(f"{path}: a database of consumer {consumer!r}; give its spec to open it")
        return lookup(consumer)

    @staticmethod
    def _recorded_consumer(conn: sqlite3.Connection, path: Path) -> str | None:
        """The consumer the database records; None for an empty file."""
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = sqlite.table_names(conn)
        if "meta" not in tables or "inbox" not in tables:
            if not tables and version == 0:
                return None
            if "outbox" in tables:
                raise WrongDatabase(
                    f"{path}: this is a producer's database (it holds an outbox), not a consumer's inbox")
            raise DatabaseError(f"{path}: not a delivery-consumer database")
        if version > STORE_VERSION:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (SCHEMA_BY_KEY,)).fetchone()
            by = f" by {row[0]}" if row else " by a later release"
            raise DatabaseError(
                f"{path}: database schema version {version} was written{by}; this delivery-consumer "
                f"{__version__} knows versions up to {STORE_VERSION} and never downgrades a database: "
                "open it with that release or a later one (pip install -U delivery-consumer)"
            )
        if version == 0:
            raise DatabaseError(f"{path}: not a delivery-consumer database")
        row = conn.execute("SELECT value FROM meta WHERE key = 'consumer'").fetchone()
        if row is None:
            raise DatabaseError(f"{path}: not a delivery-consumer database (no consumer recorded)")
        return str(row[0])

    @classmethod
    def _check_readable(cls, conn: sqlite3.Connection, path: Path) -> str:
        stored = cls._recorded_consumer(conn, path)
        if stored is None:
            raise DatabaseError(f"{path}: empty database; run delivery-consumer init first")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version < STORE_VERSION:
            raise DatabaseError(f"{path}: schema version {version} is old; run init to upgrade it")
        return stored

    @staticmethod
    def _check_consumer_version(conn: sqlite3.Connection, path: Path, spec: ConsumerSpec) -> str | None:
        """Refuse to read tables older than the installed consumer's migrations (init
        upgrades them); tables a later release of the consumer migrated are read as
        they are, with a note (what it added, this release does not show)."""
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (_CONSUMER_VERSION_KEY,)).fetchone()
        version = int(row[0]) if row else 0
        known = len(spec.migrations)
        if version < known:
            raise DatabaseError(
                f"{path}: the {spec.name} tables are at version {version}, older than the {known} migrations of "
                f"the {spec.name} consumer installed here; run init to upgrade them"
            )
        if version > known:
            return (f"{path}: the {spec.name} tables are at version {version}, newer than the {known} migrations "
                    f"of the {spec.name} consumer installed here (a later release migrated them): read as this "
                    "release knows them; it will not write them")
        return None

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
        cls, conn: sqlite3.Connection, path: Path, spec: ConsumerSpec | None, lookup: SpecLookup | None,
        partition: Identity | None = None,
    ) -> str:
        """Check identity and run pending migrations, all under one write lock."""
        # sqlite3 errors leave as they are: open() words them (cannot use this database)
        with sqlite.transaction(conn, translated=False):
            stored = cls._recorded_consumer(conn, path)
            if stored is None:
                if spec is None:
                    raise DatabaseError(f"{path}: empty database; give --consumer to initialise it")
                stored = spec.name
            elif spec is not None and stored != spec.name:
                raise WrongDatabase(
                    f"{path}: this database belongs to consumer {stored!r}, not {spec.name!r}"
                )
            spec = spec or cls._resolve(path, stored, lookup)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            sqlite.migrate(conn, CORE_MIGRATIONS, version, what="database schema")
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
            # The key that seals the attempt counts of this consumer's copies (retry.py); a database
            # of an older release gets one now.
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)",
                         (SEAL_KEY, os.urandom(32).hex()))  # not secrets: start-up time counts
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (DATABASE_ID, os.urandom(16).hex()))
            row = conn.execute(
                "SELECT value FROM meta WHERE key = ?", (_CONSUMER_VERSION_KEY,)
            ).fetchone()
            applied = sqlite.migrate(conn, spec.migrations, int(row[0]) if row else 0,
                                     what=f"the {spec.name} tables' schema")
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (_CONSUMER_VERSION_KEY, str(applied)),
            )
            if version != STORE_VERSION or applied != (int(row[0]) if row else 0):  # it migrated: say who
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             (SCHEMA_BY_KEY, f"delivery-consumer {__version__}"))
            for check in spec.checks:  # its tables as it needs them, now rather than at the first event
                try:
                    check(conn)
                except ConfigError as exc:
                    raise ConfigError(f"{path}: {exc}") from None
        return stored

    # -- use -------------------------------------------------------------------

    @property
    def consumer(self) -> str:
        return self.spec.name

    def close(self) -> None:
        # SQLite's connection first: closing a descriptor of the file while it is
        # open would release its locks (dbfile.release_fd).
        try:
            # The store's cursor holds its last statement: while one is not finalized, SQLite
            # keeps the connection (and its descriptors of the file) open after close.
            with contextlib.suppress(sqlite3.ProgrammingError):  # its connection closed already
                self.cursor.close()
            self.conn.close()
        finally:
            if self._serial is not None:
                self._serial.close()
            if self.guard is not None:
                self.guard.close()

    def serial(self) -> SerialLock:
        """``with db.serial():`` -- one process at a time in the block, across
        connections, processes and every name of the file (an OFD lock on a byte
        of the database file itself): for a protocol whose steps span several
        transactions (the fence)."""
        if self._serial is None:
            self._serial = SerialLock(self.path, self.guard.identity if self.guard is not None else None)
        return self._serial

    def watch_content(self, tags: ContentTags | None = None) -> None:
        """From now on, notice a copy written over the file (the file's one writer calls it):
        a new tag in the header, checkpointed into the file at once; every commit's
        check then reads the main file's tag whenever the file was written
        (dbfile.FileGuard). The tag changes again at most every second a commit is made.
        *tags*: those of this writer's connection before (opened again after a disk
        failure): the file must still carry one of them."""
        if self.guard is None or self.readonly:
            return
        tags = self.guard.watch(tags)
        with self.transaction() as tx:
            tx.conn.execute(f"PRAGMA application_id = {tags.next()}")
        self.tags = tags
        with contextlib.suppress(sqlite3.Error):  # a busy checkpoint is done later by a commit
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        self.check_file()

    def database_id(self) -> str:
        """The database's identity (:data:`DATABASE_ID`; "" for a database opened read-only before it had one)."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (DATABASE_ID,)).fetchone()
        return str(row[0]) if row else ""

    def high_water(self) -> int:
        """The rowid of the newest receipt ever written: receipts only go up the rowid, and
        prune, which may delete the newest, records it first (:func:`keep_high_water`)."""
        return int(self.conn.execute(
            "SELECT max(coalesce((SELECT max(rowid) FROM inbox), 0),"
            " coalesce((SELECT CAST(value AS INTEGER) FROM meta WHERE key = ?), 0))", (HIGH_WATER,)).fetchone()[0])

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

    def unsynced_transaction(self) -> Transaction:
        """A write transaction whose COMMIT is not synced (:class:`~.apply.UnsyncedTransaction`)."""
        if self.readonly:
            raise DatabaseError(f"{self.path}: opened read-only")
        return UnsyncedTransaction(self)

    def check_file(self) -> None:
        """Raise DatabaseLost when the path no longer names the file this
        connection writes (deleted, or replaced by another file): one ``stat``.
        Every synced commit calls it (:class:`Transaction`), so that nothing
        committed into a lost file is acknowledged or reported."""
        if self.guard is not None:
            try:
                self.guard.check()
            except DatabaseLost:
                if self.taken_over is not None and self.taken_over():  # the new holder's tags, not a copy
                    self.superseded = self.superseded or threading.Event()
                    self.superseded.set()
                else:
                    raise
        if self.superseded is not None and self.superseded.is_set():
            raise TakenOver(f"{self.path}: another run took this database over while this one was frozen (its "
                            f"note {self.path}.lock names it); stopped: nothing written since is acknowledged")

    def check_integrity(self, limit_s: float) -> bool:
        """``PRAGMA quick_check``, given at most *limit_s* seconds: raise
        DatabaseError (one line: how to recover) when the file is damaged;
        False when the check did not finish in time (not checked yet: see
        :class:`IntegrityCheck`), True when it passed. quick_check reads every
        page once (O(size)); it does not compare indexes with their tables
        (integrity_check does, slower). The bound is real: the check is one
        instruction of SQLite's, so no progress handler runs inside it, and
        it is interrupted (``sqlite3_interrupt``) from a timer instead."""
        problems, finished = quick_check(self.conn, self.path, limit_s)
        if problems:
            raise damaged(self.path, problems[0])
        return finished

    def meta(self) -> dict[str, str]:
        """The database's identity and versions."""
        return dict(self.conn.execute("SELECT key, value FROM meta").fetchall())


def quick_check(conn: sqlite3.Connection, path: Path, limit_s: float | None) -> tuple[list[str], bool]:
    """``PRAGMA quick_check(3)`` on *conn*, interrupted after *limit_s* (None: no limit):
    the problems it found, and whether it finished. A failure of the disk is StoreUnavailable."""
    timer = threading.Timer(limit_s, conn.interrupt) if limit_s is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        rows = conn.execute("PRAGMA quick_check(3)").fetchall()
    except sqlite3.Error as exc:
        if timer is not None and not timer.is_alive() and "interrupt" in str(exc):
            return [], False
        error = sqlite.translate(exc, path)
        if isinstance(error, StoreUnavailable):  # the disk's fault (I/O, busy): not a damaged file
            raise error from None
        return [str(exc)], True
    finally:
        if timer is not None:
            timer.cancel()
    return [line for row in rows for line in str(row[0]).splitlines()
            if line.strip() and line != "ok" and not line.startswith("***")], True


def damaged(path: Path, problem: str) -> DatabaseError:
    """The one line for a database that failed its integrity check: what, and how to recover."""
    return DatabaseError(
        f"{path}: the database is damaged ({safe_reason(problem, 120)}); not written into: recover it with "
        f"delivery-consumer inbox recover --db {path} --to recovered.db (then check it and put it in place "
        f"while no run is up), or restore a backup (docs/failures.md, \"Restores\")")


class IntegrityCheck:
    """The whole ``quick_check`` of a database file, in a thread of its own on a read-only
    connection: what a run that could not check its file within its bound, or a standby
    watching the file it may take over, finishes while it consumes or waits. :meth:`verdict`
    says whether it is done, and raises when it found the file damaged."""

    def __init__(self, path: Path, on_done: Callable[[IntegrityCheck], None] = lambda _check: None) -> None:
        self.path = path
        self.identity = FileGuard(path).identity
        self._on_done = on_done
        self.started = time.monotonic()
        self.done = threading.Event()
        self.seconds = 0.0
        self.problem: str | None = None
        self.unavailable: str | None = None
        threading.Thread(target=self._check, name="delivery-integrity", daemon=True).start()

    def _check(self) -> None:
        try:
            with sqlite.reading(self.path, what="check it") as conn:
                problems, _finished = quick_check(conn, self.path, None)
            self.problem = problems[0] if problems else None
        except (DatabaseError, StoreUnavailable, sqlite3.Error) as exc:
            self.unavailable = str(exc)
        finally:
            self.seconds = time.monotonic() - self.started
            self.done.set()
            self._on_done(self)

    def verdict(self) -> bool:
        """True once the check passed (or could not run: the disk's fault, said by the writes);
        False while it runs; DatabaseError when it found the file damaged."""
        if not self.done.is_set():
            return False
        if self.problem is not None:
            raise damaged(self.path, self.problem)
        return True


def keep_high_water(conn: sqlite3.Connection) -> None:
    """Record the newest receipt's rowid before receipts are deleted (inside the transaction):
    once the table is empty SQLite numbers receipts from 1 again."""
    (newest,) = conn.execute("SELECT max(rowid) FROM inbox").fetchone()
    if newest is not None:
        conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE"
                     " SET value = CAST(max(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER)) AS TEXT)",
                     (HIGH_WATER, str(newest)))


__all__ = ["CORE_MIGRATIONS", "DATABASE_ID", "HIGH_WATER", "SEAL_KEY", "STORE_VERSION", "ConsumerDB",
           "IntegrityCheck", "SpecLookup", "damaged", "keep_high_water", "quick_check"]
