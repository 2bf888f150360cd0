"""Fence an effect outside the database: claim a stable key, call, complete.

For a consumer whose effect is a call to another system (the webhook): (1)
claim ``<key>:<revision>:<step>`` (the event's key: an ``articleId``, ...) in
a transaction of its own, (2) call outside any transaction with that key as the idempotency key, (3)
complete through the one applier (:func:`inbox.apply_batch`), whose effect
is the call's answer. Why this is exactly-once, and what a redelivery does
in each state: docs/fence.md. Also here: the fence table's rows for
``fence list|show|resolve`` and ``trace``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from ..amqp.partitions import delivery_outcome, forwarded_to, misplaced
from ..model.contract import Connection, DeliveryMark, Outcome, WorkHooks, dialect
from ..model.envelope import Envelope
from ..model.errors import OUTCOME_UNKNOWN, REVISION_CONFLICT, FenceError, Rejection, StoreUnavailable, TransientError
from ..model.faults import crashpoint
from ..observability import tracing
from ..store.sqlite import now_iso
from .apply import Store, Transaction, apply_batch, duplicate, receipt_of, unsynced_transaction
from .in_flight import InFlight

if TYPE_CHECKING:
    from .database import ConsumerDB
    from .pg import PgInboxDB

log = logging.getLogger("delivery_consumer.fence")

#: The fence table as it was first written (the entity's key in ``article_id``).
MIGRATION = """
CREATE TABLE fence (
    article_id     TEXT NOT NULL,
    step           TEXT NOT NULL,
    revision       INTEGER NOT NULL,
    key            TEXT NOT NULL,
    event_id       TEXT NOT NULL,
    payload_sha256 TEXT NOT NULL,
    state          TEXT NOT NULL CHECK (state IN ('claimed', 'done', 'stale')),
    calls          INTEGER NOT NULL DEFAULT 0,
    in_doubt       INTEGER NOT NULL DEFAULT 0 CHECK (in_doubt IN (0, 1)),
    provider_id    TEXT,
    http_status    INTEGER,
    last_error     TEXT,
    claimed_at     TEXT NOT NULL,
    called_at      TEXT,
    done_at        TEXT,
    PRIMARY KEY (article_id, step, revision)
) STRICT, WITHOUT ROWID;
CREATE INDEX fence_event ON fence (event_id);
"""
#: The entity's key is any type's key (``articleId``, ``orderId``, ...): its
#: column is named for that. A database the first form made is renamed in place.
RENAME_KEY = "ALTER TABLE fence RENAME COLUMN article_id TO entity_key;"
#: The fence's migrations, in order; a consumer with an external effect puts
#: them in its ``migrations`` (see consumers/webhook.py).
MIGRATIONS = (MIGRATION, RENAME_KEY)
#: The key is ``<entity key>:<revision>:<step>``, one-to-one with the primary
#: key, which orders an entity's revisions (the stale check is one probe).
#: Two b-trees in all: each claim writes as few pages as it can.
_BY_KEY = "entity_key = ? AND step = ? AND revision = ?"

STATES = ("claimed", "done", "stale")
_NO_HOOKS = WorkHooks()
#: How often the completing transaction is tried at once before the database
#: is waited for (WorkHooks.wait_for_store); if that gives up, the answers are
#: lost: the keys stay claimed (docs/fence.md).
COMPLETE_TRIES = 3


def fence_key(entity_key: str, revision: int, step: str) -> str:
    """The stable key of a business step: never a random id."""
    return f"{entity_key}:{revision}:{step}"


def key_parts(key: str) -> tuple[str, str, int] | None:
    """(entity key, step, revision) of a key, as the primary key orders them; None if malformed."""
    parts = key.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or str(int(parts[1])) != parts[1]:
        return None
    return parts[0], parts[2], int(parts[1])


# -- the external step -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One call to make: the fence key (the idempotency key) and the body."""

    key: str
    payload: bytes
    env: Envelope


@dataclass(frozen=True, slots=True)
class CallResult:
    """What a call came back with; a call never raises for the endpoint's failures."""

    provider_id: str | None = None
    status: int | None = None
    #: None: the effect happened. A Rejection: refused for good. A TransientError: try later.
    failure: Rejection | TransientError | None = None
    #: The call may have had its effect although it failed (a timeout, a cut connection).
    ambiguous: bool = False
    #: The endpoint as a whole is failing (down, throttling): no more calls in this batch.
    stop: bool = False


class ExternalStep(Protocol):
    """The effect the fence guards (consumers/webhook.py is one)."""

    #: The step's name, the last part of the key (``notify``).
    name: str
    #: Whether calling twice with one key has one effect (then a call in doubt is repeated).
    idempotent: bool
    #: The receipt of a completed step (``notified``).
    result: str

    def payload(self, env: Envelope) -> bytes:
        """The request body of *env* (deterministic: its hash is kept in the fence)."""
        ...

    def call(self, call: Call) -> CallResult:
        """Make the call; never raises for the endpoint's failures."""
        ...


# -- the serial lock ---------------------------------------------------------------


class _Serial(Protocol):
    """The lock the three steps of a batch run under (docs/fence.md, "One batch at a time")."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...

    def held(self) -> bool:
        """Whether the lock is still this process's (False: lost with the database's connection)."""
        ...

    def committed(self) -> None:
        """Make what was committed without waiting (the claim, a note) committed before a call."""
        ...


class _FileSerial:
    """SQLite: one process at a time on the database file (:meth:`ConsumerDB.serial`, an OFD lock
    held for as long as the process lives); every commit is made when its transaction ends."""

    __slots__ = ("_db",)

    def __init__(self, db: ConsumerDB) -> None:
        self._db = db

    def __enter__(self) -> _FileSerial:
        self._db.serial().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._db.serial().__exit__(*exc)

    def held(self) -> bool:
        return True

    def committed(self) -> None:
        pass


def serial_lock(db: Store, parsed: Sequence[Envelope | Rejection], step_name: str) -> _Serial:
    """The lock of a batch: the file on SQLite; on PostgreSQL, where several runs share the inbox,
    an advisory lock per entity (``<entity key>:<step>``) of the batch (:mod:`.pg_fence`)."""
    if dialect(db.conn) == "postgres":
        from .pg_fence import AdvisorySerial

        names = [f"{item.key}:{step_name}" for item in parsed if isinstance(item, Envelope)]
        return AdvisorySerial(cast("PgInboxDB", db), names)
    return _FileSerial(cast("ConsumerDB", db))


# -- the protocol ------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Plan:
    """A claimed key of the batch and what the call needs."""

    index: int
    env: Envelope
    key: str
    where: tuple[str, str, int]  # the primary key: article, step, revision
    payload: bytes
    sha: str
    prior: tuple[int, int] = (0, 0)  # calls, in_doubt before this batch
    marked: bool = False  # calls/in_doubt were raised in the claim transaction
    leader: _Plan | None = None  # another delivery of this batch with the same key
    result: CallResult | None = None
    not_called: TransientError | None = None  # skipped: the endpoint failed on an earlier key
    recheck: bool = False  # another process marked the key first: read it again


#: What the claim found for one event: its result, its failure, or the call to make.
_Answer = str | Rejection | TransientError | _Plan


def apply_fenced(
    db: Store, parsed: Sequence[Envelope | Rejection], marks: Sequence[DeliveryMark], step: ExternalStep,
    hooks: WorkHooks = _NO_HOOKS,
) -> list[Outcome]:
    """Apply a batch with the fence protocol; one Outcome per delivery, in order.

    (1) claim, (2) call, (3) complete through :func:`inbox.apply_batch`, whose
    effect is the answer of the call (docs/fence.md). Deliveries are counted
    in ``deliveries`` with their outcome when the batch completes. With
    ``hooks.in_flight``, the delivery being called is noted alone while its
    call is under way (a crash there is its crash, not the batch's), and the
    completing transaction clears the note. Raises StoreUnavailable when the
    database as a whole failed before any call (the caller retries the
    batch); once calls were made, their answers are kept and the completion
    waits for the database (``hooks.wait_for_store``). The three steps run under
    :func:`serial_lock` (one process at a time on a SQLite file; on PostgreSQL,
    one per entity of the batch): two processes that reach one database never
    call one key twice, nor an older revision after a newer one.
    """
    with serial_lock(db, parsed, step.name) as lock:
        return _apply_fenced(db, parsed, marks, step, hooks, lock)


def _apply_fenced(
    db: Store, parsed: Sequence[Envelope | Rejection], marks: Sequence[DeliveryMark], step: ExternalStep,
    hooks: WorkHooks, lock: _Serial,
) -> list[Outcome]:
    answers = _claim_all(db, parsed, step)
    plans = [answer for answer in answers.values() if isinstance(answer, _Plan)]
    plans.sort(key=lambda plan: plan.index)
    if plans:
        crashpoint("webhook-after-claim")
        _call_all(db, [p for p in plans if p.leader is None], step, hooks, [m.key for m in marks], lock)
    completion = _Completion(parsed, answers, plans, marks, step, hooks)
    attempt = 0
    while True:  # (3) complete; always: its sync makes (1) durable
        try:
            return apply_batch(db, parsed, record_rejections=False, effect=completion.effect,
                               before_commit=completion.before_commit)
        except StoreUnavailable as exc:
            attempt += 1
            if attempt < COMPLETE_TRIES:
                time.sleep(0.05 * attempt)
                continue
            try:
                hooks.wait_for_store(exc)  # the answers stay in hand meanwhile
            except BaseException:
                log.error("the answers of %d calls could not be committed (%s); their keys stay claimed",
                          len(plans), exc)
                raise


def _claim_all(db: Store, parsed: Sequence[Envelope | Rejection], step: ExternalStep) -> dict[int, _Answer]:
    """Step (1): claim the batch's keys in one transaction, not synced (docs/fence.md
    says why that is safe). The answers are keyed by ``id()`` of the parsed
    envelope, which is what the completion's effect receives; an event the
    applier answers by itself (a parse rejection, a receipt, a misplaced
    article) has none."""
    answers: dict[int, _Answer] = {}
    part = db.partition
    with unsynced_transaction(db) as tx:
        leaders: dict[str, _Plan] = {}
        claimed: dict[str, str] = {}  # eventId -> fingerprint of the events this batch claimed
        for i, item in enumerate(parsed):
            if isinstance(item, Rejection) or id(item) in answers:
                continue
            if part is not None and misplaced(item.key, part):
                continue
            try:
                answer = _claim(tx, i, item, step, leaders, claimed)
            except Rejection as rej:
                answer = rej
            if answer is not None:
                answers[id(item)] = answer
    return answers


def _claim(
    tx: Transaction, index: int, env: Envelope, step: ExternalStep, leaders: dict[str, _Plan],
    claimed: dict[str, str],
) -> _Answer | None:
    """Step (1) for one event: its answer (a result, a failure, or the call to make),
    None when its receipt answers it."""
    conn = tx.conn
    if receipt_of(tx, env) is not None:
        return None
    first = claimed.get(env.event_id)
    if first is not None and first != env.fingerprint:
        # This eventId was claimed earlier in the batch with another body: the
        # same answer as when its receipt exists (whatever the batch size).
        duplicate((first, ""), env)
    claimed.setdefault(env.event_id, env.fingerprint)
    key = fence_key(env.key, env.revision, step.name)
    where = (env.key, step.name, env.revision)
    payload = step.payload(env)
    sha = hashlib.sha256(payload).hexdigest()
    leader = leaders.get(key)
    if leader is not None:  # the same key earlier in this batch: follow its call
        if leader.sha != sha:
            raise _conflict(env, key)
        return _Plan(index, env, key, where, payload, sha, leader=leader)
    # One probe of the primary key finds this key's row and any newer revision.
    rows = conn.execute(
        "SELECT revision, state, payload_sha256, event_id, calls, in_doubt FROM fence"
        " WHERE entity_key = ? AND step = ? AND revision >= ?",
        (env.key, step.name, env.revision),
    ).fetchall()
    row = next((r for r in rows if r[0] == env.revision), None)
    if row is not None and row[2] != sha:
        raise _conflict(env, key)
    if row is not None and row[1] == "done":
        return step.result if row[3] == env.event_id else f"already-{step.result}"
    newer = max((r[0] for r in rows if r[0] > env.revision and r[1] != "stale"), default=None)
    if newer is not None:
        if row is not None:
            conn.execute(f"UPDATE fence SET state = 'stale', last_error = ? WHERE {_BY_KEY}",
                         (f"revision {newer} was claimed first", *where))
        return "stale"
    # Calling an idempotent endpoint again is harmless, so the mark before the
    # call (calls + 1, in doubt) is batched here; for a non-idempotent one it
    # is a commit of its own just before each call (_mark_call).
    mark = 1 if step.idempotent else 0
    if row is None:
        conn.execute(
            "INSERT INTO fence (key, step, entity_key, revision, event_id, payload_sha256, state, calls, in_doubt,"
            " claimed_at, called_at) VALUES (?, ?, ?, ?, ?, ?, 'claimed', ?, ?, ?, ?)",
            (key, step.name, env.key, env.revision, env.event_id, sha, mark, mark, tx.now,
             tx.now if mark else None),
        )
        prior = (0, 0)
    else:
        prior = (int(row[4]), int(row[5]))
        if prior[1] and not step.idempotent:
            raise _unknown(env, key, "an earlier call may have had its effect")
        if mark:
            conn.execute(f"UPDATE fence SET calls = calls + 1, in_doubt = 1, called_at = ? WHERE {_BY_KEY}",
                         (tx.now, *where))
    plan = _Plan(index, env, key, where, payload, sha, prior=prior, marked=bool(mark))
    leaders[key] = plan
    return plan


def _call_all(db: Store, plans: list[_Plan], step: ExternalStep, hooks: WorkHooks,
              delivery_keys: Sequence[str], lock: _Serial) -> None:
    """Step (2): call each key in turn; after a failure of the endpoint as a
    whole (down, throttling) the rest are not called (no retry storm), nor
    once the process is stopping for good (``hooks.abandoned``), nor once the
    serial lock was lost with the database's connection (PostgreSQL)."""
    stopped: TransientError | None = None
    noted = False
    # A batch of one delivery (or of copies of one) is noted alone already.
    note = hooks.in_flight if len(set(delivery_keys)) > 1 else None
    for plan in plans:
        if stopped is None and hooks.abandoned():
            stopped = TransientError("the process is stopping", code="stopping")
        if stopped is not None:
            plan.not_called = TransientError(
                f"not called: {stopped.code} on an earlier call of the batch", code=stopped.code,
                retry_after_s=stopped.retry_after_s,
            )
            continue
        # Only the delivery being called is under way now (InFlight): a crash
        # during the call is its crash, not the whole batch's.
        delivery = delivery_keys[plan.index]
        if not step.idempotent:
            if not _until_stored(hooks, partial(_mark_call, db, plan.where, note, delivery)):
                plan.recheck = True
                continue
        elif note is not None:
            _until_stored(hooks, partial(note.mark, [delivery]))
        noted = note is not None
        _until_stored(hooks, lock.committed)  # the claim and the marks are committed before the call
        if not lock.held():
            # Another run may hold the key now: not called by this one (a mark made on the new
            # connection is undone at the completion: the call was never made).
            stopped = TransientError("the connection to the database was lost, and the fence's lock with it",
                                     code="database-unavailable")
            plan.marked = True
            plan.not_called = TransientError(f"not called: {stopped.reason}", code=stopped.code)
            continue
        with tracing.external_call(step.name, plan.key, plan.env) as traced:
            plan.result = step.call(Call(plan.key, plan.payload, plan.env))
            traced(plan.result)
        crashpoint("webhook-after-call")
        failure = plan.result.failure
        if plan.result.stop and isinstance(failure, TransientError):
            stopped = failure
    if noted and note is not None:
        # The whole batch is under way again until the completion commits.
        with suppress(StoreUnavailable):
            note.mark(delivery_keys)


_T = TypeVar("_T")


def _until_stored(hooks: WorkHooks, write: Callable[[], _T]) -> _T:
    """*write*, tried again while the database as a whole fails and
    ``hooks.wait_for_store`` says it is worth waiting."""
    while True:
        try:
            return write()
        except StoreUnavailable as exc:
            hooks.wait_for_store(exc)


def _mark_call(db: Store, where: tuple[str, str, int], in_flight: InFlight | None = None,
               delivery: str = "") -> bool:
    """Record, durably, that a call with this key is about to be made (and
    note its delivery as under way); False when it is no longer ours to call
    (another process marked or finished it)."""
    with db.transaction() as tx:
        cur = tx.conn.execute(
            "UPDATE fence SET calls = calls + 1, in_doubt = 1, called_at = ?"
            f" WHERE {_BY_KEY} AND state = 'claimed' AND in_doubt = 0",
            (tx.now, *where),
        )
        if cur.rowcount == 1 and in_flight is not None:
            in_flight.mark_in(tx, [delivery])
        return bool(cur.rowcount == 1)


class _Completion:
    """Step (3)'s hooks for :func:`inbox.apply_batch`: the effect answers each
    event with what (1) and (2) found; before the commit, the fence rows take
    the calls' results, the deliveries are counted and the note is cleared."""

    def __init__(self, parsed: Sequence[Envelope | Rejection], answers: dict[int, _Answer], plans: list[_Plan],
                 marks: Sequence[DeliveryMark], step: ExternalStep, hooks: WorkHooks) -> None:
        self.parsed = parsed
        self.answers = answers
        self.plans = plans
        self.marks = marks
        self.step = step
        self.hooks = hooks

    def effect(self, conn: Connection, env: Envelope) -> str:
        """The result of *env*'s step, or its failure raised (the applier rolls its
        savepoint back; the fence rows are written in :meth:`before_commit`)."""
        answer = self.answers.get(id(env))
        if answer is None:  # claimed by no one (cannot happen): try again later
            raise TransientError("the event was not claimed", code="not-claimed")
        if isinstance(answer, str):
            return answer
        if not isinstance(answer, _Plan):
            raise answer
        verdict = self._verdict(conn, answer.leader or answer)
        if answer.leader is None:
            if isinstance(verdict, str):
                return verdict
            raise verdict
        # Another delivery of the batch with the same key made the call.
        if isinstance(verdict, str):
            return f"already-{self.step.result}"
        if isinstance(verdict, Rejection):
            raise Rejection(verdict.code, verdict.reason, event_id=env.event_id, fingerprint=env.fingerprint)
        raise verdict

    def _verdict(self, conn: Connection, plan: _Plan) -> str | Rejection | TransientError:
        """What the call of *plan*'s key comes to: the step's result or its failure."""
        env, step = plan.env, self.step
        if plan.not_called is not None:
            return plan.not_called
        result = plan.result
        if plan.recheck or result is None:
            state = conn.execute(f"SELECT state FROM fence WHERE {_BY_KEY}", plan.where).fetchone()
            if state is not None and state[0] == "done":
                return step.result
            return _unknown(env, plan.key, "another process called with this key")
        failure = result.failure
        if failure is None:
            return step.result
        if isinstance(failure, TransientError) and result.ambiguous and not step.idempotent:
            return _unknown(env, plan.key, failure.reason)
        return failure

    def before_commit(self, tx: Transaction, outcomes: list[Outcome]) -> None:
        conn = tx.conn
        for plan in self.plans:
            if plan.leader is not None:
                continue
            result = plan.result
            if plan.not_called is not None:
                if plan.marked:  # the call was never made: undo its mark
                    conn.execute(f"UPDATE fence SET calls = ?, in_doubt = ? WHERE {_BY_KEY}",
                                 (*plan.prior, *plan.where))
            elif plan.recheck or result is None:
                pass  # another process owns the key's row
            elif result.failure is None:
                conn.execute(
                    "UPDATE fence SET state = 'done', provider_id = ?, http_status = ?, in_doubt = 0,"
                    f" last_error = NULL, done_at = ? WHERE {_BY_KEY}",
                    (result.provider_id, result.status, tx.now, *plan.where),
                )
            else:
                failure = result.failure
                conn.execute(
                    f"UPDATE fence SET http_status = ?, last_error = ?, in_doubt = ? WHERE {_BY_KEY}",
                    (result.status, f"{failure.code}: {failure.reason}", int(result.ambiguous), *plan.where),
                )
        # Deliveries answered without a call first, then the called ones, in order.
        called = [isinstance(self.answers.get(id(item)), _Plan) for item in self.parsed]
        order = [i for i, c in enumerate(called) if not c] + [i for i, c in enumerate(called) if c]
        for i in order:  # an event of another partition: run forwards it (partitions.forwarded_to)
            item, rejection = self.parsed[i], outcomes[i].rejection
            home = forwarded_to(rejection.code if rejection is not None else None,
                                item.key if isinstance(item, Envelope) else None, tx.db.partition)
            self.marks[i].record(tx, outcomes[i].event_id, delivery_outcome(outcomes[i].status, home))
        if self.hooks.in_flight is not None:
            self.hooks.in_flight.clear(tx)


def _conflict(env: Envelope, key: str) -> Rejection:
    return Rejection(REVISION_CONFLICT, f"fence {key} was claimed with another payload",
                     event_id=env.event_id, fingerprint=env.fingerprint)


def _unknown(env: Envelope, key: str, why: str) -> Rejection:
    # Reasons are cut at 200 characters (errors.safe_reason): what to do first, the key last.
    return Rejection(
        OUTCOME_UNKNOWN,
        f"not idempotent, {why}: not called again; ask the provider, then fence resolve {key}",
        event_id=env.event_id,
        fingerprint=env.fingerprint,
    )


# -- reading and resolving fences --------------------------------------------------

_COLUMNS = (
    "key, step, entity_key, revision, event_id, state, calls, in_doubt, provider_id, http_status, last_error,"
    " claimed_at, called_at, done_at, payload_sha256"
)


def _row(row: Sequence[Any]) -> dict[str, Any]:
    return {
        "key": row[0],
        "step": row[1],
        "articleId": row[2],
        "revision": row[3],
        "eventId": row[4],
        "state": row[5],
        "calls": row[6],
        "inDoubt": bool(row[7]),
        "providerId": row[8],
        "httpStatus": row[9],
        "lastError": row[10],
        "claimedAt": row[11],
        "calledAt": row[12],
        "doneAt": row[13],
        "payloadSha256": row[14],
    }


def has_fence(conn: Connection) -> bool:
    """Whether the database has a fence table (only consumers with an external effect do)."""
    if dialect(conn) == "postgres":
        sql = "SELECT 1 FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'fence'"
    else:
        sql = "SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'fence'"
    return bool(conn.execute(sql).fetchall())


def fence_list(
    conn: Connection, *, state: str | None = None, in_doubt: bool | None = None, limit: int | None = 50
) -> list[dict[str, Any]]:
    """Fence rows, newest claim first; optionally of one state, or only those in doubt."""
    if not has_fence(conn):
        return []
    where: list[str] = []
    params: list[str | int] = []
    if state is not None:
        where.append("state = ?")
        params.append(state)
    if in_doubt is not None:
        where.append("in_doubt = ?")
        params.append(int(in_doubt))
    sql = f"SELECT {_COLUMNS} FROM fence {'WHERE ' + ' AND '.join(where) if where else ''}"
    sql += " ORDER BY claimed_at DESC, key"
    if limit:
        sql += " LIMIT ?"
        params.append(limit)
    rows = conn.execute(sql, params).fetchall()
    return [_row(r) for r in rows]


def fence_show(conn: Connection, key: str) -> dict[str, Any] | None:
    """The fence row of *key*, or None."""
    where = key_parts(key)
    if where is None or not has_fence(conn):
        return None
    rows = conn.execute(f"SELECT {_COLUMNS} FROM fence WHERE {_BY_KEY}", where).fetchall()
    return _row(rows[0]) if rows else None


def resolve(db: Store, key: str, *, provider_id: str | None = None, not_sent: bool = False) -> dict[str, Any]:
    """A person's verdict on a claimed fence, typically after ``outcome-unknown``.

    ``provider_id``: the provider did it -- the fence becomes ``done`` and the
    next delivery (``dead requeue``) writes the receipt without calling.
    ``not_sent``: it did not -- the doubt is cleared and the next delivery
    calls again with the same key. Returns the row as it is now.
    """
    if (provider_id is None) == (not not_sent):
        raise FenceError("give either a provider id (the effect happened) or not-sent")
    where = key_parts(key)
    if where is None:
        raise FenceError(f"{key!r} is not a fence key (<articleId>:<revision>:<step>)")
    with db.transaction() as tx:
        row = tx.conn.execute(f"SELECT state FROM fence WHERE {_BY_KEY}", where).fetchone()
        if row is None:
            raise FenceError(f"no fence with key {key!r}")
        if row[0] != "claimed":
            raise FenceError(f"fence {key} is {row[0]}, not claimed: nothing to resolve")
        if provider_id is not None:
            tx.conn.execute(
                "UPDATE fence SET state = 'done', provider_id = ?, in_doubt = 0, done_at = ?,"
                f" last_error = 'resolved by hand: sent' WHERE {_BY_KEY}",
                (provider_id, now_iso(), *where),
            )
        else:
            tx.conn.execute(
                f"UPDATE fence SET in_doubt = 0, last_error = 'resolved by hand: not sent' WHERE {_BY_KEY}", where
            )
    shown = fence_show(db.conn, key)
    assert shown is not None
    return shown


__all__ = [
    "MIGRATION",
    "MIGRATIONS",
    "RENAME_KEY",
    "Call",
    "CallResult",
    "ExternalStep",
    "apply_fenced",
    "fence_key",
    "fence_list",
    "fence_show",
    "has_fence",
    "key_parts",
    "resolve",
    "serial_lock",
]
