"""The worker: owns the database; turns deliveries into commits, copies and acks.

It runs in the worker process and talks to the connection only through
:class:`WorkerIO`, so it can be driven in memory (:mod:`.memory_link`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeVar

from ..amqp.backoff import Backoff
from ..amqp.partitions import delivery_outcome, forwarded_to
from ..amqp.retry import RetryPolicy, reconnect_delay_s
from ..amqp.topology import H_ATTEMPTS, H_DELIVERY_COUNT, H_PRODUCED_MS
from ..inbox import InFlight, Transaction, apply_batch, has_receipt
from ..inbox.database import IntegrityCheck
from ..inbox.seam import InboxDB
from ..model.cloudevents import parse_message
from ..model.contract import DeliveryMark, Outcome, WorkHooks
from ..model.deliveries import Delivery, Observer, OutMessage, delivery_key
from ..model.envelope import KOMBU_COMPRESSION_HEADER, Envelope, body_digest, is_event_id
from ..model.errors import (
    DELIVERY_LIMIT,
    FORWARDED,
    BrokerError,
    DatabaseLost,
    DatabaseMalformed,
    DeliveryError,
    Rejection,
    StoreOutage,
    StoreUnavailable,
)
from ..model.faults import crashpoint
from ..model.plural import count
from ..observability import tracing
from ..observability.logs import cloudevent_fields, cloudevent_text
from ..store import acked
from ..store.dbfile import ContentTags, WriterLock
from .copies import Copy, CopyMaker, origin_of, seal_key
from .settings import RunConfig

log = logging.getLogger("delivery_consumer.run")
_T = TypeVar("_T")
#: The longest the worker waits for the connection in one go (then it looks at its flags).
_IDLE_WAIT_S = 0.2
#: How long an idle ``--exit-when-idle`` run waits for its queue's answer before it looks again.
_IDLE_CHECK_S = 5.0
#: The longest wait between two tries of a held delivery's copies.
_HOLD_RETRY_CAP_S = 10.0
#: How often an idle worker looks at its file (replaced, its content copied over, taken over),
#: and how often the record of what was acknowledged (acked.py) is brought up to date.
_LOOK_EVERY_S = 1.0


class WorkerIO(Protocol):
    """The worker's connection (in ``run``: the connection process, through the pipe)."""

    def pump(self, timeout: float) -> None:
        """Wait up to *timeout* seconds for news from the connection and hand
        it to the worker (:meth:`Worker.deliver_all`, :meth:`Worker.channel_opened`,
        ...), in the calling thread: the worker's."""

    def ack(self, generation: int, tag: int, *, multiple: bool = True) -> None: ...

    def publish_copies(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]: ...

    def reconnect(self, why: str) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class Stats:
    """Running totals, read by the metrics endpoint and the final log line."""

    results: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    retried: int = 0
    dead_lettered: Counter[str] = field(default_factory=Counter)
    #: Events of another partition sent on to theirs.
    forwarded: int = 0
    batches: int = 0
    acked: int = 0
    last_commit: float = 0.0
    #: perf_counter() of the first delivery handed over and of the last ack posted.
    first_delivery: float = 0.0
    last_ack: float = 0.0
    #: Seconds with deliveries in hand (waiting or being applied), and since when now (None: idle).
    busy_s: float = 0.0
    busy_since: float | None = None

    def line(self) -> str:
        done = ", ".join(f"{n} {k}" for k, n in self.results.most_common()) or "nothing applied"
        span = self.last_ack - self.first_delivery if self.acked else 0.0
        rate = f" ({self.acked / self.busy_s:.0f}/s)" if self.busy_s > 0 else ""  # idle time aside
        return (f"{count(self.acked, 'delivery', 'deliveries')} acked in {count(self.batches, 'batch', 'batches')}: "
                f"{done}; {self.retried} retried, {sum(self.dead_lettered.values())} dead-lettered"
                + (f", {self.forwarded} forwarded to their partitions" if self.forwarded else "")
                + "; first delivery "
                f"to last ack {span:.3f}s, {self.busy_s:.3f}s busy{rate}")



def _int_header(headers: dict[str, Any], name: str) -> int:
    value = headers.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _observe_ages(observer: Observer, items: Sequence[Delivery], parsed: Sequence[Envelope | Rejection],
                  outcomes: Sequence[Outcome], committed_at: float) -> None:
    """The age at *committed_at* of each event with a result (applied, or a
    duplicate): from the producer's stamp (``x-produced-ms``), else from its
    occurredAt (clock skew clamped at 0)."""
    produced: list[float] = []
    occurred: list[float] = []
    for d, p, o in zip(items, parsed, outcomes, strict=True):
        if o.result is None:  # rejected, or failed transiently: not in effect yet
            continue
        ms = d.headers.get(H_PRODUCED_MS)
        if isinstance(ms, int) and not isinstance(ms, bool):
            produced.append(max(0.0, committed_at - ms / 1000))
        elif isinstance(p, Envelope):
            try:
                occurred.append(max(0.0, committed_at - datetime.fromisoformat(p.occurred_at).timestamp()))
            except (ValueError, OverflowError, OSError):
                continue
    if produced:
        observer.event_ages("produced", produced)
    if occurred:
        observer.event_ages("occurred", occurred)


@dataclass
class _Held:
    """Deliveries whose copies the broker did not accept (a dead queue or retry tier that does not
    answer: 312 NO_ROUTE, a nack, no confirm in time): held unacked, their copies sent again."""

    generation: int
    copies: list[Copy]
    why: str
    since: float
    tries: int = 1
    next_at: float = 0.0
    told: str = ""

    @property
    def tags(self) -> set[int]:
        return {c.delivery.tag for c in self.copies}


class Worker(threading.Thread):
    """Owns the database; turns deliveries into commits, copies and acks."""

    def __init__(self, config: RunConfig, observer: Observer | None = None) -> None:
        super().__init__(name=f"delivery-worker-{config.consumer}", daemon=True)
        self.config = config
        self.topology = config.topology()
        self.copies = CopyMaker(config.consumer, self.topology,
                                RetryPolicy(config.max_attempts, config.retry_delays_ms))
        self.observer = observer or Observer()
        self.stats = Stats()
        self.io: WorkerIO | None = None
        #: Deliveries received and not yet taken into a batch, in arrival order.
        self.waiting: deque[Delivery] = deque()
        self.ready = threading.Event()
        self.stop_requested = threading.Event()
        #: Set when the connection process is gone: nothing can be acked any more.
        self.abandoned = threading.Event()
        self.error: BaseException | None = None
        self.live_generation = 0
        self._given_up: set[int] = set()
        self._last_activity = time.monotonic()
        self.db: InboxDB | None = None
        self.in_flight: InFlight | None = None
        #: monotonic() when the database stopped working as a whole (None: it works).
        self._outage = Backoff(base_s=0.2, cap_s=10.0)  # the database being waited out
        #: The database's writer lock, held by this process (set by worker_main; None in memory).
        self.lock: WriterLock | None = None
        #: The database must be opened again before the next try (an I/O error, a "malformed" read).
        self._reopen = False
        #: The content tags of the connection closed after an I/O error: the file must still carry one.
        self._tags: ContentTags | None = None
        self._acked_at = 0.0
        #: A standby's whole check of the file it watched while it waited (worker_main sets it).
        self.watched: IntegrityCheck | None = None
        self._acked_rowid = -1
        self._looked_at = 0.0
        #: Deliveries held unacked until their copies are accepted (:class:`_Held`).
        self._holds: list[_Held] = []
        self._idle_said = ""  # why the last idle period did not end the run

    # -- what the connection says (WorkerIO.pump calls these) --
    def deliver_all(self, deliveries: Sequence[Delivery]) -> None:
        if not self.stats.first_delivery:
            self.stats.first_delivery = time.perf_counter()
        if self.stats.busy_since is None:
            self.stats.busy_since = time.perf_counter()
        self.waiting.extend(deliveries)

    def deliver(self, delivery: Delivery) -> None:
        self.deliver_all((delivery,))

    def channel_opened(self, generation: int) -> None:
        self.live_generation = generation
        self._last_activity = time.monotonic()
        self.observer.connection_state(True)

    def abandon(self) -> None:
        """The connection process is gone: finish what is in hand, start nothing new."""
        self.abandoned.set()
        self.stop_requested.set()

    def channel_lost(self, generation: int, why: str) -> None:
        if self.live_generation == generation:
            self.live_generation = 0
        self._drop_holds(generation)
        self.observer.connection_state(False)
        if not self.stop_requested.is_set():
            log.warning("connection lost (%s); unacked deliveries of channel %d will be redelivered", why, generation)

    # -- the thread --
    def run(self) -> None:
        if not self.open():
            return
        try:
            self._loop()
        except BaseException as exc:  # a fatal database error or a bug: stop the service
            self.error = exc
            if not isinstance(exc, DatabaseLost):  # its one line is run's last (the CLI's)
                log.error("worker stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self.close()

    def open(self) -> bool:
        """Open the database; False (and :attr:`error`) when it cannot be used. A
        database that fails as a whole (disk full, I/O error) is waited for, as
        during a run, up to the outage limit (then StoreOutage: exit 75)."""
        try:
            self.db = self._until_stored(None, self._open_db, start=True)
        except DeliveryError as exc:
            self.error = exc
            self.ready.set()
            return False
        if self.db is None:  # stopped while waiting
            self.ready.set()
            return False
        self.copies.key = seal_key(self.db)
        self.ready.set()
        self.observer.store_health(True)
        return True

    def _open_db(self) -> InboxDB:
        made_now = self.lock is not None and self.lock.created
        db = self.config.open_db(made_now=made_now, check=self.watched or True)
        try:
            if self.lock is not None:  # the file's one writer: watch its content, know when taken over
                db.superseded, db.taken_over = self.lock.superseded, self.lock.taken_over
                db.watch_content()
        except BaseException:
            db.close()
            raise
        self.in_flight = InFlight(db)
        return db

    def _let_go(self) -> None:
        """Close the database and its lock's descriptor after an I/O error, at once: a
        filesystem that failed can only be mounted again once no process holds a file of
        it (the kernel would give the failed one back); opened again before the next try."""
        if self._reopen:
            return
        self._reopen = True
        old = self.db
        if old is not None:
            self._tags = old.tags
            self.db, self.in_flight = None, None
            with suppress(Exception):  # its disk failed: closing may fail too
                old.close()
        if self.lock is not None:
            self.lock.close()
        log.warning("%s: closed after an I/O error, so that the disk can be mounted again; opened again when "
                    "it works", self.config.database_label())

    def _open_again(self) -> None:
        """After an I/O error or a "malformed" read: open the database again, as a new
        connection sees it (a remounted disk), under the writer lock taken again; a
        file that is still damaged on a disk that reads is DatabaseError (exit 2)."""
        tags = self._tags
        if self.lock is not None:
            self.lock.take_again(os.getppid(), "run")
        db = self.config.open_db(check=False)
        try:
            if self.lock is not None:  # still this writer's content (not a copy written over it)?
                db.superseded, db.taken_over = self.lock.superseded, self.lock.taken_over
                db.watch_content(tags)
            if not db.check_integrity(self.config.integrity_check_s):
                log.warning("%s: reopened; its integrity check did not finish in %gs", db.path,
                            self.config.integrity_check_s)
        except BaseException:
            db.close()
            raise
        self.db = db
        self.in_flight = InFlight(db)
        self._reopen = False
        log.warning("%s: opened again after the disk failed; it reads as sound", db.path)

    def close(self) -> None:
        """Release this process's note of work under way, close the database, end the connection."""
        self.stop_requested.set()
        if self.in_flight is not None:
            with suppress(DeliveryError):
                self.in_flight.release()
        if self.db is not None:
            with suppress(DeliveryError):
                self._record_acked(force=True)
            self.db.close()
        if self.io is not None:
            self.io.shutdown()

    def _record_acked(self, *, force: bool = False) -> None:
        """Bring the record of what was acknowledged (acked.py) up to date, at most every second."""
        db = self.db
        now = time.monotonic()
        if db is None or self.lock is None or (not force and now - self._acked_at < _LOOK_EVERY_S):
            return
        self._acked_at = now
        try:
            rowid = db.high_water()
            if rowid != self._acked_rowid:
                acked.write(db.path, db.database_id(), rowid)
                self._acked_rowid = rowid
        except sqlite3.Error:
            return  # the next batch says what is wrong with the database

    def _look(self) -> None:
        """An idle worker looks at its file every second: deleted, replaced, its content
        copied over, taken over? (A commit checks it too, before its ack.)"""
        now = time.monotonic()
        if self.db is None or now - self._looked_at < _LOOK_EVERY_S:
            return
        self._looked_at = now
        self._until_stored(None, self.db.check_file, wrote=False)
        self._record_acked()

    def _loop(self) -> None:
        assert self.io is not None
        while not self.stop_requested.is_set():
            if self._holds:
                self._retry_holds()
            batch = self._collect()
            if batch:
                self._last_activity = time.monotonic()
                self.process(batch)
                self._record_acked()
            elif self._idle_expired():
                why = self._not_drained()
                if why is None:
                    log.info("no delivery for %.1fs; exiting", self.config.exit_when_idle_s or 0)
                    return
                if why != self._idle_said:
                    self._idle_said = why
                    log.warning("no delivery for %.1fs, but %s: not exiting while the queue cannot be consumed; "
                                "looking again every %.1fs", self.config.exit_when_idle_s or 0, why,
                                self.config.exit_when_idle_s or 0)
                self._last_activity = time.monotonic()
            else:
                self._look()

    def _not_drained(self) -> str | None:
        """Why an idle ``--exit-when-idle`` run must not exit 0 yet (None: it may): its queue must
        answer, with nothing ready. A queue without quorum, or whose messages do not reach this run,
        is not an empty one (docs/run.md, "--exit-when-idle")."""
        from ..amqp.admin import queue_counts  # pika, only when asked

        queue = self.topology.queue
        try:
            state = queue_counts(self.config.url, [queue], name=f"delivery-consumer run {self.config.consumer}",
                                 timeout_s=_IDLE_CHECK_S).get(queue)
        except BrokerError as exc:
            return f"{queue} does not answer ({exc})"
        if state is None:
            return f"{queue} does not exist"
        if state.ready:
            return f"{queue} still holds {state.ready} ready messages that do not reach this run"
        return None

    def _idle_expired(self) -> bool:
        limit = self.config.exit_when_idle_s
        if limit is None or not self.live_generation or self._holds:
            return False
        return time.monotonic() - self._last_activity >= limit

    @staticmethod
    def _suspicious(d: Delivery) -> bool:
        return d.redelivered or _int_header(d.headers, H_DELIVERY_COUNT) > 0

    def _next_live(self) -> Delivery | None:
        """The first waiting delivery of the live channel (left waiting);
        those of channels that are gone are dropped: the broker redelivers them."""
        waiting = self.waiting
        while waiting:
            d = waiting[0]
            if d.generation == self.live_generation and d.generation not in self._given_up:
                return d
            waiting.popleft()
        return None

    def _collect(self) -> list[Delivery]:
        """The next batch: deliveries of one live channel, up to ``batch`` of
        them, of those already received. It never waits for more: a lone
        delivery goes at once, and what arrives during a commit makes the
        next batch. ``batch_wait_ms`` bounds how long it keeps taking
        deliveries that are still coming in."""
        assert self.io is not None
        first = self._next_live()
        if first is None:
            self.io.pump(_IDLE_WAIT_S)
            first = self._next_live()
            if first is None:
                return []
        gen, limit, waiting = first.generation, self.config.batch, self.waiting
        batch: list[Delivery] = []
        deadline = 0.0
        while True:
            while waiting and len(batch) < limit:
                if waiting[0].generation != gen:
                    return batch  # the first of the next batch stays waiting
                batch.append(waiting.popleft())
            if len(batch) >= limit:
                return batch
            now = time.monotonic()
            deadline = deadline or now + self.config.batch_wait_ms / 1000
            if now >= deadline or self.stop_requested.is_set():
                return batch
            self.io.pump(0)
            if not waiting:  # nothing more has arrived: go with what there is
                return batch

    def _pause(self, seconds: float) -> bool:
        """Wait *seconds* while listening to the connection; True when stopping."""
        assert self.io is not None
        deadline = time.monotonic() + seconds
        while not self.stop_requested.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.io.pump(min(remaining, _IDLE_WAIT_S))
        return True

    # -- one batch --
    def _parse(self, d: Delivery) -> Envelope | Rejection:
        try:
            types = None if self.db is None else self.db.spec.event_types
            return parse_message(d.body, content_type=d.content_type, headers=d.headers,
                                 max_bytes=self.config.max_bytes, content_encoding=d.content_encoding,
                                 compression=d.headers.get(KOMBU_COMPRESSION_HEADER), types=types)
        except Rejection as rej:
            return rej

    def process(self, items: list[Delivery]) -> None:
        """Handle a collected batch in delivery order (so acks stay in order):
        each delivery whose key a dead process left open alone, the others
        together."""
        opened = self._until_stored(items[0].generation, lambda: self._open_keys(items), wrote=False)
        if opened is None:
            return
        together: list[Delivery] = []
        for d in items:
            crashes = opened.get(delivery_key(d))
            if crashes is None:
                together.append(d)
                continue
            if together and not self._process_part(together):
                return
            together = []
            if not self._process_part([d], crashes):
                return
        if together:
            self._process_part(together)

    def _open_keys(self, items: list[Delivery]) -> dict[str, int]:
        """The keys of *items* left open by a process that died (crash counts).
        Only a redelivery can be one: a first delivery needs no lookup."""
        assert self.in_flight is not None
        self.in_flight.reap()
        return self.in_flight.open_keys([delivery_key(d) for d in items if self._suspicious(d)])

    def _process_part(self, items: list[Delivery], crashes: int | None = None) -> bool:
        """Apply, copy and ack *items* (one delivery alone when *crashes* is
        given). False when the rest of the batch must not go on (its channel
        was given up, the process is stopping)."""
        started = time.perf_counter()
        trace = tracing.batch(self.config.consumer, self.config.partition)
        gen = items[0].generation
        isolated = crashes is not None
        parsed = [self._parse(d) for d in items]
        trace.parsed(items, parsed)
        if crashes is not None and crashes >= self.config.max_crashes:
            answered = self._until_stored(gen, lambda: self._answered(parsed[0]), wrote=False)
            if answered is None:
                return False
            if not answered:  # a receipt answers the event whatever its crashes: no poison decision
                return self._dead_letter_poison(items[0], parsed[0], crashes)
        outcomes = self._until_stored(gen, lambda: self._apply(items, parsed, isolated))
        if outcomes is None:
            return False
        self.stats.last_commit = time.time()
        if self.db is not None and self.db.integrity is not None and not self._checked():
            return False
        trace.committed(outcomes)
        self.crashpoint("after-commit")
        self.observer.batch_committed(outcomes, time.perf_counter() - started, self.stats.last_commit)
        if self.observer.wants_ages:
            _observe_ages(self.observer, items, parsed, outcomes, self.stats.last_commit)
        copies = [c for c in (self._copy_for(d, o, p) for d, o, p in zip(items, outcomes, parsed, strict=True)) if c]
        held = self._copy_or_hold(gen, copies) if copies else set()
        if held is None:
            return False
        self._settle(gen, items, outcomes, parsed, held)
        trace.end()
        return True

    def _home(self, outcome: Outcome, parsed: Envelope | Rejection) -> int | None:
        """The partition a misplaced event belongs to (rejected ``wrong-partition`` here), else None."""
        return forwarded_to(outcome.rejection.code if outcome.rejection is not None else None,
                            parsed.key if isinstance(parsed, Envelope) else None,
                            self.db.partition if self.db is not None else None)

    def _copy_for(self, d: Delivery, outcome: Outcome, parsed: Envelope | Rejection) -> Copy | None:
        """The copy *outcome* calls for: an event of another partition is forwarded to that partition's
        queue, in the order it came (never dead-lettered: a repartition or a producer put it here)."""
        if outcome.rejection is not None and (home := self._home(outcome, parsed)) is not None:
            return self.copies.forward(d, outcome.rejection, home)
        return self.copies.for_outcome(d, outcome, parsed)

    def _checked(self) -> bool:
        """Wait, listening to the connection, for the whole integrity check of the file (run
        in the background because it took longer than the bound at open) before the first
        ack; False when stopping meanwhile. DatabaseError when it found the file damaged."""
        assert self.db is not None and self.db.integrity is not None
        check = self.db.integrity
        told = False
        while not check.verdict():
            if not told:
                log.info("%s: first ack waits for the whole integrity check (running for %.1fs)", self.db.path,
                         time.monotonic() - check.started)
                told = True
            if self._pause(_IDLE_WAIT_S):
                return False
        log.info("%s: integrity check passed in %.1fs", self.db.path, check.seconds)
        self.db.integrity = None
        return True

    def _answered(self, parsed: Envelope | Rejection) -> bool:
        assert self.db is not None
        return not isinstance(parsed, Rejection) and has_receipt(self.db, parsed.event_id)

    # -- the database failing as a whole --
    def _until_stored(self, gen: int | None, work: Callable[[], _T], *, wrote: bool = True,
                      start: bool = False) -> _T | None:
        """*work*, tried again while the database as a whole fails; None when
        the wait was given up (stopping, or channel *gen* is gone). Only work
        that *wrote* shows that the database works again. After an I/O error or
        a "malformed" read the database is opened again before the next try
        (a connection that met a failing disk keeps failing after it is back)."""
        while True:
            try:
                if self._reopen:
                    self._open_again()
                result = work()
            except DatabaseMalformed as exc:
                if start and not self._reopen:
                    raise  # a file that reads as damaged at open, on a disk that works: the check says so
                self._let_go()
                if not self._wait_for_store(StoreUnavailable(f"{exc} (after a disk failure?)", code="io-error"),
                                            gen, start=start):
                    return None
                continue
            except StoreUnavailable as exc:
                if exc.code == "io-error":
                    self._let_go()
                if not self._wait_for_store(exc, gen, start=start):
                    return None
                continue
            if self._outage.open and wrote:
                log.warning("database usable again after %.1fs; resuming", self._outage.end())
                self.observer.store_health(True)
            return result

    def _wait_for_store(self, exc: StoreUnavailable, gen: int | None, *, start: bool = False) -> bool:
        """Back off (with jitter) after a failure of the whole database; False
        when not worth waiting (stopping; channel *gen* gone: its deliveries
        come back anyway). Raises DatabaseError past the outage limit."""
        limit = self.config.store_outage_limit_s
        said = self._outage.fail(f"{exc.code}\n{exc}")
        if said == "began":
            if start:
                log.error("database unusable at start (%s): not consuming yet; retrying with backoff, giving up "
                          "after %.0fs", exc, limit)
            else:
                log.error("database unusable (%s): holding deliveries unacked, no attempt spent, nothing "
                          "dead-lettered; retrying with backoff, giving up after %.0fs", exc, limit)
            self.observer.store_health(False)
        elif said == "changed":
            log.error("database still unusable, now: %s", exc)
        lasted = self._outage.lasted()
        if lasted >= limit:
            raise StoreOutage(f"the database has been unusable for {lasted:.0f}s "
                              f"(--store-outage-limit {limit:g}s): {exc}")
        if self.stop_requested.is_set() or (gen is not None and gen != self.live_generation):
            return False
        delay = min(self._outage.delay(), limit - lasted)
        return not self._pause(delay)

    def _hooks(self) -> WorkHooks:
        def wait_for_store(exc: StoreUnavailable) -> None:
            if not self._wait_for_store(exc, None):
                raise exc

        return WorkHooks(self.in_flight, self.abandoned.is_set, wait_for_store)

    def _apply(self, items: list[Delivery], parsed: list[Envelope | Rejection], isolated: bool) -> list[Outcome]:
        """Note the keys as under way, apply the batch in one transaction
        (which clears the note) and count its deliveries durably.

        Raises StoreUnavailable when the database as a whole failed.
        """
        db, in_flight = self.db, self.in_flight
        assert db is not None and in_flight is not None
        in_flight.mark([delivery_key(d) for d in items])
        if db.spec.external is not None:  # an effect outside the database: the fence protocol (fence.py)
            marks = [DeliveryMark(delivery_key(d), d.redelivered, self.copies.attempts(d) + 1, True,
                                  _int_header(d.headers, H_DELIVERY_COUNT) + 1) for d in items]
            return db.spec.external(self.config.consumer_options)(db, parsed, marks, self._hooks())

        def count_deliveries(tx: Transaction, outcomes: list[Outcome]) -> None:
            for d, outcome, p in zip(items, outcomes, parsed, strict=True):
                if not isolated and self._first_and_applied(d, outcome):
                    continue  # its receipt says it all: delivered once, applied (see below)
                home = self._home(outcome, p)
                tx.record_delivery(
                    delivery_key(d),
                    outcome.event_id,
                    redelivered=d.redelivered,
                    attempt=self.copies.attempts(d) + 1,
                    outcome=delivery_outcome(outcome.status, home),
                    # a duplicate was delivered at least once before (its receipt says so)
                    delivered_hint=max(_int_header(d.headers, H_DELIVERY_COUNT) + 1,
                                       2 if outcome.status.startswith("duplicate:") else 1),
                )
            in_flight.clear(tx)
            tracing.mark_commit()
            self.crashpoint("before-commit")

        # Rejections are recorded once their dead-letter copy is confirmed (_publish_copies).
        return apply_batch(db, parsed, record_rejections=False, before_commit=count_deliveries)

    @staticmethod
    def _first_and_applied(d: Delivery, outcome: Outcome) -> bool:
        """True for the common case that needs no ``deliveries`` row: the first
        delivery of a first attempt, applied with a fresh result. Its receipt
        already records it (one delivery, one attempt, at received_at), and
        skipping the row halves what the commit has to write and sync (one
        random-key b-tree less). Anything else -- a redelivery, a retry, a
        duplicate, a rejection, a transient failure -- is counted in
        ``deliveries``; a later delivery of the same key starts from 2.
        """
        return (outcome.result is not None and not outcome.result.startswith("duplicate:")
                and not d.redelivered and not d.headers.get(H_ATTEMPTS)
                and not d.headers.get(H_DELIVERY_COUNT))

    def crashpoint(self, name: str) -> None:
        """A crash point of ``run`` (:mod:`delivery_consumer.model.faults`); the in-memory
        test kit makes the emulated process die here instead."""
        crashpoint(name)

    def _settle(self, gen: int, items: list[Delivery], outcomes: list[Outcome],
                parsed: Sequence[Envelope | Rejection], held: set[int] | None = None) -> None:
        """Ack *items* but those *held* (their copies not accepted yet): with one cumulative ack,
        unless a delivery held on the channel is older than the last of them (acked one by one then)."""
        assert self.io is not None
        holding = {t for h in self._holds if h.generation == gen for t in h.tags}
        if any(t <= items[-1].tag for t in holding):
            for d in items:
                if d.tag not in holding:
                    self.io.ack(gen, d.tag, multiple=False)
        else:
            self.io.ack(gen, items[-1].tag, multiple=True)
        self.stats.last_ack = now = time.perf_counter()
        if self.stats.busy_since is not None:
            self.stats.busy_s += now - self.stats.busy_since
            self.stats.busy_since = now if self.waiting else None
        self.stats.acked += len(items) - len(held or ())
        self.stats.batches += 1
        for outcome in outcomes:
            if outcome.result is not None:
                self.stats.results[outcome.result] += 1
        self._log_batch(items, outcomes, parsed)

    def _log_batch(self, items: list[Delivery], outcomes: list[Outcome],
                   parsed: Sequence[Envelope | Rejection]) -> None:
        if self.config.log_each_event:
            for d, o, p in zip(items, outcomes, parsed, strict=True):
                origin = origin_of(p)
                log.info("%s%s %s", o.event_id or "-", cloudevent_text(origin), o.status, extra={
                    "eventId": o.event_id, "outcome": o.status, "deliveryTag": d.tag,
                    "batch": f"{items[0].tag}-{items[-1].tag}", **cloudevent_fields(origin)})
            return
        counts = Counter(o.status for o in outcomes)
        summary = ", ".join(f"{n} {status}" for status, n in counts.most_common())
        ids = [o.event_id or "-" for o in outcomes]
        shown = " ".join(ids[:5]) + (f" …+{len(ids) - 5}" if len(ids) > 5 else "")
        log.info("batch %d-%d acked: %s [%s]", items[0].tag, items[-1].tag, summary, shown,
                 extra={"batch": f"{items[0].tag}-{items[-1].tag}", "deliveryTag": items[-1].tag})

    def _dead_letter_poison(self, d: Delivery, parsed: Envelope | Rejection, crashes: int) -> bool:
        """Dead-letter a message that killed the process *crashes* times, each
        time handled alone, without applying it again."""
        rejection = Rejection(
            DELIVERY_LIMIT,
            f"the process died {crashes} times while handling this message alone",
            event_id=parsed.event_id,
            fingerprint=parsed.fingerprint,
            key=parsed.key,
            origin=origin_of(parsed),
        )
        copy = self.copies.dead(d, rejection, self.copies.attempts(d) + 1)
        held = self._copy_or_hold(d.generation, [copy])
        if held is None:
            return False
        if not held:
            self._settle(d.generation, [d], [Outcome(parsed.event_id, rejection=rejection)], [parsed])
        return True

    # -- copies --
    def _confirm(self, gen: int, copies: list[Copy]) -> str | None:
        """Publish *copies* and wait for their confirms; None when every one is confirmed, else why not."""
        assert self.io is not None
        try:
            confirmed = self.io.publish_copies(gen, [c.message for c in copies])
            deadline = time.monotonic() + self.config.confirm_timeout_s
            while not confirmed.done() and not self.abandoned.is_set() and time.monotonic() < deadline:
                self.io.pump(min(deadline - time.monotonic(), _IDLE_WAIT_S))
            if not confirmed.done():
                return f"no confirm within {self.config.confirm_timeout_s:g}s"
            confirmed.result(0)
        except Exception as exc:  # BrokerUnavailable: returned (312 NO_ROUTE), nacked, or the channel is gone
            return str(exc) or type(exc).__name__
        return None

    def _copy_or_hold(self, gen: int, copies: list[Copy]) -> set[int] | None:
        """Publish *copies* (confirmed, then recorded); the delivery tags held when the broker did not
        accept them: those deliveries stay unacked and their copies are sent again with backoff
        (:meth:`_retry_holds`) while the rest is applied and acked -- a dead queue or retry tier that
        does not answer is an outage, never the message's fault: no attempt is spent. None when the
        batch must not go on (the channel is gone, the process stops): the broker redelivers it."""
        why = self._confirm(gen, copies)
        if why is None:
            self._copied(copies)
            return set()
        if gen != self.live_generation or self.stop_requested.is_set() or self.abandoned.is_set():
            log.error("could not confirm %d retry/dead copies (%s); giving up channel %d", len(copies), why, gen)
            self._given_up.add(gen)
            return None
        now = time.monotonic()
        hold = _Held(gen, copies, why, now, next_at=now + reconnect_delay_s(1))
        self._holds.append(hold)
        self._tell_held(hold)
        return hold.tags

    def _tell_held(self, hold: _Held) -> None:
        if hold.why == hold.told:
            return
        hold.told = hold.why
        for c in hold.copies:
            event_id = c.rejection.event_id if c.rejection is not None else c.event_id
            log.warning("event %s held unacked: its %s copy to %s was not accepted (%s); trying again with "
                        "backoff, no attempt spent, the other deliveries go on", event_id or "-", c.kind,
                        c.message.routing_key, hold.why,
                        extra={"eventId": event_id, "outcome": "held", "reason": hold.why,
                               "deliveryTag": c.delivery.tag, "queue": c.message.routing_key})
        self.observer.copies_held(sum(len(h.copies) for h in self._holds))

    def _retry_holds(self) -> None:
        """Send the copies of held deliveries again when their time comes; ack those now accepted."""
        now = time.monotonic()
        for hold in list(self._holds):
            if hold.generation != self.live_generation:
                self._drop_holds(hold.generation)
                continue
            if now < hold.next_at or self.stop_requested.is_set():
                continue
            why = self._confirm(hold.generation, hold.copies)
            if hold not in self._holds:  # its channel went while waiting for the confirm
                continue
            if why is not None:
                hold.why, hold.tries = why, hold.tries + 1
                hold.next_at = time.monotonic() + reconnect_delay_s(hold.tries, cap_s=_HOLD_RETRY_CAP_S)
                self._tell_held(hold)
                continue
            self._holds.remove(hold)
            self._copied(hold.copies)
            log.warning("%d held deliveries released after %.1fs: their copies were accepted", len(hold.copies),
                        time.monotonic() - hold.since)
            self._release(hold.generation, hold.copies)
            self.observer.copies_held(sum(len(h.copies) for h in self._holds))

    def _release(self, gen: int, copies: list[Copy]) -> None:
        """Ack the held deliveries of *copies*, whose copies are now accepted: cumulatively when no
        delivery still held on the channel is older."""
        assert self.io is not None
        holding = {t for h in self._holds if h.generation == gen for t in h.tags}
        for tag in sorted({c.delivery.tag for c in copies}):
            self.io.ack(gen, tag, multiple=not any(t < tag for t in holding))
            self.stats.acked += 1

    def _drop_holds(self, generation: int) -> None:
        """The channel of these held deliveries is gone: the broker redelivers them."""
        dropped = [h for h in self._holds if h.generation == generation]
        if not dropped:
            return
        self._holds = [h for h in self._holds if h.generation != generation]
        log.warning("%d held deliveries of channel %d will be redelivered (channel gone)",
                    sum(len(h.copies) for h in dropped), generation)
        self.observer.copies_held(sum(len(h.copies) for h in self._holds))

    def _copied(self, copies: list[Copy]) -> None:
        """*copies* are confirmed: count and log them, record the dead ones in ``rejected``."""
        dead = [c for c in copies if c.kind == "dead"]
        self.crashpoint("after-dead-confirm" if dead else "after-retry-confirm")
        for c in copies:
            self.observer.copy_published(c.kind, c.rejection.code if c.rejection else "retry")
            if c.kind == "forward":
                assert c.rejection is not None
                self.stats.forwarded += 1
                log.warning("event %s forwarded to %s: %s", c.rejection.event_id or "-", c.message.routing_key,
                            c.rejection.reason,
                            extra={"eventId": c.rejection.event_id, "outcome": FORWARDED, "reason": c.rejection.reason,
                                   "deliveryTag": c.delivery.tag, "queue": c.message.routing_key})
            elif c.kind == "retry":
                self.stats.retried += 1
                log.warning("event %s%s attempt %d failed transiently; retry copy sent to %s",
                            c.event_id or "-", cloudevent_text(c.origin), c.attempts, c.message.routing_key,
                            extra={"eventId": c.event_id, "outcome": "retry", "attempts": c.attempts,
                                   "deliveryTag": c.delivery.tag, "queue": c.message.routing_key,
                                   **cloudevent_fields(c.origin)})
            else:
                assert c.rejection is not None
                self.stats.dead_lettered[c.rejection.code] += 1
                self.stats.rejected[c.rejection.code] += 1
                log.warning("event %s%s rejected %s: %s; dead-lettered to %s", c.rejection.event_id or "-",
                            cloudevent_text(c.rejection.origin), c.rejection.code, c.rejection.reason,
                            c.message.routing_key,
                            extra={"eventId": c.rejection.event_id, "outcome": "dead-lettered",
                                   "code": c.rejection.code, "reason": c.rejection.reason,
                                   "attempts": c.attempts, "deliveryTag": c.delivery.tag,
                                   "queue": c.message.routing_key, "key": c.rejection.key,
                                   **cloudevent_fields(c.rejection.origin)})
        # The copies are safe in the dead queue; the ack waits for their local record.
        if dead and self._until_stored(None, lambda: self._record_dead(dead)) is None:
            log.error("dead-lettered %d events but could not record them in rejected (stopping)", len(dead))

    def _record_dead(self, dead: list[Copy]) -> bool:
        assert self.db is not None
        with self.db.transaction() as tx:
            for c in dead:
                assert c.rejection is not None
                if c.rejection.event_id is None and is_event_id(c.delivery.message_id):
                    # A body refused before its eventId could be read: our
                    # publishers set message_id = eventId, so trace can find it.
                    c.rejection.event_id = c.delivery.message_id
                tx.record_rejection(
                    c.rejection,
                    source=f"amqp:{self.topology.queue}",
                    body_sha256=body_digest(c.delivery.body),
                    attempts=c.attempts,
                    dead_letter=c.message.routing_key,
                )
        return True


