"""The one path that applies events: envelope -> transaction -> effect -> receipt -> commit.

:func:`apply_batch` is used by ``replay``, by ``run`` and by the fence. Read
in this order: :func:`apply_batch` -> :meth:`Transaction.__enter__` (BEGIN
IMMEDIATE) -> :meth:`Transaction.apply_many` (receipts read, effects run,
receipts written) -> ``before_commit`` (what goes with the batch) ->
:meth:`Transaction.__exit__` (COMMIT); only then may a delivery be acked.
For each event: a receipt with the same fingerprint -> ``duplicate:<result>``;
with another -> rejection ``event-id-reused``; none -> the effect decides.
The path drawn: docs/architecture.md; the optimistic batch: docs/hot-path.md.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from time import monotonic
from typing import Any, ClassVar, Protocol

import orjson

from ..amqp.partitions import Identity, misplaced
from ..model.contract import ApplyFn, Connection, ConsumerSpec, DeliveryCount, Outcome
from ..model.envelope import Envelope
from ..model.errors import (
    EVENT_ID_REUSED,
    UNSTORABLE_VALUE,
    WRONG_PARTITION,
    DatabaseError,
    Rejection,
    TransientError,
    safe_reason,
)
from ..model.event_types import CloudEventId
from ..store import sqlite
from ..store.dbfile import ContentTags
from ..store.sqlite import now_iso
from . import counters


class Store(Protocol):
    """What the applier needs of a consumer's database, whichever holds it: SQLite
    (:class:`~.database.ConsumerDB`, which hands out this module's :class:`Transaction`)
    or PostgreSQL (``inbox/pg.py``, whose transaction overrides the dialect's steps only)."""

    @property
    def conn(self) -> Connection:
        """The connection effects are handed (a ``sqlite3.Connection`` on SQLite)."""
        ...

    @property
    def cursor(self) -> Any:
        """A cursor of *conn* for the transaction's own statements."""
        ...

    @property
    def path(self) -> Path | str:
        """The database for messages: a file, or a URL without its password."""
        ...
    spec: ConsumerSpec
    readonly: bool
    #: The partition the database serves (None: an unpartitioned consumer).
    partition: Identity | None
    #: When the receipt counters are next caught up (``time.monotonic``).
    count_due: float
    #: Wall clock minus monotonic clock when last looked at: a change is the wall clock
    #: jumping (recorded: ``meta.clock_jump``, which prune reads).
    clock_base: float
    #: The content tags of the file's one writer (None: not watched): a new one goes
    #: into the header with each catch-up (dbfile.ContentTags).
    tags: ContentTags | None

    def transaction(self) -> Transaction:
        """One write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT`` on SQLite)."""
        ...

    def unsynced_transaction(self) -> Transaction:
        """A write transaction whose commit is not made durable at once (:class:`UnsyncedTransaction`)."""
        ...

    def check_file(self) -> None:
        """Raise when the path no longer names the file this connection writes."""
        ...


#: Called inside a batch's transaction once its outcomes are known, before
#: the commit: what a caller writes beside the batch (run counts deliveries,
#: the fence writes its own rows).
BatchHook = Callable[["Transaction", list[Outcome]], None]


def apply_batch(
    db: Store,
    items: Sequence[Envelope | Rejection],
    *,
    sources: Sequence[str | None] | None = None,
    body_digests: Sequence[str | None] | None = None,
    record_rejections: bool = True,
    before_commit: BatchHook | None = None,
    effect: ApplyFn | None = None,
) -> list[Outcome]:
    """Apply a batch in one transaction (:meth:`Transaction.apply_many`) and return outcomes.

    The one place a batch is applied (replay, run and the fence). *items*
    may contain rejections found before the store (a body that did not
    parse): they are recorded in ``rejected`` with the others, with the
    matching entry of *sources* and *body_digests* -- unless
    ``record_rejections`` is False (run records them once their dead-letter
    copy is confirmed). *before_commit* writes what goes with the batch.
    *effect* replaces the consumer's ``apply`` (and ``apply_many``) for this
    batch: the fence answers with the calls it made before the transaction.
    The outcomes are in the order of *items*; the transaction commits once.
    """
    with db.transaction() as tx:
        if effect is not None:
            tx.effect, tx.apply_many_fn = effect, None
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


def apply_event(db: Store, env: Envelope, *, source: str | None = None) -> str:
    """Apply one envelope in its own transaction (:func:`apply_batch` of one)
    and return its result.

    Raises :class:`Rejection` (already recorded in ``rejected`` and
    committed) or :class:`TransientError` (nothing committed).
    """
    (outcome,) = apply_batch(db, [env], sources=[source])
    if outcome.rejection is not None:
        raise outcome.rejection
    if outcome.transient is not None:
        raise outcome.transient
    assert outcome.result is not None
    return outcome.result


_RECEIPT_SELECT = "SELECT fingerprint, result FROM inbox WHERE event_id = ?"
_RECEIPTS_SELECT = (
    "SELECT event_id, fingerprint, result FROM inbox WHERE event_id IN (SELECT value FROM json_each(?))"
)
_RECEIPT_INSERT = (
    "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at, partition_key, meta, origin)"
    " VALUES (?, ?, ?, ?, ?, ?, NULLIF(?, ''), NULLIF(?, ''))"
)
_SOURCE_INSERT = "INSERT OR IGNORE INTO ce_sources (source, first_at) VALUES (?, ?)"
_REJECTION_INSERT = (
    "INSERT INTO rejected (code, reason, event_id, fingerprint, body_sha256, source,"
    " attempts, dead_letter, rejected_at, partition_key, origin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " RETURNING id"
)
_DELIVERY_UPSERT = (
    "INSERT INTO deliveries (key, event_id, deliveries, redeliveries, attempts, crashes,"
    " first_at, last_at, last_outcome) VALUES (?1, ?2, max(1, ?3), ?4, ?5, 0,"
    " CASE WHEN ?3 > 1 THEN coalesce((SELECT min(received_at, ?6) FROM inbox WHERE event_id = ?2), ?6)"
    " ELSE ?6 END, ?6, ?7)"
    " ON CONFLICT (key) DO UPDATE SET"
    " deliveries = max(deliveries + ?8, ?3),"
    " redeliveries = redeliveries + ?4 * ?8,"
    " attempts = max(attempts, excluded.attempts),"
    " event_id = coalesce(excluded.event_id, event_id),"
    " last_at = excluded.last_at, last_outcome = excluded.last_outcome"
    " RETURNING deliveries, attempts, crashes"
)
#: SQLite's extended result code of a value a STRICT column's type refuses
#: ("cannot store REAL value in INTEGER column"), and SQLITE_MISMATCH.
_DATATYPE_CODES = frozenset({3091, 20})


def _meta_column(env: Envelope) -> str:
    """The receipt's ``meta`` column: the envelope's ``meta`` as canonical JSON, or '' for NULL.

    Not None: the sqlite3 module binds None only after a failed adapter
    lookup (an AttributeError raised and cleared, per row); the statement's
    NULLIF turns '' (never a JSON text) into NULL instead.
    """
    meta = env.fields.get("meta")
    return "" if meta is None else _meta_json(meta)


def _meta_json(meta: object) -> str:
    """*meta* as canonical JSON."""
    return orjson.dumps(meta, option=orjson.OPT_SORT_KEYS).decode()


#: A step of the wall clock against the monotonic one larger than this is a jump (seconds).
CLOCK_STEP_S = 60.0
#: The ``meta`` key of the last jump of a writer's clock: ``<newest rowid> <seconds moved> <when>``.
CLOCK_JUMP = "clock_jump"


def _note_clock_jump(cursor: sqlite3.Cursor, moved: float, now: str) -> None:
    """Record that the wall clock jumped by *moved* seconds after the receipts written before
    this transaction (whose receipts are all stamped *now*, the jumped clock's time)."""
    before = 0
    for rowid, received_at in cursor.connection.execute("SELECT rowid, received_at FROM inbox ORDER BY rowid DESC"):
        if received_at != now:  # read from the newest down: this transaction's receipts only
            before = rowid
            break
    cursor.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                   (CLOCK_JUMP, f"{before} {moved:.0f} {now}"))


class _Fallback(Exception):
    """The optimistic batch met a failing event: apply it event by event.

    *env* and *outcome*: the event whose effect failed and how, when known.
    """

    def __init__(self, env: Envelope | None = None, outcome: Outcome | None = None) -> None:
        super().__init__()
        self.env = env
        self.outcome = outcome


def duplicate(receipt: tuple[str, str], env: Envelope) -> str:
    """The answer to an event whose eventId has a receipt (fingerprint, result):
    ``duplicate:<result>``, or rejection ``event-id-reused`` for another body.
    A fingerprint an earlier release gave the same event is the same body."""
    stored = receipt[0]
    if stored == env.fingerprint or stored in env.earlier_fingerprints:
        return "duplicate:" + str(receipt[1])
    raise Rejection(
        EVENT_ID_REUSED,
        f"eventId was first received with fingerprint {stored[:12]}…, this body differs",
        event_id=env.event_id,
        fingerprint=env.fingerprint,
        key=env.key,
        origin=env.cloudevent,
    )


def about(rejection: Rejection, env: Envelope) -> Rejection:
    """*rejection* of *env* with what the store knows of the event filled in
    where its raiser left it out (a consumer's own ``Rejection("code", "why")``):
    eventId, fingerprint, key and the CloudEvent's source and id."""
    if rejection.event_id is None:
        rejection.event_id = env.event_id
    if rejection.fingerprint is None:
        rejection.fingerprint = env.fingerprint
    if rejection.key is None:
        rejection.key = env.key
    if rejection.origin is None:
        rejection.origin = env.cloudevent
    return rejection


def unstorable(exc: BaseException) -> bool:
    """Whether *exc*, raised while an effect stored an event, says that a value
    of the event cannot be stored, ever: an integer past SQLite's 64 bits, a
    value its STRICT column's type refuses, a string or blob over SQLite's
    limit. The same bytes fail the same way every time. (A busy, full,
    read-only or failing database is the environment's: never this.)"""
    if isinstance(exc, OverflowError | sqlite3.DataError):
        return True
    return isinstance(exc, sqlite3.IntegrityError) and getattr(exc, "sqlite_errorcode", None) in _DATATYPE_CODES


def _raise_if_whole_transaction(exc: Exception) -> None:
    """Raise *exc* again when it is a sqlite3 error raised by an event's
    statements that concerns the whole transaction (busy, disk full, I/O...),
    not the event (a constraint or a value of the event's own). The one
    place the appliers sort an event's failures from the database's."""
    if isinstance(exc, sqlite3.Error) and not isinstance(exc, sqlite3.IntegrityError | sqlite3.DataError):
        raise exc


class Transaction:
    """The write transaction of a :meth:`ConsumerDB.transaction` block.

    A plain class rather than a ``@contextmanager`` generator: at
    ``--batch 1`` it is entered once per event, and the generator machinery
    showed in the profile (bench/bench_replay.py).
    """

    __slots__ = ("_cursor", "_known", "apply_many_fn", "conn", "db", "effect", "now", "spec")
    #: Whether a commit checks that the file is still the database (ConsumerDB.check_file).
    CHECKS_FILE: ClassVar[bool] = True
    #: The store's own statements, in the backend's SQL (``?`` parameters on both):
    #: a backend's transaction gives its own where its dialect differs.
    RECEIPT_SELECT: ClassVar[str] = _RECEIPT_SELECT
    RECEIPTS_SELECT: ClassVar[str] = _RECEIPTS_SELECT
    RECEIPT_INSERT: ClassVar[str] = _RECEIPT_INSERT
    SOURCE_INSERT: ClassVar[str] = _SOURCE_INSERT
    REJECTION_INSERT: ClassVar[str] = _REJECTION_INSERT
    DELIVERY_UPSERT: ClassVar[str] = _DELIVERY_UPSERT

    def __init__(self, db: Store, now: str = ""):
        self.db = db
        #: The connection of the store (sqlite3 on SQLite: its own statements rely on it).
        self.conn: Any = db.conn
        self._cursor = db.cursor
        self.spec = db.spec
        self.now = now
        #: The effect of one event (the consumer's ``apply`` unless a caller of
        #: :func:`apply_batch` brings its own) and of several, if any.
        self.effect: ApplyFn = db.spec.apply
        self.apply_many_fn = db.spec.apply_many
        #: Receipts read ahead by :meth:`prefetch` (eventId -> (fingerprint, result)).
        self._known: dict[str, tuple[str, str]] | None = None

    def __enter__(self) -> Transaction:
        try:
            self._cursor.execute("BEGIN IMMEDIATE")
            self.now = now_iso()
        except sqlite3.Error as exc:
            sqlite.rollback(self.conn)
            raise sqlite.translate(exc, self.db.path) from None
        except BaseException:
            sqlite.rollback(self.conn)
            raise
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                db = self.db
                if monotonic() >= db.count_due:  # the receipt counters, at most every CATCH_UP_S
                    counters.catch_up(self.conn)
                    db.count_due = monotonic() + counters.CATCH_UP_S
                    if db.tags is not None:
                        self._cursor.execute(f"PRAGMA application_id = {db.tags.next()}")
                    moved = time.time() - monotonic() - db.clock_base
                    if abs(moved) > CLOCK_STEP_S:
                        _note_clock_jump(self._cursor, moved, self.now)
                        db.clock_base += moved
                self._cursor.execute("COMMIT")
            except sqlite3.Error as error:
                exc = error
            except BaseException:
                sqlite.rollback(self.conn)
                raise
            else:
                # Only now may the batch be acknowledged or reported: not if the
                # file it went to is no longer the database (deleted, replaced).
                if self.CHECKS_FILE:
                    self.db.check_file()
                return
        sqlite.rollback(self.conn)
        if isinstance(exc, sqlite3.Error):
            raise sqlite.translate(exc, self.db.path) from None
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
            return Outcome(env.event_id, rejection=about(exc, env))
        if isinstance(exc, TransientError):
            return Outcome(env.event_id, transient=exc)
        # A bug in an effect: retried, then dead-lettered. A constraint
        # failing on the event's own writes (IntegrityError) aborted only that
        # statement: it is this event's bug. Other sqlite3 errors (busy, disk
        # full, I/O) concern the transaction.
        self._raise_if_whole(exc)
        if self._unstorable(exc):  # retrying the same bytes cannot help
            return Outcome(env.event_id, rejection=Rejection(
                UNSTORABLE_VALUE, f"{self.spec.name} cannot store a value of this event: {exc}",
                event_id=env.event_id, fingerprint=env.fingerprint, key=env.key, origin=env.cloudevent))
        reason = f"{type(exc).__name__} in {self.spec.name} effect: {exc}"
        return Outcome(env.event_id, transient=TransientError(reason, code="handler-error"))

    # -- what a backend's transaction words in its own way --

    @staticmethod
    def _raise_if_whole(exc: Exception) -> None:
        """Raise *exc* again when it concerns the whole transaction, not the event."""
        _raise_if_whole_transaction(exc)

    @staticmethod
    def _unstorable(exc: BaseException) -> bool:
        """Whether a value of the event can never be stored (:func:`unstorable`)."""
        return unstorable(exc)

    def _receipts_failed(self, exc: Exception) -> _Fallback:
        """The optimistic batch's receipt writes raised *exc* (an effect's bad
        result, such as None): go event by event, where the per-event path says
        whose it is. Raises *exc* itself when it concerns the whole transaction."""
        self._raise_if_whole(exc)
        return _Fallback()

    def _write_receipts(self, rows: list[tuple[Any, ...]]) -> None:
        """The optimistic batch's receipts (RECEIPT_INSERT's parameters, a row each), in one call."""
        self.conn.executemany(self.RECEIPT_INSERT, rows)

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
        ``tests/inbox/test_batch_apply.py`` checks. Parse rejections in *items*
        become rejection outcomes; recording them is the caller's.
        """
        try:
            if len(items) == 1 and not isinstance(items[0], Rejection):
                return [self._optimistic_one(items[0])]
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
            row = conn.execute(self.RECEIPT_SELECT, (envs[0].event_id,)).fetchone()
            known = {} if row is None else {envs[0].event_id: row}
        else:
            ids = orjson.dumps([env.event_id for env in envs]).decode()
            known = {row[0]: row[1:] for row in conn.execute(self.RECEIPTS_SELECT, (ids,))}
        # Each item is answered now (a receipt, a parse rejection) or by the
        # effect: index of its fresh event, the first with its eventId.
        outcomes: list[Outcome | int] = []
        fresh: list[Envelope] = []
        first: dict[str, int] = {}
        for item in items:
            if isinstance(item, Rejection):
                outcomes.append(Outcome(item.event_id, rejection=item))
                continue
            event_id = item.event_id  # read once: a field of a NamedTuple is not a cheap read
            row = known.get(event_id)
            if row is not None:
                try:
                    outcomes.append(Outcome(event_id, result=duplicate(row, item)))
                except Rejection as rej:
                    outcomes.append(Outcome(event_id, rejection=rej))
                continue
            index = first.get(event_id)
            if index is None:
                first[event_id] = len(fresh)
                outcomes.append(len(fresh))
                fresh.append(item)
            elif fresh[index].fingerprint == item.fingerprint:
                outcomes.append(~index)  # a duplicate of a fresh event of this batch
            else:
                raise _Fallback  # event-id-reused within the batch: rare, let the per-event path say it
        if not fresh:
            return outcomes  # type: ignore[return-value]
        part = self.db.partition
        if part is not None and any(misplaced(env.key, part) for env in fresh):
            raise _Fallback  # the per-event path rejects the misplaced event alone
        apply_many, effect, now = self.apply_many_fn, self.effect, self.now
        try:
            if apply_many is not None:
                results = apply_many(conn, fresh)
            else:
                results = []
                for env in fresh:
                    try:
                        results.append(effect(conn, env))
                    except Exception as exc:
                        raise _Fallback(env, self._failure(env, exc)) from None
            # Inside the try: an effect's bad result (None) fails here, as
            # the per-event path's receipt INSERT does.
            # _meta_column and the origin's JSON, inline: no call per event.
            self._write_receipts([
                (env.event_id, env.fingerprint, result, env.type, now, env.key,
                 "" if (meta := env.fields.get("meta")) is None else _meta_json(meta),
                 "" if (ce := env.cloudevent) is None else ce.to_json())
                for env, result in zip(fresh, results, strict=True)
            ])
        except _Fallback:
            raise
        except Exception as exc:
            raise self._receipts_failed(exc) from None
        sources = {ce.source for env in fresh if (ce := env.cloudevent) is not None}
        if sources:
            conn.executemany(self.SOURCE_INSERT, [(source, now) for source in sources])
        # Outcome's arguments by position: called by keyword from C
        # (type.__call__), its __init__ takes the slower path that matches names.
        fresh_ids = [env.event_id for env in fresh]
        return [
            o if isinstance(o, Outcome)
            else Outcome(fresh_ids[o], results[o]) if o >= 0
            else Outcome(fresh_ids[~o], "duplicate:" + results[~o])
            for o in outcomes
        ]

    def _optimistic_one(self, env: Envelope) -> Outcome:
        """:meth:`_optimistic` for a batch of one envelope (every batch of
        ``--batch 1``): the same answers and writes, in fewer steps. The
        effect is the consumer's ``apply``, which answers one event as its
        ``apply_many`` would."""
        cursor = self._cursor
        event_id = env.event_id
        row = cursor.execute(self.RECEIPT_SELECT, (event_id,)).fetchone()
        if row is not None:
            try:
                return Outcome(event_id, result=duplicate(row, env))
            except Rejection as rej:
                return Outcome(event_id, rejection=rej)
        part = self.db.partition
        if part is not None and misplaced(env.key, part):
            raise _Fallback  # the per-event path words the rejection
        try:
            result = self.effect(self.conn, env)
        except Exception as exc:
            raise _Fallback(env, self._failure(env, exc)) from None
        ce = env.cloudevent
        try:
            cursor.execute(self.RECEIPT_INSERT, (event_id, env.fingerprint, result, env.type, self.now, env.key,
                                           _meta_column(env), "" if ce is None else ce.to_json()))
        except Exception as exc:  # an effect's bad result (None) fails here, as in the per-event path
            raise self._receipts_failed(exc) from None
        if ce is not None:
            cursor.execute(self.SOURCE_INSERT, (ce.source, self.now))
        return Outcome(event_id, result=result)

    def _restart(self) -> None:
        """Roll the transaction back and begin it again (same receipt time)."""
        try:
            self.conn.execute("ROLLBACK")
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise sqlite.translate(exc, self.db.path) from None
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
            for event_id, fingerprint, result in self.conn.execute(self.RECEIPTS_SELECT, (ids,))
        }

    def _apply(self, env: Envelope) -> str:
        conn = self.conn
        known = self._known
        if known is None:
            row = conn.execute(self.RECEIPT_SELECT, (env.event_id,)).fetchone()
        else:
            row = known.get(env.event_id)
        if row is not None:
            return duplicate(row, env)
        part = self.db.partition
        if part is not None and (why := misplaced(env.key, part, env.key_field)):
            raise Rejection(WRONG_PARTITION, why, event_id=env.event_id, fingerprint=env.fingerprint, key=env.key,
                            origin=env.cloudevent)
        result = self.effect(conn, env)
        ce = env.cloudevent
        conn.execute(self.RECEIPT_INSERT, (env.event_id, env.fingerprint, result, env.type, self.now, env.key,
                                       _meta_column(env), "" if ce is None else ce.to_json()))
        if ce is not None:
            conn.execute(self.SOURCE_INSERT, (ce.source, self.now))
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
        """Write one row to ``rejected``; returns its id. A CloudEvent's source
        is listed in ``ce_sources`` too, so that trace finds it by its id."""
        origin = rejection.origin
        row = self.conn.execute(
            self.REJECTION_INSERT,
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
                rejection.key,
                None if origin is None else CloudEventId(*origin).to_json(),
            ),
        ).fetchone()
        if origin is not None:
            self.conn.execute(self.SOURCE_INSERT, (origin[0], self.now))
        return int(row[0])

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
        A first row that counts earlier deliveries (a hint above 1: ``run``
        writes no row for a first delivery applied fresh) starts at the
        receipt's time, that first delivery's, when there is one.
        """
        row = self.conn.execute(
            self.DELIVERY_UPSERT,
            (key, event_id, delivered_hint, int(redelivered), attempt, self.now, outcome, int(count)),
        ).fetchone()
        return DeliveryCount(int(row[0]), int(row[1]), int(row[2]))



def receipt(conn: Any, event_id: str) -> tuple[str, str] | None:
    """The receipt of *event_id*: (fingerprint, result); None when it has none."""
    row = conn.execute(_RECEIPT_SELECT, (event_id,)).fetchone()
    return None if row is None else (str(row[0]), str(row[1]))


def receipt_of(tx: Transaction, env: Envelope) -> str | None:
    """``duplicate:<result>`` when *env* has a receipt, None when it has none.

    Raises :class:`Rejection` ``event-id-reused`` when the receipt is of
    another body (the same check as :meth:`Transaction.apply`).
    """
    row = receipt(tx.conn, env.event_id)
    return None if row is None else duplicate(row, env)


def has_receipt(db: Store, event_id: str) -> bool:
    """Whether *event_id* has a receipt (read outside any transaction)."""
    return receipt(db.conn, event_id) is not None


class UnsyncedTransaction(Transaction):
    """A write transaction whose COMMIT is not synced (``synchronous=NORMAL``
    for this transaction only; the connection goes back to FULL after it).

    Only for a transaction that nothing is acknowledged on. It survives a
    crash of the process like any commit (the WAL is in the OS's cache), and
    the next ordinary commit makes it durable too: that commit syncs the WAL
    file, which holds this transaction's frames before its own
    (https://sqlite.org/wal.html, https://sqlite.org/pragma.html#pragma_synchronous).
    Only a power loss before that next commit can lose it. The fence's claim
    uses it (docs/fence.md says why that loss is harmless there).
    """

    __slots__ = ()
    # Nothing is acknowledged on it: the next synced commit checks the file.
    CHECKS_FILE = False

    def __enter__(self) -> Transaction:
        try:
            self.conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            raise sqlite.translate(exc, self.db.path) from None
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
            self.conn.execute("PRAGMA synchronous = FULL")  # what every writable connection uses (sqlite.connect)
        except sqlite3.Error as exc:
            # Left at NORMAL, later commits could be acknowledged without being durable.
            raise DatabaseError(f"{self.db.path}: cannot restore PRAGMA synchronous: {exc}") from None


def unsynced_transaction(db: Store) -> Transaction:
    """``with unsynced_transaction(db) as tx:`` -- see :class:`UnsyncedTransaction`
    (the store's own kind: :meth:`Store.unsynced_transaction`)."""
    return db.unsynced_transaction()


__all__ = [
    "BatchHook",
    "Store",
    "Transaction",
    "UnsyncedTransaction",
    "about",
    "apply_batch",
    "apply_event",
    "duplicate",
    "has_receipt",
    "receipt",
    "receipt_of",
    "unstorable",
    "unsynced_transaction",
]
