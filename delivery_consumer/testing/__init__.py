"""The test kit: a user's consumer driven in memory, through the path ``run`` takes in production.

:class:`ConsumerHarness` runs ``run``'s worker (``service.worker``) in this
process on the in-memory link (``service/memory_link.py``: the consumer's
queues as the broker keeps them, retry tiers on a virtual clock, the dead
queue) against the consumer's real SQLite database, so an event goes
through the very store, receipts, retries and dead letters it meets in
production -- no broker, milliseconds per test. A test publishes envelopes
or CloudEvents (structured or binary), as new messages or redeliveries;
:meth:`~ConsumerHarness.run` lets the worker work until nothing is left
(every retry tier passed, on the virtual clock) or an emulated crash at a
crash point (``after-commit``: committed, not acked); then it asserts on
what each delivery came to (:class:`Run`), the receipts, the dead letters
and the consumer's own tables. The pytest fixture ``consumer_harness``
(``delivery_consumer.testing.plugin``, loaded by its ``pytest11`` entry
point) makes one per test. docs/testing-consumers.md.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from .. import consumers
from ..amqp.topology import H_ATTEMPTS, H_ERROR_CODE, H_ERROR_REASON, Topology
from ..inbox import ConsumerDB, InFlight
from ..inbox.reports import dict_rows, receipt_row
from ..model.cloudevents import STRUCTURED_CONTENT_TYPE, event_id_for, parse_message, utc_milliseconds
from ..model.contract import ConsumerSpec, Outcome
from ..model.deliveries import Delivery, OutMessage
from ..model.envelope import Envelope
from ..model.errors import Rejection, TransientError
from ..model.event_ids import new_event_id
from ..model.event_types import CloudEventId
from ..model.typed import data_of, envelope
from ..service.copies import Copy
from ..service.memory_link import MemoryLink, MemoryQueues
from ..service.settings import RunConfig
from ..service.worker import Worker

#: The crash points of ``run``'s worker a test can stop at (:meth:`ConsumerHarness.run`'s ``crash_at``).
CRASH_POINTS = ("before-commit", "after-commit", "after-retry-confirm", "after-dead-confirm")
#: What became of a delivery: acked (applied, or answered from its receipt), a copy sent to a
#: retry tier, or a copy sent to the dead queue; each is acked once its copy is confirmed.
ACKED, RETRIED, DEAD_LETTERED = "acked", "retried", "dead-lettered"


class ProcessDied(BaseException):
    """The emulated process dies at a crash point, as SIGKILL ends ``run``: nothing after it runs."""


class HarnessError(Exception):
    """The harness was used the wrong way, or the worker did not finish in time."""


@dataclass(frozen=True)
class Message:
    """A message as a producer publishes it to the consumer's exchange."""

    body: bytes
    routing_key: str
    content_type: str = "application/json"
    headers: Mapping[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    #: The eventId the message maps to, when the harness made it.
    event_id: str | None = None


@dataclass(frozen=True)
class Delivered:
    """What one delivery came to in a run."""

    event_id: str | None
    #: The result (``updated``, ``duplicate:updated``), the rejection code, or ``transient:<code>``.
    status: str
    #: ACKED, RETRIED or DEAD_LETTERED.
    fate: str
    #: 1 for a first delivery, n after n - 1 retries.
    attempt: int
    redelivered: bool
    result: str | None = None
    rejection: Rejection | None = None
    transient: TransientError | None = None
    #: The CloudEvent's (source, id) when the message was one.
    cloudevent: CloudEventId | None = None

    @property
    def code(self) -> str | None:
        """The rejection code: the consumer's own, the store's, or ``retries-exhausted`` / ``delivery-limit``."""
        return self.rejection.code if self.rejection is not None else None


@dataclass
class Run:
    """What one run did: each delivery settled (acked), in order; whether it died at a crash point."""

    deliveries: list[Delivered]
    crashed: bool
    #: The virtual clock (ms) when the run ended: the retry tiers' delays passed.
    clock_ms: float

    def of(self, event_id: str) -> list[Delivered]:
        """The deliveries of *event_id*, in order."""
        return [d for d in self.deliveries if d.event_id == event_id]

    def last(self, event_id: str) -> Delivered:
        """The last delivery of *event_id* (KeyError: none in this run)."""
        found = self.of(event_id)
        if not found:
            raise KeyError(f"no delivery of {event_id} in this run")
        return found[-1]

    @property
    def results(self) -> dict[str, str]:
        """eventId -> the status of its last delivery."""
        return {d.event_id: d.status for d in self.deliveries if d.event_id is not None}

    @property
    def dead_lettered(self) -> list[Delivered]:
        return [d for d in self.deliveries if d.fate == DEAD_LETTERED]

    @property
    def retried(self) -> list[Delivered]:
        return [d for d in self.deliveries if d.fate == RETRIED]


@dataclass(frozen=True)
class DeadLetter:
    """A message in the consumer's dead queue."""

    event_id: str | None
    code: str
    reason: str
    attempts: int | None
    body: bytes
    headers: Mapping[str, Any]
    cloudevent: CloudEventId | None = None


class _Incarnation(Worker):
    """One emulated ``run`` process: the worker, its note of work in hand named so that the next
    incarnation sees it as a dead process's, crash points that end it, and what it settled."""

    def __init__(self, config: RunConfig, owner: str, crash_at: str | None) -> None:
        super().__init__(config)
        self.owner = owner
        self.crash_at = crash_at
        self.settled: list[Delivered] = []
        self._copies: dict[int, Copy] = {}

    def crashpoint(self, name: str) -> None:
        if name == self.crash_at:
            raise ProcessDied(f"crash point {name} reached")

    def open(self) -> bool:
        opened = super().open()
        if opened:
            assert self.db is not None
            self.in_flight = InFlight(self.db, owner=self.owner)
        return opened

    def close(self) -> None:
        if isinstance(self.error, ProcessDied):  # what SIGKILL leaves: no exit code runs
            if self.db is not None:
                self.db.close()
            if self.io is not None:
                assert isinstance(self.io, MemoryLink)
                self.io.close()
            return
        super().close()

    def _not_drained(self) -> str | None:
        return None  # in memory: the link's queue says when it is drained

    def _copied(self, copies: list[Copy]) -> None:
        super()._copied(copies)
        self._copies.update((c.delivery.tag, c) for c in copies)

    def _release(self, gen: int, copies: list[Copy]) -> None:
        for c in copies:  # held until the broker took their copies: settled now
            self._copies.pop(c.delivery.tag, None)
            rejection = c.rejection
            self.settled.append(Delivered(
                c.event_id, rejection.code if rejection is not None else "retry",
                RETRIED if c.kind == "retry" else DEAD_LETTERED, c.attempts, c.delivery.redelivered, None,
                rejection, None, None if c.origin is None else CloudEventId(*c.origin)))
        super()._release(gen, copies)

    def _settle(self, gen: int, items: list[Delivery], outcomes: list[Outcome],
                parsed: Sequence[Envelope | Rejection], held: set[int] | None = None) -> None:
        for d, o, p in zip(items, outcomes, parsed, strict=True):
            if held and d.tag in held:
                continue
            copy = self._copies.pop(d.tag, None)
            fate = ACKED if copy is None else RETRIED if copy.kind == "retry" else DEAD_LETTERED
            rejection = o.rejection if copy is None or copy.rejection is None else copy.rejection
            self.settled.append(Delivered(
                o.event_id, rejection.code if rejection is not None else o.status, fate, self.copies.attempts(d) + 1,
                d.redelivered, o.result, rejection, o.transient,
                p.cloudevent if isinstance(p, Envelope) else None if p.origin is None else CloudEventId(*p.origin)))
        super()._settle(gen, items, outcomes, parsed, held)


class ConsumerHarness:
    """A consumer in memory: its queues, its real database at *db*, ``run``'s worker on demand.

    *consumer*: its spec (registered for the harness's life, the one registered
    before given back at :meth:`close`) or its registered name. *options*: the
    fields of ``RunConfig`` that shape what a run does (``max_attempts``,
    ``retry_delays_ms``, ``max_crashes``, ``batch``, ``prefetch``,
    ``delivery_limit``, ``max_bytes``, ``consumer_options``). The database is
    created (the consumer's migrations and checks run) at once.
    """

    def __init__(self, consumer: ConsumerSpec | str, db: str | Path, **options: Any) -> None:
        if isinstance(consumer, ConsumerSpec):
            self._previous = consumers.registered(consumer.name)
            self._registered: ConsumerSpec | None = consumers.register(consumer, replace=True)
            self.spec = consumer
        else:
            self._previous, self._registered = None, None
            self.spec = consumers.get(consumer)
        self.db_path = Path(db)
        unknown = set(options) - set(RunConfig.__dataclass_fields__) - {"url"}
        if unknown or {"consumer", "db_path", "url"} & set(options):
            self.close()
            raise HarnessError(f"not options of a run here: {', '.join(sorted(unknown or set(options)))}")
        self.config = RunConfig(consumer=self.spec.name, url="memory:", db_path=self.db_path, **options)
        try:
            consumers.open_db(self.db_path, self.spec.name, create=True).close()
            self.queues = MemoryQueues(self.config.topology())
        except BaseException:
            self.close()
            raise
        self._runs = 0
        self._ce_ids = 0

    # -- the consumer's queues ----------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        return self.queues.topology

    @property
    def clock_ms(self) -> float:
        """The virtual clock of the retry tiers (ms)."""
        return self.queues.clock_ms

    @property
    def waiting(self) -> int:
        """Messages not settled yet: in the main queue (a crash gives its unacked ones back) or on a retry tier."""
        with self.queues.changed:
            return len(self.queues.ready) + len(self.queues.delayed)

    @property
    def dead(self) -> list[DeadLetter]:
        """The dead queue, in order (left in place)."""
        with self.queues.changed:
            messages = list(self.queues.dead)
        return [self._dead_letter(m) for m in messages]

    # -- messages -----------------------------------------------------------------------------

    def event(self, type: str, key: str, data: Any = None, *, revision: int | None = None,
              event_id: str | None = None, occurred_at: str | None = None,
              meta: Mapping[str, str] | None = None) -> dict[str, Any]:
        """An envelope of the consumer's type *type* for *key*: *data* a model's value or a
        mapping; a fresh eventId and the present time unless given."""
        declared = self.spec.event_types.get(type)
        if declared is None:
            raise HarnessError(f"{type!r} is not a type of {self.spec.name} ({', '.join(self.spec.event_types.names)})")
        return envelope(declared, key, {} if data is None else data, revision=revision, event_id=event_id,
                        occurred_at=occurred_at, meta=meta)

    def cloudevent(self, type: str, subject: str, data: Any = None, *, id: str | None = None,
                   source: str = "/tests", revision: int | None = None, time: str | int | None = None,
                   mode: str = "structured", prefix: str = "cloudEvents:",
                   extensions: Mapping[str, Any] | None = None) -> Message:
        """A CloudEvent 1.0 message of *type* for *subject* (the type's key), *structured* or *binary*
        (its attributes in headers under *prefix*: ``cloudEvents:``, ``cloudEvents_`` or ``ce-``; the
        ``ce-`` binding writes every value as text). *time*: an RFC 3339 string, or milliseconds as the
        AMQP binding writes it; the present time by default. *id*: a fresh one by default."""
        if mode not in ("structured", "binary"):
            raise HarnessError(f"mode {mode!r}: structured or binary")
        self._ce_ids += 1
        attributes: dict[str, Any] = {"specversion": "1.0", "id": id or f"test-{self._ce_ids}-{new_event_id()[-8:]}",
                                      "source": source, "type": type, "subject": subject,
                                      "time": time if time is not None else
                                      datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")}
        if revision is not None:
            attributes["revision"] = revision
        attributes.update(extensions or {})
        payload = data_of({} if data is None else data)
        mapped = event_id_for(source, attributes["id"])
        if mode == "structured":
            return Message(orjson.dumps({**attributes, "datacontenttype": "application/json", "data": payload}), type,
                           STRUCTURED_CONTENT_TYPE, event_id=mapped)
        text = prefix.lower() == "ce-"  # the RabbitMQ binding: every value as text, time in RFC 3339
        if text and isinstance(time, int):
            attributes["time"] = utc_milliseconds(datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=time))
        headers = {f"{prefix}{name}": str(value) if text else value for name, value in attributes.items()}
        return Message(orjson.dumps(payload), type, "application/json", headers, event_id=mapped)

    def publish(self, *messages: Mapping[str, Any] | bytes | Message, redelivered: bool = False) -> list[str | None]:
        """Publish to the consumer's exchange, routed by type as a producer's messages are: an envelope (a
        dict), raw bytes (routed by their ``type`` when they have one) or a :class:`Message`. *redelivered*:
        each arrives as a message the broker gives back (its redelivered flag set). Returns the eventIds."""
        ids: list[str | None] = []
        for item in messages:
            message = self._message(item)
            out = OutMessage(message.routing_key, message.body, self.topology.exchange, message.message_id,
                             dict(message.headers), message.content_type)
            if not self.queues.publish(out, redelivered=redelivered):
                raise HarnessError(f"routing key {message.routing_key!r} reaches no queue of {self.spec.name} "
                                   f"(its binding keys: {', '.join(self.spec.binding_keys)})")
            ids.append(message.event_id)
        return ids

    def _message(self, item: Mapping[str, Any] | bytes | Message) -> Message:
        if isinstance(item, Message):
            return item
        if isinstance(item, bytes):
            try:
                obj = orjson.loads(item)
            except orjson.JSONDecodeError:
                obj = None
            named = obj.get("type") if isinstance(obj, dict) else None
            event_id = obj.get("eventId") if isinstance(obj, dict) else None
            key = named if isinstance(named, str) else self.spec.event_types.names[0]
            return Message(item, key, message_id=event_id if isinstance(event_id, str) else None,
                           event_id=event_id if isinstance(event_id, str) else None)
        if isinstance(item, Mapping):
            body = orjson.dumps(dict(item))
            event_id = item.get("eventId")
            return Message(body, str(item.get("type")), message_id=event_id if isinstance(event_id, str) else None,
                           event_id=event_id if isinstance(event_id, str) else None)
        raise HarnessError(f"publish takes an envelope (dict), bytes or a Message, not {type(item).__name__}")

    # -- running -------------------------------------------------------------------------------

    def run(self, *, crash_at: str | None = None, timeout_s: float = 60.0) -> Run:
        """Let one emulated ``run`` process work until nothing is left -- every message settled, every
        retry tier passed on the virtual clock -- or until it dies at *crash_at* (one of
        :data:`CRASH_POINTS`: its transaction rolled back before a commit, its deliveries unacked,
        its note of work in hand left behind, as SIGKILL leaves them). The next run is the next process."""
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise HarnessError(f"crash_at {crash_at!r}: one of {', '.join(CRASH_POINTS)}")
        self._runs += 1
        # A process name no live process has: a dead process's once this run ends (inbox.in_flight).
        worker = _Incarnation(self.config, f"harness:{self._runs}:-", crash_at)
        link = MemoryLink(self.queues, worker, prefetch=self.config.prefetch, stop_when_drained=True)
        worker.io = link
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            worker.stop_requested.set()
            worker.join(10)
            raise HarnessError(f"the run did not finish within {timeout_s:g}s (a handler that waits?)")
        crashed = isinstance(worker.error, ProcessDied)
        if worker.error is not None and not crashed:
            raise worker.error  # the database cannot be used, a bug: as run would stop with it
        return Run(worker.settled, crashed, self.queues.clock_ms)

    def deliver(self, *messages: Mapping[str, Any] | bytes | Message, redelivered: bool = False,
                crash_at: str | None = None) -> Run:
        """:meth:`publish` *messages*, then :meth:`run`."""
        self.publish(*messages, redelivered=redelivered)
        return self.run(crash_at=crash_at)

    # -- what the database holds ---------------------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator[ConsumerDB]:
        """The consumer's database opened read-only for the block."""
        with consumers.open_db(self.db_path, self.spec.name, readonly=True) as db:
            yield db

    def receipt(self, event_id: str) -> dict[str, Any] | None:
        """The receipt of *event_id* (result, type, key, receivedAt, fingerprint, meta, cloudEvent), or None."""
        with self.reading() as db:
            return receipt_row(db.conn, event_id)

    def rows(self, table: str, where: str = "", *params: Any) -> list[dict[str, Any]]:
        """The rows of the consumer's *table* (``where``: an SQL condition with ``?`` for *params*),
        as dicts by column name, in rowid order."""
        if not table.replace("_", "").isalnum():
            raise HarnessError(f"{table!r} is not a table name")
        sql = f'SELECT * FROM "{table}"' + (f" WHERE {where}" if where else "") + " ORDER BY rowid"
        with self.reading() as db:
            cursor = db.conn.execute(sql, params)
            names = [column[0] for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """Any read-only SQL on the consumer's database."""
        with self.reading() as db:
            try:
                return db.conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise HarnessError(f"{sql!r}: {exc}") from None

    def rejections(self) -> list[dict[str, Any]]:
        """The ``rejected`` rows (code, reason, eventId, key, origin, attempts, deadLetter...), in order."""
        with self.reading() as db:
            return dict_rows(db.conn.execute("SELECT * FROM rejected ORDER BY id"))

    def trace(self, event_id: str) -> dict[str, Any]:
        """What ``delivery-consumer trace`` shows of *event_id* (NotFound when the database has nothing)."""
        from ..inbox.history import trace

        with self.reading() as db:
            return trace(db, event_id)

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Give the consumer's name back to the spec registered before, if any."""
        if self._registered is not None:
            if self._previous is not None:
                consumers.register(self._previous, replace=True)
            elif consumers.registered(self._registered.name) is self._registered:
                consumers.unregister(self._registered.name)
            self._registered = None

    def __enter__(self) -> ConsumerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _dead_letter(self, message: OutMessage) -> DeadLetter:
        headers = dict(message.headers or {})
        event_id, origin = message.message_id, None
        try:
            env = parse_message(message.body, content_type=message.content_type, headers=headers,
                                max_bytes=max(len(message.body), self.config.max_bytes), types=self.spec.event_types)
            event_id, origin = env.event_id, env.cloudevent
        except Rejection as rej:
            event_id = rej.event_id or event_id
            origin = None if rej.origin is None else CloudEventId(*rej.origin)
        attempts = headers.get(H_ATTEMPTS)
        return DeadLetter(event_id, str(headers.get(H_ERROR_CODE) or headers.get("x-last-death-reason") or "unknown"),
                          str(headers.get(H_ERROR_REASON) or ""), attempts if isinstance(attempts, int) else None,
                          message.body, headers, origin)


__all__ = [
    "ACKED",
    "CRASH_POINTS",
    "DEAD_LETTERED",
    "RETRIED",
    "ConsumerHarness",
    "DeadLetter",
    "Delivered",
    "HarnessError",
    "Message",
    "ProcessDied",
    "Run",
]
