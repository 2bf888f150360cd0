"""The producer side: a transactional outbox in the producer's own SQLite
database, and the dispatcher that moves its rows to RabbitMQ.

The producer writes its own change and the event in **one** transaction::

    conn = outbox.connect("producer.db")            # WAL, synchronous=FULL, outbox installed
    with outbox.transaction(conn):                  # BEGIN IMMEDIATE ... COMMIT
        conn.execute("UPDATE material SET ...")
        outbox.enqueue(conn, envelope)               # validated, canonical bytes stored

so the change and the event commit together or not at all. The dispatcher
(:class:`Dispatcher`, ``delivery-consumer dispatch``) publishes unpublished
rows persistent and mandatory with ``message_id`` = eventId and pipelined
publisher confirms, and sets ``published_at`` only for rows whose confirm
arrived. A row is therefore published *at least* once; the consumer's inbox
absorbs the duplicates (same eventId, same fingerprint).

The table
---------
``outbox`` (STRICT), one row per eventId; ``seq`` is the creation order::

    seq, event_id (unique), routing_key, ordering_key (the articleId),
    body (canonical JSON, BLOB), fingerprint, created_at,
    attempts, last_error, last_attempt_at, next_attempt_at,
    lease_owner, lease_until, published_at

The outbox is a guest in the producer's database, so it does not touch
``PRAGMA user_version`` (the producer's own): its schema version is the key
``version`` of the table ``outbox_meta``, with forward-only migrations like
the store's.

Rounds
------
A round claims a batch (``batch`` rows, at most 16 MiB of bodies), sends it
through :class:`~delivery_consumer.broker.StreamPublisher`, and -- once its
confirms are all in -- marks it. Up to ``depth`` batches (2 by default) are in
flight: the next one is claimed and sent behind the previous one on the same
channel while that one waits for its confirms, so the broker never idles at
a batch boundary (``bench/bench_dispatch.py``). Batches are collected and
marked in the order they were sent.

Lease (several dispatchers on one database)
-------------------------------------------
A dispatcher *claims* rows in one ``BEGIN IMMEDIATE`` transaction by writing
its owner id (``host:pid:random``) and ``lease_until = now + lease``; other
dispatchers skip leased rows, so in normal operation no row is published by
two dispatchers at once. The publisher's timeout is ``lease / (depth + 2)``
(at most 30 s), so a live dispatcher connects and collects every batch in
flight well before its leases end. Marking clears the lease.

* A dispatcher that **dies** holding leases (at most ``depth`` batches)
  leaves those rows unpublished and leased: they wait until ``lease_until``
  (``--lease``, 60 s by default) and are then claimed again, by any
  dispatcher. Rows the dead one had already sent are published a second
  time: one duplicate each, which the consumer's inbox absorbs. The new
  claim records ``last_error = "lease of <owner> expired ..."``.
* A dispatcher **stalled** past its lease (SIGSTOP, a paused VM) can find
  another one publishing the same rows: duplicates, never a loss. Its late
  marks cannot undo the other's work: ``published_at`` is only ever set
  once (``coalesce``), and a failure is recorded only while the marker still
  owns the lease.

Ordering guarantee
------------------
Rows are claimed in creation order and sent in that order on one channel,
so first publications reach the broker in creation order. A row whose
publication fails (unroutable, nacked, unconfirmed) leaves the stream and is
retried after its own backoff; it does not hold up the other rows.
Within one **ordering key** (the articleId) order is kept: a row is never
claimed while an earlier unpublished row of its key is leased (by another
dispatcher, or by this one's batch in flight) or waiting for its backoff, so
the later events of a failing article wait for it while other articles go
on. The one exception: rows of the same key *in the same batch* are already
on the wire when the earlier one fails, so they overtake it (consumers order
by ``revision``, which makes this harmless for the catalog). After a
connection loss the unconfirmed rows are published again, possibly behind
later ones and possibly twice.

Failures
--------
* broker unreachable -> no row is claimed; the dispatcher waits
  ``retry.reconnect_delay_s(failures)`` (exponential, jittered, capped) and
  tries again: an outage is waited out, never spun on;
* returned (unroutable) or nacked -> ``attempts + 1``, a short safe
  ``last_error``, ``next_attempt_at = now + backoff(attempts)`` for that row;
* unconfirmed (the connection died with the message in flight) ->
  ``attempts + 1`` and ``last_error`` for it and every batch behind it, the
  leases are released, and the dispatcher backs off as for an outage;
* the database busy past its timeout -> backoff and retry; a batch sent but
  not marked keeps its lease and goes again after it (duplicates, no loss);
* fatal broker errors (credentials, vhost, permissions) -> the leases in
  flight are released and :class:`~delivery_consumer.broker.BrokerFatal`
  propagates.

Crash points (:func:`delivery_consumer.faults.crashpoint`):
``dispatch-before-publish`` (a batch leased, not sent), ``dispatch-after-confirm``
(a batch's confirms all in, not marked; the batch behind it possibly sent)
and ``dispatch-mid-batch`` (half of a batch marked inside the uncommitted mark
transaction: the whole mark is lost, none of it half-applied). Whatever the
moment of a SIGKILL, at most ``depth * batch`` rows are published twice.

pika is never imported here: :mod:`delivery_consumer.broker` is imported
lazily by the dispatcher, so producers calling :func:`enqueue` and the
``outbox`` read commands do not load it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sqlite3
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol
from urllib.parse import quote

import orjson

from .envelope import Envelope, from_mapping, parse
from .errors import EVENT_ID_REUSED, DatabaseError, DeliveryError, Rejection, TransientError, safe_reason
from .faults import crashpoint
from .queries import NotFound
from .retry import reconnect_delay_s
from .store import DEFAULT_BUSY_TIMEOUT_MS, _statements, now_iso, translate

if TYPE_CHECKING:
    from .broker import OutMessage, PublishResult

log = logging.getLogger("delivery_consumer.dispatch")

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
)
VERSION: Final = len(MIGRATIONS)

#: Longest ``last_error`` kept (it is shown by ``outbox list``).
MAX_ERROR_CHARS: Final = 160


class OutboxError(DeliveryError):
    """The outbox was used the wrong way (enqueue outside a transaction)."""


# -- the database ----------------------------------------------------------------


def connect(
    path: Path | str, *, readonly: bool = False, install_tables: bool = True,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
) -> sqlite3.Connection:
    """Open the producer's database the way the store opens a consumer's.

    Autocommit mode (``isolation_level=None``) with explicit ``BEGIN
    IMMEDIATE`` / ``COMMIT`` (see :func:`transaction`), WAL with
    ``synchronous=FULL`` (a row the producer committed survives power loss),
    ``busy_timeout``. Writable connections create the file and install the
    outbox tables (``install_tables=False`` to leave that to the caller);
    read-only ones (``mode=ro``) require them.
    """
    path = Path(path)
    if path.is_dir():
        raise DatabaseError(f"{path}: is a directory, not a database file")
    if readonly and not path.is_file():
        raise DatabaseError(f"{path}: no such database")
    try:
        if readonly:
            uri = f"file:{quote(str(path.resolve()))}?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=busy_timeout_ms / 1000)
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseError(f"{path}: cannot create its directory: {exc.strerror or exc}") from None
            conn = sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    except sqlite3.Error as exc:
        raise DatabaseError(f"{path}: cannot open database: {exc}") from None
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if readonly:
            version = installed_version(conn)
            if version == 0:
                raise DatabaseError(f"{path}: no outbox in this database")
            if version > VERSION:
                raise DatabaseError(f"{path}: outbox schema version {version} is newer than this code's {VERSION}")
        else:
            _check_foreign(conn, path)
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode != "wal":
                raise DatabaseError(f"{path}: cannot switch to WAL mode (got {mode!r})")
            conn.execute("PRAGMA synchronous = FULL")
            if install_tables:
                install(conn)
    except sqlite3.Error as exc:
        conn.close()
        raise DatabaseError(f"{path}: cannot use this database: {exc}") from None
    except BaseException:
        conn.close()
        raise
    return conn


def _check_foreign(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse a consumer's inbox database before switching anything in it."""
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    if "inbox" in names and "meta" in names:
        raise DatabaseError(f"{path}: this is a consumer's inbox database, not a producer's")


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (or ``ROLLBACK``) on *conn*.

    IMMEDIATE takes the write lock at once, so the read-then-write of
    :func:`enqueue` never hits the deferred upgrade that fails without
    waiting in WAL mode (https://sqlite.org/lang_transaction.html).
    """
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        _rollback(conn)
        raise translate(exc, _path_of(conn)) from None
    except BaseException:
        _rollback(conn)
        raise


def _rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with suppress(sqlite3.Error):  # SQLite may have rolled back by itself
            conn.execute("ROLLBACK")


def _path_of(conn: sqlite3.Connection) -> str:
    with suppress(sqlite3.Error):
        row = conn.execute("PRAGMA database_list").fetchone()
        if row and row[2]:
            return str(row[2])
    return "producer database"


def installed_version(conn: sqlite3.Connection) -> int:
    """The outbox schema version of the database (0: not installed)."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'outbox_meta'"
    ).fetchone()
    if exists is None:
        return 0
    row = conn.execute("SELECT value FROM outbox_meta WHERE key = 'version'").fetchone()
    return int(row[0]) if row else 0


def install(conn: sqlite3.Connection) -> int:
    """Create or upgrade the outbox tables; returns the version now installed.

    Runs inside the caller's open transaction if there is one (the caller
    commits), otherwise in its own ``BEGIN IMMEDIATE`` transaction.
    Idempotent. Refuses a database whose outbox is newer than this code.
    """
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN IMMEDIATE")
    try:
        version = installed_version(conn)
        if version > VERSION:
            raise DatabaseError(
                f"{_path_of(conn)}: outbox schema version {version} is newer than this code's {VERSION}; upgrade it"
            )
        for script in MIGRATIONS[version:]:
            for statement in _statements(script):
                conn.execute(statement)
        if version < VERSION:
            conn.execute("INSERT OR REPLACE INTO outbox_meta (key, value) VALUES ('version', ?)", (str(VERSION),))
            if version == 0:
                conn.execute("INSERT INTO outbox_meta (key, value) VALUES ('created_at', ?)", (now_iso(),))
        if own:
            conn.execute("COMMIT")
    except BaseException:
        if own:
            _rollback(conn)
        raise
    return VERSION


# -- enqueue ------------------------------------------------------------------------


def enqueue(
    conn: sqlite3.Connection, envelope: Envelope | Mapping[str, Any] | bytes, *, routing_key: str | None = None
) -> bool:
    """Add *envelope* to the outbox inside the caller's open transaction.

    The envelope (an :class:`Envelope`, a dict or raw JSON bytes) is validated
    against the schema (:class:`Rejection` otherwise) and stored as its
    canonical bytes. The routing key defaults to the event type; the
    ordering key is the articleId.

    Returns True when a row was added, False when the same eventId is already
    there with the same fingerprint (a no-op). The same eventId with another
    body raises :class:`Rejection` ``event-id-reused``; the caller's
    transaction is left open for it to roll back.

    Raises :class:`OutboxError` outside a transaction: the row would commit
    on its own, apart from the producer's change it must go with.
    """
    if not conn.in_transaction:
        raise OutboxError("enqueue needs the caller's open transaction (BEGIN IMMEDIATE first)")
    if isinstance(envelope, Envelope):
        env = envelope
    elif isinstance(envelope, bytes | bytearray | memoryview):
        env = parse(bytes(envelope))
    else:
        env = from_mapping(envelope)
    cur = conn.execute(
        "INSERT INTO outbox (event_id, routing_key, ordering_key, body, fingerprint, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (event_id) DO NOTHING",
        (env.event_id, routing_key or env.type, env.article_id, env.canonical, env.fingerprint, now_iso()),
    )
    if cur.rowcount == 1:
        return True
    row = conn.execute("SELECT fingerprint FROM outbox WHERE event_id = ?", (env.event_id,)).fetchone()
    if row is not None and row[0] == env.fingerprint:
        return False
    stored = row[0][:12] if row else "?"
    raise Rejection(
        EVENT_ID_REUSED,
        f"eventId is already in the outbox with fingerprint {stored}…, this body differs",
        event_id=env.event_id,
        fingerprint=env.fingerprint,
    )


# -- the dispatcher -----------------------------------------------------------------------


class PublisherLike(Protocol):
    """What the dispatcher needs of :class:`delivery_consumer.broker.StreamPublisher`:
    batches sent one behind the other on one channel, collected in order."""

    def connect(self) -> None: ...

    def send(self, messages: Sequence[OutMessage]) -> Any: ...

    def collect(self, ticket: Any) -> list[PublishResult]: ...

    def idle(self, seconds: float) -> None: ...


class Claimed(NamedTuple):
    """One row leased by this dispatcher (a tuple: made once per row, cheaply)."""

    seq: int
    event_id: str
    routing_key: str
    body: bytes
    attempts: int


@dataclass
class DispatchConfig:
    """How the dispatcher works; every duration in seconds."""

    exchange: str
    #: Rows per batch: each batch costs two commits (lease, mark), so small
    #: batches cost throughput (bench/RESULTS_dispatch.md).
    batch: int = 1000
    #: A claim also stops at this many body bytes (a body may be 1 MiB), so
    #: a batch never holds much memory; it always takes at least one row.
    batch_bytes: int = 16 << 20
    #: Batches in flight: the next batch is claimed and sent while the one
    #: before waits for its confirms, so the broker never idles at a batch
    #: boundary. A crash duplicates at most depth * batch rows.
    depth: int = 2
    lease_s: float = 60.0
    poll_s: float = 0.5
    exit_when_idle_s: float | None = None
    retry_base_s: float = 1.0
    retry_cap_s: float = 300.0
    owner: str = field(default_factory=lambda: default_owner())

    def __post_init__(self) -> None:
        if self.batch < 1 or self.batch_bytes < 1 or self.depth < 1:
            raise ValueError("batch, batch_bytes and depth must be >= 1")
        if self.lease_s <= 0 or self.poll_s <= 0 or self.retry_base_s <= 0 or self.retry_cap_s <= 0:
            raise ValueError("lease, poll and retry durations must be positive")

    @property
    def publish_timeout_s(self) -> float:
        """The publisher's timeout: a connect plus the confirms of every
        batch in flight fit in the lease with room to spare, so a live
        dispatcher never outlives its lease."""
        return max(0.5, min(30.0, self.lease_s / (self.depth + 2)))


def default_owner() -> str:
    """A dispatcher's lease owner id: host, pid and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class DispatchStats:
    """Totals of one dispatcher run (the exit line and the benchmark read them)."""

    results: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    outages: int = 0
    #: time.perf_counter() of the first claim and of the last mark.
    first_claim: float = 0.0
    last_mark: float = 0.0

    @property
    def published(self) -> int:
        return self.results["confirmed"]

    def line(self) -> str:
        span = self.last_mark - self.first_claim if self.batches else 0.0
        rate = f" ({self.published / span:.0f}/s)" if span > 0 and self.published else ""
        failed = ", ".join(f"{n} {k}" for k, n in sorted(self.results.items()) if k != "confirmed") or "0 failed"
        return (f"{self.published} published in {self.batches} batches, {failed}; "
                f"{self.outages} broker outages; first claim to last mark {span:.3f}s{rate}")


#: One UPDATE for a whole batch: the seqs travel as one JSON array, which
#: costs a fraction of an ``executemany`` with a statement per row.
_SEQS: Final = "(SELECT value FROM json_each(?))"


def _seqs(seqs: Iterable[int]) -> str:
    return "[" + ",".join(map(str, seqs)) + "]"


class Dispatcher:
    """Moves outbox rows to the broker; one per process, single-threaded.

    *conn* must be this thread's own writable connection (:func:`connect`);
    *publisher* is a :class:`delivery_consumer.broker.StreamPublisher` (or a
    fake in tests); *clock* (seconds since the epoch) and *sleep* are
    replaceable for tests.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        publisher: PublisherLike,
        config: DispatchConfig,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.conn = conn
        self.publisher = publisher
        self.config = config
        self.clock = clock
        self.sleep = sleep or self._nap
        self.stats = DispatchStats()
        self.stopping = False
        self._failures = 0  # consecutive broker failures, for the backoff
        self._db_failures = 0  # consecutive database-busy failures
        self._connected = False
        self._inflight: deque[tuple[list[Claimed], Any]] = deque()  # sent, not yet collected

    def stop(self) -> None:
        """Claim no more; :meth:`run` settles the batches in flight and returns (signal-safe)."""
        self.stopping = True

    # -- claim and mark (each one BEGIN IMMEDIATE transaction) --

    def claim(self) -> list[Claimed]:
        """Lease up to ``batch`` publishable rows, in creation order.

        A row is publishable when it is unpublished, not under a live lease,
        past its backoff, and no earlier unpublished row of its ordering key
        is under a live lease (another dispatcher's, or this one's batch in
        flight) or waiting for its backoff.
        """
        now = self.clock()
        now_s, until = now_iso(now), now_iso(now + self.config.lease_s)
        taken: list[Claimed] = []
        expired: list[tuple[str, int]] = []
        # An idle poll only reads: the write lock (which the producer needs
        # for its own transactions) is taken only when some row is due.
        due = self.conn.execute(
            "SELECT 1 FROM outbox WHERE published_at IS NULL AND coalesce(next_attempt_at, '') <= ?1"
            " AND coalesce(lease_until, '') <= ?1 LIMIT 1", (now_s,)).fetchone()
        if due is None:
            return taken
        with transaction(self.conn) as conn:
            blocked: set[str] = set()
            size = 0
            cur = conn.execute(
                "SELECT seq, event_id, routing_key, ordering_key, body, attempts, next_attempt_at, lease_owner,"
                " lease_until"
                " FROM outbox WHERE published_at IS NULL ORDER BY seq"
            )
            try:
                for seq, event_id, routing_key, key, body, attempts, next_at, owner, lease_until in cur:
                    if key in blocked:
                        continue
                    if (next_at is not None and next_at > now_s) or (lease_until is not None and lease_until > now_s):
                        blocked.add(key)
                        continue
                    if taken and size + len(body) > self.config.batch_bytes:
                        break
                    size += len(body)
                    taken.append(Claimed(seq, event_id, routing_key, body, attempts))
                    if owner is not None:
                        expired.append((safe_reason(f"lease of {owner} expired before it marked this row",
                                                    MAX_ERROR_CHARS), seq))
                    if len(taken) >= self.config.batch:
                        break
            finally:
                cur.close()
            conn.execute(
                f"UPDATE outbox SET lease_owner = ?, lease_until = ? WHERE seq IN {_SEQS}",
                (self.config.owner, until, _seqs(row.seq for row in taken)),
            )
            conn.executemany("UPDATE outbox SET last_error = ? WHERE seq = ?", expired)
        if expired:
            log.warning("claimed %d rows whose previous dispatcher died or stalled holding them", len(expired))
        return taken

    def mark(self, rows: Sequence[Claimed], results: Sequence[PublishResult]) -> None:
        """Record the fate of each claimed row and release the leases.

        Confirmed: ``published_at`` (kept if another dispatcher set it first).
        Otherwise ``published_at`` stays empty; ``attempts + 1``, a short
        ``last_error``; returned and nacked rows also get their own backoff.
        A failure is recorded only while this dispatcher still owns the row.
        """
        now = self.clock()
        now_s = now_iso(now)
        published: list[int] = []
        failed: list[tuple[str, str | None, int, str]] = []
        for row, result in zip(rows, results, strict=True):
            if result.ok:
                published.append(row.seq)
                continue
            error = safe_reason(f"{result.status}: {result.reason}" if result.reason else result.status,
                                MAX_ERROR_CHARS)
            next_at = None
            if result.status != "unconfirmed":  # an outage is backed off by the loop, not per row
                cfg = self.config
                delay = reconnect_delay_s(row.attempts + 1, base_s=cfg.retry_base_s, cap_s=cfg.retry_cap_s)
                next_at = now_iso(now + delay)
            failed.append((error, next_at, row.seq, self.config.owner))
        half = len(published) // 2
        with transaction(self.conn) as conn:
            sql = ("UPDATE outbox SET published_at = coalesce(published_at, ?1), attempts = attempts + 1,"
                   " last_attempt_at = ?1, next_attempt_at = NULL, lease_owner = NULL, lease_until = NULL"
                   f" WHERE seq IN {_SEQS.replace('?', '?2')}")
            conn.execute(sql, (now_s, _seqs(published[:half])))
            crashpoint("dispatch-mid-batch")
            conn.execute(sql, (now_s, _seqs(published[half:])))
            conn.executemany(
                "UPDATE outbox SET attempts = attempts + 1, last_error = ?1, last_attempt_at = ?5,"
                " next_attempt_at = ?2, lease_owner = NULL, lease_until = NULL"
                " WHERE seq = ?3 AND published_at IS NULL AND lease_owner = ?4",
                [(*f, now_s) for f in failed],
            )

    def release(self, rows: Sequence[Claimed]) -> None:
        """Give up the leases of *rows* without publishing them."""
        with transaction(self.conn) as conn:
            conn.executemany(
                "UPDATE outbox SET lease_owner = NULL, lease_until = NULL WHERE seq = ? AND lease_owner = ?",
                [(row.seq, self.config.owner) for row in rows],
            )

    # -- the loop --

    def step(self) -> int:
        """One round: connect if needed; claim and send batches until
        ``depth`` are in flight; collect the oldest and mark it.

        Returns the number of rows marked (0: nothing in flight, or the
        broker is unreachable and the backoff was waited). Raises BrokerFatal
        (every lease in flight released).
        """
        from .broker import BrokerUnavailable, OutMessage

        if not self._connected:
            # Batches left by a lost connection come back at once (unconfirmed
            # or not sent); they must be settled before connecting again.
            while self._inflight:
                later, ticket = self._inflight.popleft()
                self._settle(later, self.publisher.collect(ticket))
            try:
                self.publisher.connect()
            except BrokerUnavailable as exc:
                self._outage(str(exc))
                return 0
            self._connected = True
        while len(self._inflight) < self.config.depth and not self.stopping:
            rows = self.claim()  # a busy database raises here; what is in flight stays in flight
            if not rows:
                break
            if not self.stats.batches and not self._inflight:
                self.stats.first_claim = time.perf_counter()
            crashpoint("dispatch-before-publish")
            exchange = self.config.exchange
            try:
                ticket = self.publisher.send([OutMessage(routing_key=r.routing_key, body=r.body,
                                                         exchange=exchange, message_id=r.event_id) for r in rows])
            except BaseException:
                self._abandon(rows)
                raise
            self._inflight.append((rows, ticket))
        if not self._inflight:
            return 0
        rows, ticket = self._inflight[0]
        try:
            results = self.publisher.collect(ticket)
        except BaseException:
            self._abandon([])
            raise
        self._inflight.popleft()
        crashpoint("dispatch-after-confirm")
        lost = next((r.reason for r in results if r.status == "unconfirmed"), None)
        if lost is not None:
            self._connected = False  # also if the mark below fails: the next step settles the rest
        self._settle(rows, results)
        if lost is None:
            self._failures = 0
            return len(rows)
        # The connection is gone: the batches behind this one come back at
        # once (unconfirmed, or not sent); record them, then wait it out.
        while self._inflight:
            later, ticket = self._inflight.popleft()
            self._settle(later, self.publisher.collect(ticket))
        self._outage(lost)
        return len(rows)

    def _abandon(self, rows: list[Claimed]) -> None:
        """The publisher failed for good (BrokerFatal, an interrupt): give up
        the leases of *rows* and of every batch in flight."""
        self._connected = False
        with suppress(DeliveryError):
            self.release([*rows, *(row for batch, _ in self._inflight for row in batch)])
        self._inflight.clear()

    def _settle(self, rows: list[Claimed], results: list[PublishResult]) -> None:
        self.mark(rows, results)
        self.stats.last_mark = time.perf_counter()
        self.stats.batches += 1
        self.stats.results.update(r.status for r in results)
        bad = [(row, r) for row, r in zip(rows, results, strict=True) if not r.ok]
        for row, r in bad[:3]:
            log.warning("%s not published: %s %s", row.event_id, r.status, r.reason)
        log.debug("batch of %d: %d confirmed", len(rows), len(rows) - len(bad))

    def _outage(self, why: str) -> None:
        self._failures += 1
        self.stats.outages += 1
        delay = reconnect_delay_s(self._failures)
        log.warning("%s; retrying in %.1fs (attempt %d)", why, delay, self._failures)
        self.sleep(delay)

    def _pause(self, seconds: float) -> None:
        """Wait between passes, servicing the connection's heartbeats.

        ``Publisher.idle`` returns at once when the connection is gone: then
        the rest is slept, and the next pass reconnects (never a spin).
        """
        if self._connected:
            started = time.monotonic()
            self.publisher.idle(seconds)
            left = seconds - (time.monotonic() - started)
            if left <= seconds / 10:
                return
            self._connected = False
            seconds = left
        self.sleep(seconds)

    def _nap(self, seconds: float) -> None:
        """time.sleep in slices, so that a SIGTERM during a long backoff
        stops the dispatcher at once (the handler only sets a flag)."""
        deadline = time.monotonic() + seconds
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.2))

    def run(self) -> DispatchStats:
        """Dispatch until :meth:`stop` or ``exit_when_idle_s`` without work.

        Broker outages and a busy database are waited out with backoff;
        BrokerFatal and DatabaseError propagate.
        """
        idle_since: float | None = None
        while not self.stopping or self._inflight:  # a stop still settles what is in flight
            try:
                claimed = self.step()
            except TransientError as exc:
                # The database is busy past its timeout, or the disk is full:
                # wait and try again. Rows published but not marked stay
                # leased; after the lease they go again (duplicates, no loss).
                self._db_failures += 1
                delay = reconnect_delay_s(self._db_failures)
                log.warning("%s; retrying in %.1fs", exc, delay)
                self.sleep(delay)
                continue
            self._db_failures = 0
            if claimed:
                idle_since = None
                continue
            now = self.clock()
            idle_since = now if idle_since is None else idle_since
            limit = self.config.exit_when_idle_s
            if limit is not None and now - idle_since >= limit:
                log.info("nothing to publish for %.1fs; exiting", limit)
                break
            pause = self.config.poll_s
            if limit is not None:
                pause = min(pause, max(0.01, limit - (now - idle_since)))
            self._pause(pause)
        return self.stats


def unpublished(conn: sqlite3.Connection) -> int:
    """How many rows still wait for a confirm."""
    return int(conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()[0])


# -- queries (outbox list | stats | show | prune) -----------------------------------------

Row = dict[str, Any]
STATES: Final = ("all", "unpublished", "failed", "leased", "published")

_COLUMNS = ("seq, event_id, routing_key, ordering_key, created_at, attempts, last_error, last_attempt_at,"
            " next_attempt_at, lease_owner, lease_until, published_at")


def _state(published_at: str | None, lease_until: str | None, attempts: int, now_s: str) -> str:
    if published_at is not None:
        return "published"
    if lease_until is not None and lease_until > now_s:
        return "leased"
    return "retrying" if attempts else "pending"


def _row(row: tuple[Any, ...], now_s: str) -> Row:
    keys = ("seq", "eventId", "routingKey", "orderingKey", "createdAt", "attempts", "lastError", "lastAttemptAt",
            "nextAttemptAt", "leaseOwner", "leaseUntil", "publishedAt")
    out: Row = dict(zip(keys, row, strict=True))
    out["state"] = _state(out["publishedAt"], out["leaseUntil"], out["attempts"], now_s)
    return out


def list_rows(
    conn: sqlite3.Connection, *, state: str = "all", limit: int | None = 50, now: float | None = None
) -> list[Row]:
    """Rows of the outbox. Unpublished states in creation order (the order
    they go out), ``published`` and ``all`` newest first."""
    now_s = now_iso(now)
    where, order = {
        "all": ("1", "seq DESC"),
        "unpublished": ("published_at IS NULL", "seq"),
        "failed": ("published_at IS NULL AND attempts > 0", "seq"),
        "leased": ("published_at IS NULL AND lease_until > :now", "seq"),
        "published": ("published_at IS NOT NULL", "seq DESC"),
    }[state]
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM outbox WHERE {where} ORDER BY {order} LIMIT :limit",
        {"now": now_s, "limit": limit if limit else -1},
    ).fetchall()
    return [_row(r, now_s) for r in rows]


def show(conn: sqlite3.Connection, event_id: str, *, now: float | None = None) -> Row:
    """One row with its fingerprint and body (as JSON); :class:`NotFound` otherwise."""
    row = conn.execute(f"SELECT {_COLUMNS}, fingerprint, body FROM outbox WHERE event_id = ?",
                       (event_id,)).fetchone()
    if row is None:
        raise NotFound(f"{event_id}: not in the outbox")
    out = _row(row[:-2], now_iso(now))
    out["fingerprint"] = row[-2]
    out["body"] = orjson.loads(row[-1])
    return out


def _age_s(stamp: str | None, now: float) -> float | None:
    if stamp is None:
        return None
    return round(now - datetime.fromisoformat(stamp).timestamp(), 3)


def stats(conn: sqlite3.Connection, *, now: float | None = None) -> Row:
    """Counts by state, the oldest unpublished row and the commonest errors."""
    now = time.time() if now is None else now
    now_s = now_iso(now)
    conn.execute("BEGIN DEFERRED")  # one snapshot for the three reads
    try:
        total, published, failed, leased, oldest, max_attempts, last_published = conn.execute(
            "SELECT count(*), count(published_at),"
            " coalesce(sum(published_at IS NULL AND attempts > 0), 0),"
            " coalesce(sum(published_at IS NULL AND lease_until > ?), 0),"
            " min(CASE WHEN published_at IS NULL THEN created_at END),"
            " coalesce(max(CASE WHEN published_at IS NULL THEN attempts END), 0),"
            " max(published_at) FROM outbox",
            (now_s,),
        ).fetchone()
        errors = conn.execute(
            "SELECT last_error, count(*) FROM outbox WHERE published_at IS NULL AND last_error IS NOT NULL"
            " GROUP BY last_error ORDER BY count(*) DESC, last_error LIMIT 5"
        ).fetchall()
    finally:
        _rollback(conn)
    return {
        "database": _path_of(conn),
        "rows": total,
        "published": published,
        "unpublished": total - published,
        "failed": failed,
        "leased": leased,
        "oldestUnpublishedAt": oldest,
        "oldestUnpublishedAgeSeconds": _age_s(oldest, now),
        "maxAttemptsUnpublished": max_attempts,
        "lastPublishedAt": last_published,
        "errors": {error: n for error, n in errors},
    }


def prune(conn: sqlite3.Connection, *, older_than_s: float, now: float | None = None) -> int:
    """Delete rows published more than *older_than_s* ago; returns how many.

    Unpublished rows are never deleted, whatever their age.
    """
    if older_than_s < 0:
        raise ValueError("older_than_s must be >= 0")
    cutoff = now_iso((time.time() if now is None else now) - older_than_s)
    with transaction(conn):
        cur = conn.execute(
            "DELETE FROM outbox WHERE published_at IS NOT NULL AND published_at < ?", (cutoff,)
        )
    return cur.rowcount


__all__ = [
    "MIGRATIONS",
    "STATES",
    "VERSION",
    "Claimed",
    "DispatchConfig",
    "DispatchStats",
    "Dispatcher",
    "OutboxError",
    "PublisherLike",
    "connect",
    "default_owner",
    "enqueue",
    "install",
    "installed_version",
    "list_rows",
    "prune",
    "show",
    "stats",
    "transaction",
    "unpublished",
]
