"""The dead queue of a consumer: list it, requeue from it, purge from it.

What these do to the consumer's inbox (receipts read, rejections resolved, delivery counts
reset) is the inbox's own SQL, on either backend: :mod:`delivery_consumer.inbox.resolutions`.

Every command holds the queue through an exclusive
:class:`~delivery_consumer.amqp.dead_queue.DeadQueue`, so nothing is lost or
reordered. A reader that finds the queue held by another waits for it a
little (:data:`BUSY_WAIT_S`); readers of the same process share one read
through :class:`SharedReads`. Where dead letters come from, and the order of
a requeue's steps (what a kill at each one leaves): docs/amqp.md, "Dead
letters"; the console's reads: docs/console.md.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from .. import consumers
from ..amqp.dead_queue import DeadQueue, HeldMessage, QueueBusy
from ..amqp.topology import (
    BROKER_HEADERS,
    FAILURE_HEADERS,
    H_ATTEMPTS,
    H_CONSUMER,
    H_ERROR_CODE,
    H_ERROR_REASON,
    H_FAILED_AT,
    H_ROUTING_KEY,
    Topology,
)
from ..inbox import resolutions
from ..inbox.apply import Store
from ..model.cloudevents import binary_attributes, parse_message
from ..model.deliveries import Delivery, OutMessage, PublishResult, delivery_key
from ..model.envelope import KOMBU_COMPRESSION_HEADER, MAX_BODY_BYTES, body_digest
from ..model.errors import DELIVERY_LIMIT, Rejection, safe_reason
from ..model.event_types import EventTypes
from ..model.faults import crashpoint
from ..store.sqlite import now_iso

#: Headers a requeued copy carries: when, and how many times it was requeued.
H_REQUEUED_AT = "x-requeued-at"
H_REQUEUES = "x-requeues"

#: Headers a requeued copy must not carry: its failure (a fresh attempt count)
#: and what the broker owns (``x-death`` from a client is ignored from 4.0 on).
DROPPED_HEADERS = frozenset({*FAILURE_HEADERS, *BROKER_HEADERS})

#: Code of a dead letter that carries neither our headers nor ``x-death``.
UNKNOWN_CODE = "unknown"

#: Dead letters settled between two writes of their rejections.
RESOLVE_BATCH = resolutions.RESOLVE_BATCH


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _iso(value: Any) -> str | None:
    if isinstance(value, dt.datetime):
        stamp = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return now_iso(stamp.timestamp())
    return _text(value)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """What one dead message says about itself, plus its place in the queue."""

    position: int  # 1 = the head of the queue
    event_id: str | None
    message_id: str | None
    type: str | None
    code: str
    reason: str
    attempts: int | None
    failed_at: str | None
    consumer: str | None
    routing_key: str | None
    requeues: int
    fingerprint: str | None
    body_sha256: str
    size: int
    #: True when ``event_id`` was read from the body (not guessed from message_id).
    event_id_from_body: bool = False
    #: The CloudEvent's (source, id) when the message is one.
    origin: tuple[str, str] | None = None
    #: Fingerprints an earlier release gave the same event (``Envelope.earlier_fingerprints``).
    earlier_fingerprints: tuple[str, ...] = ()

    def same_body(self, fingerprint: str) -> bool:
        """Whether a receipt's *fingerprint* is this letter's event's."""
        return fingerprint == self.fingerprint or fingerprint in self.earlier_fingerprints

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "eventId": self.event_id,
            "cloudEvent": None if self.origin is None else {"id": self.origin[1], "source": self.origin[0]},
            "messageId": self.message_id,
            "type": self.type,
            "code": self.code,
            "reason": self.reason,
            "attempts": self.attempts,
            "failedAt": self.failed_at,
            "consumer": self.consumer,
            "routingKey": self.routing_key,
            "requeues": self.requeues,
            "fingerprint": self.fingerprint,
            "bodySha256": self.body_sha256,
            "size": self.size,
        }


def describe(position: int, msg: HeldMessage, types: EventTypes | None = None) -> DeadLetter:
    """Read a held dead message: its identity from the body (parsed against the
    consumer's *types*), its failure from the headers."""
    headers = msg.headers
    event_id: str | None = None
    fingerprint: str | None = None
    event_type: str | None = None
    origin: tuple[str, str] | None = None
    earlier: tuple[str, ...] = ()
    try:
        env = parse_message(msg.body, max_bytes=max(len(msg.body) + 1, MAX_BODY_BYTES),  # identity only: not the size
                            content_type=msg.content_type, headers=headers, content_encoding=msg.content_encoding,
                            compression=headers.get(KOMBU_COMPRESSION_HEADER), types=types)
        event_id, fingerprint, event_type = env.event_id, env.fingerprint, env.type
        origin, earlier = env.cloudevent, env.earlier_fingerprints
    except Rejection as rej:
        event_id, fingerprint, origin = rej.event_id, rej.fingerprint, rej.origin
        event_type = _type_named(msg)
    deaths = headers.get("x-death")
    death = deaths[0] if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict) else None
    code = _text(headers.get(H_ERROR_CODE))
    reason = _text(headers.get(H_ERROR_REASON)) or ""
    failed_at = _iso(headers.get(H_FAILED_AT))
    routing_key = _text(headers.get(H_ROUTING_KEY))
    if death is not None:
        why = _text(death.get("reason")) or "?"
        if code is None:
            code = DELIVERY_LIMIT if why == "delivery_limit" else f"dead-lettered:{why}"
            reason = (f"dead-lettered by the broker from {_text(death.get('queue'))} ({why}, "
                      f"{death.get('count', 1)} time(s))")
        failed_at = failed_at or _iso(death.get("time"))
        keys = death.get("routing-keys")
        if routing_key is None and isinstance(keys, list) and keys:
            routing_key = _text(keys[0])
    attempts = headers.get(H_ATTEMPTS)
    requeues = headers.get(H_REQUEUES)
    return DeadLetter(
        position=position,
        event_id=event_id or msg.message_id,
        message_id=msg.message_id,
        type=event_type,
        code=code or UNKNOWN_CODE,
        reason=reason,
        attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else None,
        failed_at=failed_at,
        consumer=_text(headers.get(H_CONSUMER)),
        routing_key=routing_key,
        requeues=requeues if isinstance(requeues, int) and not isinstance(requeues, bool) else 0,
        fingerprint=fingerprint,
        body_sha256=body_digest(msg.body),
        size=len(msg.body),
        event_id_from_body=event_id is not None,
        origin=origin,
        earlier_fingerprints=earlier,
    )


def _type_named(msg: HeldMessage) -> str | None:
    """The event type a refused message names, if it names one: a CloudEvent's
    ``type`` attribute (a header, or in its body), else the body's ``type``."""
    named = binary_attributes(msg.headers).get("type")
    if named is None and msg.content_encoding in (None, "", "identity", "utf-8"):
        try:
            obj = orjson.loads(msg.body)
        except orjson.JSONDecodeError:
            return None
        named = obj.get("type") if isinstance(obj, dict) else None
    return safe_reason(named, 120) if isinstance(named, str) and named else None


@dataclass(frozen=True)
class Selection:
    """Which dead letters a requeue or purge is about: eventIds, a code, or all."""

    event_ids: frozenset[str] = frozenset()
    code: str | None = None
    everything: bool = False

    def __post_init__(self) -> None:
        chosen = sum((bool(self.event_ids), self.code is not None, self.everything))
        if chosen != 1:
            raise ValueError("choose the dead letters with exactly one of: event ids, a code, all")

    def matches(self, letter: DeadLetter) -> bool:
        if self.everything:
            return True
        if self.code is not None:
            return letter.code == self.code
        return not self.event_ids.isdisjoint(_names(letter))

    def describe(self) -> str:
        if self.everything:
            return "every dead letter"
        if self.code is not None:
            return f"dead letters with code {self.code}"
        return f"{len(self.event_ids)} eventId(s)"


@dataclass
class Snapshot:
    """The dead queue as read, in order, with the messages still held."""

    queue: str
    letters: list[DeadLetter]
    held: list[HeldMessage]
    #: Ready messages the broker counted when the reader attached.
    count_at_open: int
    #: When the reader attached (Unix time), and whether every message present
    #: then was read (see :meth:`DeadQueue.read`).
    opened_at: float = 0.0
    complete: bool = False

    def by_code(self) -> dict[str, int]:
        counts = Counter(letter.code for letter in self.letters)
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def select(self, selection: Selection) -> list[tuple[DeadLetter, HeldMessage]]:
        return [(letter, msg) for letter, msg in zip(self.letters, self.held, strict=True)
                if selection.matches(letter)]

    def missing(self, selection: Selection) -> list[str]:
        """EventIds (or CloudEvent ids) asked for that are not in the queue."""
        present = {x for letter in self.letters for x in _names(letter)}
        return sorted(selection.event_ids - present)


def _names(letter: DeadLetter) -> set[str]:
    """What a dead letter may be asked for by: its eventId, message_id, CloudEvent id."""
    return {x for x in (letter.event_id, letter.message_id, letter.origin[1] if letter.origin else None) if x}


#: How long a reader waits for the dead queue while another holds it (a
#: console's read, another dead command) before it gives up, in seconds.
BUSY_WAIT_S = 15.0


def _open(dq: DeadQueue, prefetch: int, wait_s: float, on_busy: Callable[[str], None] | None) -> None:
    """Open *dq*, trying again while another reader holds the queue, up to *wait_s* seconds
    (*on_busy* is told once, with the broker's refusal)."""
    deadline = time.monotonic() + wait_s
    pause = 0.05
    told = False
    while True:
        try:
            dq.open(prefetch=prefetch)
            return
        except QueueBusy as exc:
            if time.monotonic() + pause > deadline:
                raise
            if on_busy is not None and not told:
                told = True
                on_busy(str(exc))
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


@contextmanager
def reading(url: str, topology: Topology, *, max_messages: int | None = None, wait_s: float = BUSY_WAIT_S,
            on_busy: Callable[[str], None] | None = None) -> Iterator[tuple[DeadQueue, Snapshot]]:
    """Hold the dead queue of *topology* for the block; everything not acked returns at the end.

    While another reader holds the queue, waits up to *wait_s* seconds for it
    (then :class:`QueueBusy`), telling *on_busy* once that it waits."""
    with DeadQueue(url, topology.dead_queue, name=f"delivery-consumer dead {topology.consumer}") as dq:
        _open(dq, max_messages if max_messages is not None and max_messages <= 65535 else 0, wait_s, on_busy)
        held = dq.read(max_messages)
        spec = consumers.find(topology.consumer)
        types = spec.event_types if spec is not None else None
        letters = [describe(i, msg, types) for i, msg in enumerate(held, 1)]
        yield dq, Snapshot(topology.dead_queue, letters, held, dq.count_at_open, dq.opened_at, dq.complete)


def list_dead(url: str, topology: Topology, *, max_messages: int | None = None, wait_s: float = BUSY_WAIT_S,
              on_busy: Callable[[str], None] | None = None) -> Snapshot:
    """Read the dead queue and give every message back, in place."""
    with reading(url, topology, max_messages=max_messages, wait_s=wait_s, on_busy=on_busy) as (_dq, snapshot):
        return snapshot


class SharedReads:
    """Dead-queue reads shared by the threads of one process, each kept *ttl_s* seconds.

    One thread at a time reads a given queue; the others that ask meanwhile
    wait for that read and get the same snapshot, and so do those that ask
    within *ttl_s* after it (a failure too: one line, kept as long). The
    queue is held only while one read runs, and a reader never waits for
    another process's (a dead command's) hold: it reports the queue busy.
    """

    def __init__(self, ttl_s: float = 5.0, *, wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str, int | None], _Shared] = {}
        #: Reads of the broker done (for tests and benchmarks).
        self.reads = 0

    def list(self, url: str, topology: Topology, *, max_messages: int | None = None) -> Snapshot:
        """The snapshot of the dead queue of *topology*, at most ``ttl_s`` old; a BrokerError as read."""
        key = (url, topology.dead_queue, max_messages)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or (entry.done.is_set() and self._clock() - entry.at > self.ttl_s):
                entry = self._entries[key] = _Shared()
                mine = True
            else:
                mine = False
        if mine:
            try:
                self.reads += 1
                entry.snapshot = list_dead(url, topology, max_messages=max_messages, wait_s=self.wait_s)
            except Exception as exc:  # every waiter gets it, as the reader did
                entry.error = exc
            finally:
                entry.at = self._clock()
                entry.done.set()
        entry.done.wait()
        if entry.error is not None:
            raise entry.error
        assert entry.snapshot is not None
        return entry.snapshot

    def forget(self) -> None:
        """Drop every kept snapshot (after an action changed a queue)."""
        with self._lock:
            self._entries = {key: entry for key, entry in self._entries.items() if not entry.done.is_set()}


class _Shared:
    """One read of a dead queue, awaited by every thread that asked for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.at = 0.0
        self.snapshot: Snapshot | None = None
        self.error: BaseException | None = None


def event_ids(letters: Iterable[DeadLetter]) -> set[str]:
    """Every eventId (and message_id) of *letters*."""
    return {x for letter in letters for x in (letter.event_id, letter.message_id) if x}


def receipts(db: Store, letters: Iterable[DeadLetter]) -> dict[int, dict[str, Any]]:
    """Position -> ``{"result", "sameBody"}`` of each dead letter whose eventId the
    consumer applied anyway: another copy of the same body (requeued, it would be a
    duplicate), or another body under its eventId (it would be event-id-reused again)."""
    letters = list(letters)
    found = resolutions.receipts_of(db, {letter.event_id for letter in letters if letter.event_id is not None})
    return {letter.position: {"result": receipt[1], "sameBody": letter.same_body(receipt[0])}
            for letter in letters if letter.event_id is not None and (receipt := found.get(letter.event_id))}


# -- requeue and purge -----------------------------------------------------------------

APPLIED, CONFLICT, REQUEUE = "applied", "conflict", "requeue"


@dataclass(slots=True)
class Item:
    """One selected dead letter and what happened to it."""

    letter: DeadLetter
    message: HeldMessage
    plan: str  # APPLIED | CONFLICT | REQUEUE (requeue); "purge" (purge)
    outcome: str = "pending"  # requeued | dropped | purged | left | failed | would-...
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**self.letter.to_json(), "plan": self.plan, "outcome": self.outcome,
                **({"detail": self.detail} if self.detail else {})}


@dataclass
class Report:
    """What a requeue or purge did, message by message."""

    queue: str
    target: str | None
    selection: str
    items: list[Item] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    dry_run: bool = False
    #: Rejections resolved because their copy had already left the dead queue.
    reconciled: int = 0

    def counts(self) -> dict[str, int]:
        return dict(Counter(item.outcome for item in self.items))

    @property
    def left_behind(self) -> bool:
        """True when a selected message (or eventId asked for) was not dealt with."""
        return bool(self.missing) or any(item.outcome in ("left", "failed") for item in self.items)

    def to_json(self) -> dict[str, Any]:
        return {"queue": self.queue, "target": self.target, "selection": self.selection, "dryRun": self.dry_run,
                "counts": self.counts(), "missing": self.missing, "reconciled": self.reconciled,
                "items": [i.to_json() for i in self.items]}


def plan_requeue(db: Store, chosen: Sequence[tuple[DeadLetter, HeldMessage]]) -> list[Item]:
    """Sort selected dead letters into already applied, conflicting, and to requeue."""
    found = resolutions.receipts_of(db, {letter.event_id for letter, _msg in chosen if letter.event_id is not None})
    items = []
    for letter, msg in chosen:
        receipt = None if letter.event_id is None else found.get(letter.event_id)
        if receipt is None:
            items.append(Item(letter, msg, REQUEUE))
        elif letter.same_body(receipt[0]):
            items.append(Item(letter, msg, APPLIED, detail=f"receipt exists: {receipt[1]}"))
        else:
            items.append(Item(letter, msg, CONFLICT,
                              detail="eventId already applied with another body; requeued, it would be "
                                     "rejected event-id-reused again"))
    return items


def requeue_copy(msg: HeldMessage, letter: DeadLetter, topology: Topology, now: str) -> OutMessage:
    """The copy of a dead message for the consumer's queue, with a fresh attempt count."""
    headers = {k: v for k, v in msg.headers.items() if k not in DROPPED_HEADERS}
    if letter.routing_key is not None:
        headers.setdefault(H_ROUTING_KEY, letter.routing_key)
    headers[H_REQUEUED_AT] = now
    headers[H_REQUEUES] = letter.requeues + 1
    return OutMessage(routing_key=topology.queue, body=msg.body, exchange="", message_id=msg.message_id,
                      headers=headers, content_type=msg.content_type or "application/json",
                      content_encoding=msg.content_encoding)


def _delivery_key(msg: HeldMessage) -> str:
    return delivery_key(Delivery(0, msg.tag, msg.body, msg.routing_key, msg.redelivered, msg.message_id, {}))


def _reset_counts(db: Store, items: Iterable[Item]) -> None:
    """A fresh poison budget for messages about to be requeued (step 1 of a requeue: docs/amqp.md)."""
    resolutions.reset_counts(db, [_delivery_key(item.message) for item in items])


def resolve(db: Store, queue: str, letters: Sequence[DeadLetter]) -> int:
    """Mark one unresolved ``rejected`` row per dead letter resolved; returns the count
    (:func:`~delivery_consumer.inbox.resolutions.resolve_letters` says which row is a letter's)."""
    return resolutions.resolve_letters(db, queue, [
        resolutions.Letter(letter.body_sha256, letter.event_id, letter.event_id_from_body) for letter in letters])


def reconcile(db: Store, snapshot: Snapshot) -> int:
    """Resolve unresolved rejections of this dead queue whose copy is no longer in it.

    ``run`` records a rejection only after the broker confirmed its dead copy,
    so a row older than the read whose body digest is absent from a complete
    read names a copy that was removed -- by a requeue or purge killed before
    it could resolve the row, or by hand. Resolving it lets ``inbox prune``
    remove the receipt in due time; nothing can requeue that copy any more.
    Returns the number of rows resolved; does nothing for an incomplete read.
    """
    if not snapshot.complete:
        return 0
    return resolutions.resolve_gone(db, snapshot.queue, {letter.body_sha256 for letter in snapshot.letters},
                                    now_iso(snapshot.opened_at - resolutions.RECONCILE_MARGIN_S))


def requeue(
    db: Store,
    dq: DeadQueue,
    snapshot: Snapshot,
    topology: Topology,
    selection: Selection,
    *,
    drop_applied: bool = False,
    dry_run: bool = False,
    progress: Callable[[Item], None] = lambda item: None,
) -> Report:
    """Requeue the selected dead letters of *snapshot* (held by *dq*) to the consumer's queue.

    docs/amqp.md, "Dead letters", gives the order of the steps and what a kill at
    each one leaves behind. A copy that is not confirmed (returned, nacked)
    leaves its dead message in place, ``failed``; a lost connection raises
    BrokerUnavailable after the messages dealt with so far.
    """
    report = Report(snapshot.queue, topology.queue, selection.describe(), missing=snapshot.missing(selection),
                    dry_run=dry_run)
    report.items = plan_requeue(db, snapshot.select(selection))
    if dry_run:
        for item in report.items:
            item.outcome = {REQUEUE: "would-requeue", APPLIED: "would-drop" if drop_applied else "left",
                            CONFLICT: "left"}[item.plan]
            progress(item)
        return report
    report.reconciled = reconcile(db, snapshot)
    _reset_counts(db, (item for item in report.items if item.plan == REQUEUE))
    settled: list[DeadLetter] = []
    try:
        for item in report.items:
            if item.plan == REQUEUE:
                result: PublishResult = dq.publish(requeue_copy(item.message, item.letter, topology, now_iso()))
                if not result.ok:
                    item.outcome, item.detail = "failed", f"copy {result.status}: {result.reason}"
                    progress(item)
                    continue
                crashpoint("requeue-after-confirm")
                dq.ack(item.message.tag)
                crashpoint("requeue-after-ack")
                item.outcome = "requeued"
            elif item.plan == APPLIED and drop_applied:
                dq.ack(item.message.tag)
                item.outcome = "dropped"
            else:
                item.outcome = "left"
                progress(item)
                continue
            settled.append(item.letter)
            progress(item)
            if len(settled) >= RESOLVE_BATCH:
                resolve(db, snapshot.queue, settled)
                settled = []
        dq.flush()
    finally:
        if settled:
            resolve(db, snapshot.queue, settled)
    return report


def purge(
    db: Store | None,
    dq: DeadQueue,
    snapshot: Snapshot,
    selection: Selection,
    *,
    dry_run: bool = False,
    progress: Callable[[Item], None] = lambda item: None,
) -> Report:
    """Remove the selected dead letters for good; resolve their rejections when *db* is given."""
    report = Report(snapshot.queue, None, selection.describe(), missing=snapshot.missing(selection),
                    dry_run=dry_run)
    report.items = [Item(letter, msg, "purge") for letter, msg in snapshot.select(selection)]
    if db is not None and not dry_run:
        report.reconciled = reconcile(db, snapshot)
    settled: list[DeadLetter] = []
    try:
        for item in report.items:
            if dry_run:
                item.outcome = "would-purge"
            else:
                dq.ack(item.message.tag)
                crashpoint("purge-after-ack")
                item.outcome = "purged"
                settled.append(item.letter)
            progress(item)
            if db is not None and len(settled) >= RESOLVE_BATCH:
                resolve(db, snapshot.queue, settled)
                settled = []
        if not dry_run:
            dq.flush()
    finally:
        if settled and db is not None:
            resolve(db, snapshot.queue, settled)
    return report


__all__ = [
    "APPLIED",
    "BUSY_WAIT_S",
    "CONFLICT",
    "DROPPED_HEADERS",
    "H_REQUEUED_AT",
    "H_REQUEUES",
    "REQUEUE",
    "DeadLetter",
    "Item",
    "Report",
    "Selection",
    "SharedReads",
    "Snapshot",
    "describe",
    "event_ids",
    "list_dead",
    "plan_requeue",
    "purge",
    "reading",
    "receipts",
    "reconcile",
    "requeue",
    "requeue_copy",
    "resolve",
]
