"""``run``: a consumer as a RabbitMQ service, ack only after commit.

Two processes, each owning its own connection, joined by a pipe:

* the **connection process** (the caller's) runs :class:`broker.ConsumerIO`:
  pika's I/O loop, heartbeats, deliveries in, acks and copies out;
* the **worker process** (forked at start) owns the SQLite connection: a
  reader thread unpickles deliveries as they arrive, the worker thread
  collects them into batches, parses them, applies a batch in one transaction
  (:func:`store.apply_batch`), commits, gets any retry / dead-letter copies
  confirmed, and only then asks the connection process to
  ``basic_ack(last_tag, multiple=True)``.

They are processes, not threads, because both are busy Python: in one
process they took turns on the GIL and the worker ran at half its speed.
While the worker waits for an fsync the connection keeps receiving, so the
commit overlaps the network. (Parsing elsewhere was measured slower: in the
worker's reader thread, a CPU-bound thread holds the GIL that the worker
needs back after every SQLite step; in the connection process, that process
becomes the one the worker waits for; see docs/hot-path.md.) Batches are
settled strictly in delivery-tag order and each ack is posted after the
batch before it, so a ``multiple``
ack never covers a tag whose effect is not committed or whose copy is not
confirmed. If a copy cannot be confirmed, the channel's generation is given
up: nothing more is acked on it and the connection is recycled, so the
broker redelivers and the inbox absorbs what was already applied.

If either process dies, the other stops. The worker closes the parent's end
of the pipe it inherited (else its reads never see end of file), and learns
of its parent's death from PR_SET_PDEATHSIG or a changed parent pid too; it
then starts nothing new, finishes what is in hand within ``ORPHAN_GRACE_S``
and exits, acking nothing. The connection process kills itself with the
signal that killed its worker. Design notes: docs/failures.md.

Poison: before each batch the worker notes its keys as under way
(``store.InFlight``, a commit without fsync); the batch's commit clears the
note. A note left by a process that is gone makes its keys *open*: a crash
for a key that was handled alone, a suspect for each key of a batch. A
redelivered message with an open key is handled alone (its neighbours go on
in batches); after ``max_crashes`` crashes it is dead-lettered with
``delivery-limit`` without being applied again -- unless it already has a
receipt, which answers it. The queue's ``x-delivery-limit`` remains the
broker-side backstop.

The database failing as a whole (disk full, I/O error, busy past its
timeout, read-only) is nobody's message's fault: the worker holds the batch
unacked, spends no attempt, waits with backoff and tries the same batch
again, and stops (StoreOutage: exit 75, for a supervisor to restart it)
only when the database stayed unusable for ``store_outage_limit_s``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

from . import consumers, faults
from .broker import BrokerError, BrokerUnavailable, ConsumerIO, Delivery, OutMessage
from .envelope import KOMBU_COMPRESSION_HEADER, MAX_BODY_BYTES, Envelope, body_digest, parse
from .errors import RETRIES_EXHAUSTED, DatabaseError, DeliveryError, Rejection, StoreOutage, StoreUnavailable
from .faults import crashpoint
from .partitions import Identity
from .partitions import db_path as partition_db_path
from .retry import GiveUp, RetryPolicy, attempts_done, reconnect_delay_s, retry_after_tier
from .store import (
    ConsumerDB,
    DeliveryMark,
    InFlight,
    Outcome,
    Transaction,
    WorkHooks,
    apply_batch,
    forget_in_flight,
    has_receipt,
    now_iso,
)
from .topology import (
    DEFAULT_DELIVERY_LIMIT,
    DEFAULT_EXCHANGE,
    DEFAULT_PREFIX,
    DEFAULT_RETRY_DELAYS_MS,
    H_ATTEMPTS,
    H_CONSUMER,
    H_DELIVERY_COUNT,
    H_ERROR_CODE,
    H_ERROR_REASON,
    H_FAILED_AT,
    H_ROUTING_KEY,
    Topology,
)

log = logging.getLogger("delivery_consumer.run")
_T = TypeVar("_T")

DELIVERY_LIMIT_CODE = "delivery-limit"
#: Headers the broker owns; a copy must not carry them back.
_BROKER_HEADERS = ("x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
                   "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", H_DELIVERY_COUNT)


@dataclass
class RunConfig:
    consumer: str
    url: str
    db_path: Path | None = None
    exchange: str = DEFAULT_EXCHANGE
    prefix: str = DEFAULT_PREFIX
    prefetch: int = 500
    batch: int = 250
    batch_wait_ms: int = 10
    max_attempts: int = 3
    retry_delays_ms: tuple[int, ...] = DEFAULT_RETRY_DELAYS_MS
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT
    max_crashes: int = 3
    exit_when_idle_s: float | None = None
    max_bytes: int = MAX_BODY_BYTES
    #: How long to wait for the broker to confirm a retry / dead copy.
    confirm_timeout_s: float = 30.0
    #: Options of a consumer whose effect is outside the database (webhook:
    #: webhook_url, endpoint_idempotent, timeouts); see ConsumerSpec.external.
    consumer_options: dict[str, Any] = field(default_factory=dict)
    #: Log one line per event (JSON logs) instead of one per batch.
    log_each_event: bool = False
    #: This run serves one partition of a partitioned consumer (partitions.py).
    partition: Identity | None = None
    #: How long the database may stay unusable as a whole (disk full, I/O
    #: error...) before run exits for a supervisor to act; meanwhile it
    #: holds its deliveries and retries with backoff.
    store_outage_limit_s: float = 600.0

    def topology(self) -> Topology:
        spec = consumers.get(self.consumer)
        return Topology(
            consumer=self.consumer,
            binding_keys=tuple(spec.binding_keys),
            exchange=self.exchange,
            prefix=self.prefix,
            retry_delays_ms=self.retry_delays_ms,
            delivery_limit=self.delivery_limit,
            partition=self.partition.partition if self.partition else None,
            partition_count=self.partition.count if self.partition else None,
        )

    def open_db(self) -> ConsumerDB:
        """The run's database, checked to be this consumer's (and partition's)."""
        path = self.db_path
        if path is None and self.partition is not None:
            path = partition_db_path(self.consumer, self.partition.partition)
        return ConsumerDB.open(path, self.consumer, create=True, partition=self.partition,
                               unpartitioned=self.partition is None)


@dataclass
class Stats:
    """Running totals, read by the metrics endpoint and the final log line."""

    results: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    retried: int = 0
    dead_lettered: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    acked: int = 0
    last_commit: float = 0.0
    #: perf_counter() of the first delivery handed over and of the last ack posted.
    first_delivery: float = 0.0
    last_ack: float = 0.0

    def line(self) -> str:
        done = ", ".join(f"{n} {k}" for k, n in self.results.most_common()) or "nothing applied"
        span = self.last_ack - self.first_delivery if self.acked else 0.0
        rate = f" ({self.acked / span:.0f}/s)" if span > 0 else ""
        return (f"{self.acked} deliveries acked in {self.batches} batches: {done}; {self.retried} retried, "
                f"{sum(self.dead_lettered.values())} dead-lettered; first delivery to last ack {span:.3f}s{rate}")


class Observer:
    """Hooks for metrics; the default does nothing."""

    def batch_committed(self, outcomes: Sequence[Outcome], seconds: float, committed_at: float = 0.0) -> None:
        """A batch was applied (*committed_at* is its Unix commit time, 0 if it failed)."""

    def copy_published(self, kind: str, code: str) -> None:
        """A retry or dead-letter copy was confirmed by the broker."""

    def connection_state(self, connected: bool) -> None:
        """The consumer started or stopped consuming."""

    def store_health(self, healthy: bool) -> None:
        """The database as a whole stopped (False) or started again (True) working."""


@dataclass(slots=True)
class _Copy:
    kind: str  # "retry" | "dead"
    delivery: Delivery
    message: OutMessage
    rejection: Rejection | None  # what to record in `rejected` (dead copies)
    attempts: int


def delivery_key(d: Delivery) -> str:
    """The key of a message in ``deliveries``: its message_id, or its body's hash."""
    if d.message_id and len(d.message_id) <= 128:
        return d.message_id
    return "sha256:" + body_digest(d.body)


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _looks_like_event_id(value: str | None) -> bool:
    return value is not None and _UUID.fullmatch(value) is not None


def _int_header(headers: dict[str, Any], name: str) -> int:
    value = headers.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class Worker(threading.Thread):
    """Owns the database; turns deliveries into commits, copies and acks."""

    def __init__(self, config: RunConfig, observer: Observer | None = None) -> None:
        super().__init__(name=f"delivery-worker-{config.consumer}", daemon=True)
        self.config = config
        self.topology = config.topology()
        self.policy = RetryPolicy(config.max_attempts, config.retry_delays_ms)
        self.observer = observer or Observer()
        self.stats = Stats()
        self.io: WorkerIO | None = None
        self.inbox: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self.ready = threading.Event()
        self.stop_requested = threading.Event()
        #: Set when the connection process is gone: nothing can be acked any more.
        self.abandoned = threading.Event()
        self.error: BaseException | None = None
        self.live_generation = 0
        self._given_up: set[int] = set()
        self._held: Delivery | None = None
        self._last_activity = time.monotonic()
        self.db: ConsumerDB | None = None
        self.in_flight: InFlight | None = None
        #: monotonic() when the database stopped working as a whole (None: it works).
        self._outage: float | None = None
        self._outage_tries = 0
        self._outage_code = ""

    # -- called from the loop thread --
    def deliver(self, delivery: Delivery) -> None:
        if not self.stats.first_delivery:
            self.stats.first_delivery = time.perf_counter()
        self.inbox.put(delivery)

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
        self.observer.connection_state(False)
        if not self.stop_requested.is_set():
            log.warning("connection lost (%s); unacked deliveries of channel %d will be redelivered", why, generation)

    # -- the thread --
    def run(self) -> None:
        try:
            self.db = self.config.open_db()
        except DeliveryError as exc:
            self.error = exc
            self.ready.set()
            return
        self.in_flight = InFlight(self.db)
        self.ready.set()
        self.observer.store_health(True)
        try:
            self._loop()
        except BaseException as exc:  # a fatal database error or a bug: stop the service
            self.error = exc
            log.error("worker stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self.stop_requested.set()
            self.in_flight.release()
            self.db.close()
            if self.io is not None:
                self.io.shutdown()

    def _loop(self) -> None:
        assert self.io is not None
        while not self.stop_requested.is_set():
            batch = self._collect()
            if batch:
                self._last_activity = time.monotonic()
                self._process(batch)
            elif self._idle_expired():
                log.info("no delivery for %.1fs; exiting", self.config.exit_when_idle_s or 0)
                return

    def _idle_expired(self) -> bool:
        limit = self.config.exit_when_idle_s
        if limit is None or not self.live_generation:
            return False
        return time.monotonic() - self._last_activity >= limit

    @staticmethod
    def _suspicious(d: Delivery) -> bool:
        return d.redelivered or _int_header(d.headers, H_DELIVERY_COUNT) > 0

    def _take(self, timeout: float | None) -> Delivery | None:
        """The next delivery of the live channel, or None after *timeout*."""
        if self._held is not None:
            held, self._held = self._held, None
            return held
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if deadline is None:
                    d = self.inbox.get_nowait()
                else:
                    d = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if d.generation == self.live_generation and d.generation not in self._given_up:
                return d
            # A delivery of a channel that is gone: the broker redelivers it.

    def _collect(self) -> list[Delivery]:
        first = self._take(0.2)
        if first is None:
            return []
        batch = [first]
        deadline = time.monotonic() + self.config.batch_wait_ms / 1000
        while len(batch) < self.config.batch:
            d = self._take(None)
            if d is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                d = self._take(remaining)
                if d is None:
                    break
            if d.generation != first.generation:
                self._held = d  # the first of the next batch
                break
            batch.append(d)
        return batch

    # -- one batch --
    def _parse(self, d: Delivery) -> Envelope | Rejection:
        try:
            return parse(d.body, max_bytes=self.config.max_bytes, content_encoding=d.content_encoding,
                         compression=d.headers.get(KOMBU_COMPRESSION_HEADER))
        except Rejection as rej:
            return rej

    def _process(self, items: list[Delivery]) -> None:
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
        gen = items[0].generation
        isolated = crashes is not None
        parsed = [self._parse(d) for d in items]
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
        crashpoint("after-commit")
        self.observer.batch_committed(outcomes, time.perf_counter() - started, self.stats.last_commit)
        copies = [c for c in (self._copy_for(d, o) for d, o in zip(items, outcomes, strict=True)) if c]
        if copies and not self._publish_copies(gen, copies):
            return False
        self._settle(gen, items, outcomes)
        return True

    def _answered(self, parsed: Envelope | Rejection) -> bool:
        assert self.db is not None
        return not isinstance(parsed, Rejection) and has_receipt(self.db, parsed.event_id)

    # -- the database failing as a whole --
    def _until_stored(self, gen: int | None, work: Callable[[], _T], *, wrote: bool = True) -> _T | None:
        """*work*, tried again while the database as a whole fails; None when
        the wait was given up (stopping, or channel *gen* is gone). Only work
        that *wrote* shows that the database works again."""
        while True:
            try:
                result = work()
            except StoreUnavailable as exc:
                if not self._wait_for_store(exc, gen):
                    return None
                continue
            if self._outage is not None and wrote:
                log.warning("database usable again after %.1fs; resuming", time.monotonic() - self._outage)
                self._outage = None
                self.observer.store_health(True)
            return result

    def _wait_for_store(self, exc: StoreUnavailable, gen: int | None) -> bool:
        """Back off (with jitter) after a failure of the whole database; False
        when not worth waiting (stopping; channel *gen* gone: its deliveries
        come back anyway). Raises DatabaseError past the outage limit."""
        now = time.monotonic()
        limit = self.config.store_outage_limit_s
        if self._outage is None:
            self._outage, self._outage_tries = now, 0
            log.error("database unusable (%s): holding deliveries unacked, no attempt spent, nothing "
                      "dead-lettered; retrying with backoff, giving up after %.0fs", exc, limit)
            self.observer.store_health(False)
        elif exc.code != self._outage_code:
            log.error("database still unusable, now: %s", exc)
        self._outage_code = exc.code
        if now - self._outage >= limit:
            raise StoreOutage(f"the database has been unusable for {now - self._outage:.0f}s "
                                f"(--store-outage-limit {limit:g}s): {exc}")
        if self.stop_requested.is_set() or (gen is not None and gen != self.live_generation):
            return False
        self._outage_tries += 1
        delay = min(reconnect_delay_s(self._outage_tries, base_s=0.2, cap_s=10.0), limit - (now - self._outage))
        return not self.stop_requested.wait(max(0.0, delay))

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
            marks = [DeliveryMark(delivery_key(d), d.redelivered, attempts_done(d.headers) + 1, True,
                                  _int_header(d.headers, H_DELIVERY_COUNT) + 1) for d in items]
            return db.spec.external(self.config.consumer_options)(db, parsed, marks, self._hooks())

        def count_deliveries(tx: Transaction, outcomes: list[Outcome]) -> None:
            for d, outcome in zip(items, outcomes, strict=True):
                if not isolated and self._first_and_applied(d, outcome):
                    continue  # its receipt says it all: delivered once, applied (see below)
                tx.record_delivery(
                    delivery_key(d),
                    outcome.event_id,
                    redelivered=d.redelivered,
                    attempt=attempts_done(d.headers) + 1,
                    outcome=outcome.status,
                    # a duplicate was delivered at least once before (its receipt says so)
                    delivered_hint=max(_int_header(d.headers, H_DELIVERY_COUNT) + 1,
                                       2 if outcome.status.startswith("duplicate:") else 1),
                )
            in_flight.clear(tx)
            crashpoint("before-commit")

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

    def _settle(self, gen: int, items: list[Delivery], outcomes: list[Outcome]) -> None:
        assert self.io is not None
        self.io.ack(gen, items[-1].tag, multiple=True)
        self.stats.last_ack = time.perf_counter()
        self.stats.acked += len(items)
        self.stats.batches += 1
        for outcome in outcomes:
            if outcome.result is not None:
                self.stats.results[outcome.result] += 1
        self._log_batch(items, outcomes)

    def _log_batch(self, items: list[Delivery], outcomes: list[Outcome]) -> None:
        if self.config.log_each_event:
            for d, o in zip(items, outcomes, strict=True):
                log.info("%s %s", o.event_id or "-", o.status, extra={
                    "eventId": o.event_id, "outcome": o.status, "deliveryTag": d.tag,
                    "batch": f"{items[0].tag}-{items[-1].tag}"})
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
            DELIVERY_LIMIT_CODE,
            f"the process died {crashes} times while handling this message alone",
            event_id=parsed.event_id,
            fingerprint=parsed.fingerprint,
        )
        copy = self._dead_copy(d, rejection, attempts_done(d.headers) + 1)
        if not self._publish_copies(d.generation, [copy]):
            return False
        self._settle(d.generation, [d], [Outcome(parsed.event_id, rejection=rejection)])
        return True

    # -- copies --
    def _copy_for(self, d: Delivery, outcome: Outcome) -> _Copy | None:
        attempt = attempts_done(d.headers) + 1
        if outcome.rejection is not None:
            return self._dead_copy(d, outcome.rejection, attempt)
        if outcome.transient is None:
            return None
        decision = self.policy.after_failure(attempt)
        if isinstance(decision, GiveUp):
            rejection = Rejection(
                RETRIES_EXHAUSTED,
                f"{outcome.transient.code} after {attempt} attempts: {outcome.transient.reason}",
                event_id=outcome.event_id,
            )
            return self._dead_copy(d, rejection, attempt)
        if outcome.transient.retry_after_s is not None:  # e.g. an HTTP 429's Retry-After (webhook)
            decision = retry_after_tier(decision, self.topology.retry_delays_ms, outcome.transient.retry_after_s)
        headers = self._headers(d)
        headers[H_ATTEMPTS] = decision.attempts
        headers["x-last-error"] = outcome.transient.reason
        message = OutMessage(
            routing_key=self.topology.retry_queue(decision.tier),
            body=d.body,
            message_id=d.message_id,
            headers=headers,
            content_type=d.content_type or "application/json",
            content_encoding=d.content_encoding,
        )
        return _Copy("retry", d, message, None, attempt)

    def _headers(self, d: Delivery) -> dict[str, Any]:
        headers = {k: v for k, v in d.headers.items() if k not in _BROKER_HEADERS}
        headers.setdefault(H_ROUTING_KEY, d.routing_key)
        headers[H_CONSUMER] = self.config.consumer
        return headers

    def _dead_copy(self, d: Delivery, rejection: Rejection, attempt: int) -> _Copy:
        headers = self._headers(d)
        headers.update({
            H_ERROR_CODE: rejection.code,
            H_ERROR_REASON: rejection.reason,
            H_ATTEMPTS: attempt,
            H_FAILED_AT: now_iso(),
        })
        message = OutMessage(
            routing_key=self.topology.dead_queue,
            body=d.body,
            message_id=d.message_id or rejection.event_id,
            headers=headers,
            content_type=d.content_type or "application/octet-stream",
            content_encoding=d.content_encoding,
        )
        return _Copy("dead", d, message, rejection, attempt)

    def _publish_copies(self, gen: int, copies: list[_Copy]) -> bool:
        """Publish and confirm *copies*, then record the dead ones in ``rejected``.

        False when a copy could not be confirmed: the channel is given up
        (nothing more is acked on it) and the connection recycled.
        """
        assert self.io is not None and self.db is not None
        try:
            self.io.publish_copies(gen, [c.message for c in copies]).result(self.config.confirm_timeout_s)
        except Exception as exc:  # BrokerUnavailable, or a timeout waiting for the confirm
            why = str(exc) or type(exc).__name__
            log.error("could not confirm %d retry/dead copies (%s); giving up channel %d", len(copies), why, gen)
            self._given_up.add(gen)
            self.io.reconnect("a copy was not confirmed")
            return False
        dead = [c for c in copies if c.kind == "dead"]
        crashpoint("after-dead-confirm" if dead else "after-retry-confirm")
        for c in copies:
            self.observer.copy_published(c.kind, c.rejection.code if c.rejection else "retry")
            if c.kind == "retry":
                self.stats.retried += 1
                log.warning("event %s attempt %d failed transiently; retry copy sent to %s",
                            c.message.message_id or "-", c.attempts, c.message.routing_key,
                            extra={"eventId": c.message.message_id, "outcome": "retry", "attempts": c.attempts,
                                   "deliveryTag": c.delivery.tag, "queue": c.message.routing_key})
            else:
                assert c.rejection is not None
                self.stats.dead_lettered[c.rejection.code] += 1
                self.stats.rejected[c.rejection.code] += 1
                log.warning("event %s rejected %s: %s; dead-lettered to %s", c.rejection.event_id or "-",
                            c.rejection.code, c.rejection.reason, c.message.routing_key,
                            extra={"eventId": c.rejection.event_id, "outcome": "dead-lettered",
                                   "code": c.rejection.code, "reason": c.rejection.reason,
                                   "attempts": c.attempts, "deliveryTag": c.delivery.tag,
                                   "queue": c.message.routing_key})
        # The copies are safe in the dead queue; the ack waits for their local record.
        if dead and self._until_stored(None, lambda: self._record_dead(dead)) is None:
            log.error("dead-lettered %d events but could not record them in rejected (stopping)", len(dead))
        return True

    def _record_dead(self, dead: list[_Copy]) -> bool:
        assert self.db is not None
        with self.db.transaction() as tx:
            for c in dead:
                assert c.rejection is not None
                if c.rejection.event_id is None and _looks_like_event_id(c.delivery.message_id):
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


# -- the two processes of run ----------------------------------------------------------
#
# The worker (SQLite, parsing, validation) runs in a child process and the
# connection (pika) in the parent, so that neither waits for the other's GIL:
# with both in one process the worker ran at half its own speed. They talk
# over a pipe. Parent -> child: ("deliveries", [tuples]), ("channel", gen),
# ("lost", gen, why), ("published", request, error), ("stop",). Child ->
# parent: ("ready",), ("fatal", message[, "outage"]), ("ack", gen, tag, multiple),
# ("publish", request, gen, messages), ("reconnect", why), ("cancel",),
# ("shutdown",). Acks still happen only on the connection's own thread, and
# only after the child committed.


class WorkerIO(Protocol):
    """What the worker asks of the connection (see broker.ConsumerIO)."""

    def ack(self, generation: int, tag: int, *, multiple: bool = True) -> None: ...

    def publish_copies(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]: ...

    def reconnect(self, why: str) -> None: ...

    def shutdown(self) -> None: ...


class _ParentProxy:
    """The child's handle on the parent's connection: every call is a message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._requests: dict[int, Future[None]] = {}
        self._next = 0
        self.gone = False

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            if self.gone:
                return
            try:
                self._conn.send(message)
            except OSError:  # the parent died: nothing can be acked any more
                self.gone = True

    def ack(self, generation: int, tag: int, *, multiple: bool = True) -> None:
        self._send(("ack", generation, tag, multiple))

    def publish_copies(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            self._next += 1
            request = self._next
            self._requests[request] = future
        self._send(("publish", request, generation, list(messages)))
        if self.gone:
            self.settle(request, "the connection process is gone")
        return future

    def settle(self, request: int, error: str | None) -> None:
        with self._lock:
            future = self._requests.pop(request, None)
        if future is None or future.done():
            return
        if error:
            future.set_exception(BrokerUnavailable(error))
        else:
            future.set_result(None)

    def fail_all(self, why: str) -> None:
        with self._lock:
            requests = list(self._requests)
        for request in requests:
            self.settle(request, why)

    def reconnect(self, why: str) -> None:
        self._send(("reconnect", why))

    def shutdown(self) -> None:
        self._send(("shutdown",))


#: How long the worker may take to finish what is in hand once the connection
#: process is gone (it can ack nothing more) before it exits regardless.
ORPHAN_GRACE_S = 2.0
#: How often the worker process looks at its parent (besides PR_SET_PDEATHSIG).
_PARENT_CHECK_S = 0.2
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], bool]:
    """Make the kernel tell this process when *parent* dies (Linux
    ``PR_SET_PDEATHSIG``, as SIGUSR1); returns a check that is True once it
    is gone (the signal arrived, or the parent pid changed: the portable
    fallback). The pipe's end of file says so too, but only to a reader; a
    worker blocked elsewhere must learn it as well."""
    told = [False]

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        told[0] = True

    signal.signal(signal.SIGUSR1, on_signal)
    with suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    return lambda: told[0] or os.getppid() != parent


def _child(config: RunConfig, conn: Connection, parent_end: Connection,
           observer_factory: ObserverFactory | None) -> None:
    """The worker process: the database, batches, commits; asks the parent to ack."""
    # The parent's end of the pipe came with the fork: held here, it would keep
    # the pipe open after the parent's death and recv() would never end.
    parent_end.close()
    # The parent coordinates stopping (it gets SIGTERM/SIGINT and tells us);
    # a Ctrl-C to the whole process group must not kill a transaction.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    parent_gone = _die_with_parent(parent)
    faults.also_kill(parent)  # a crash point kills the whole of run
    proxy = _ParentProxy(conn)
    try:
        observer = observer_factory() if observer_factory is not None else None
    except DeliveryError as exc:
        conn.send(("fatal", str(exc)))
        return
    worker = Worker(config, observer)
    worker.io = proxy
    worker.start()
    worker.ready.wait()
    if worker.error is not None:
        conn.send(("fatal", str(worker.error)))
        return
    conn.send(("ready",))

    def orphaned() -> None:
        # Nothing can be acked any more: finish what is in hand, start nothing
        # new; the broker redelivers the rest to the next run.
        proxy.gone = True
        proxy.fail_all("the connection process is gone")
        worker.abandon()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                orphaned()
                return
            kind = message[0]
            if kind == "deliveries":
                for d in message[1]:
                    worker.deliver(Delivery(*d))
            elif kind == "channel":
                worker.channel_opened(message[1])
            elif kind == "lost":
                worker.channel_lost(message[1], message[2])
            elif kind == "published":
                proxy.settle(message[1], message[2])
            elif kind == "stop":
                worker.stop_requested.set()

    threading.Thread(target=read, name="delivery-pipe", daemon=True).start()
    deadline: float | None = None
    while worker.is_alive():
        worker.join(_PARENT_CHECK_S)
        if deadline is None and (worker.abandoned.is_set() or parent_gone()):
            log.error("the connection process is gone; finishing what is in hand, acking nothing")
            orphaned()
            deadline = time.monotonic() + ORPHAN_GRACE_S
        elif deadline is not None and time.monotonic() > deadline and worker.is_alive():
            log.error("the worker did not stop within %.0fs of the connection process; exiting now", ORPHAN_GRACE_S)
            if worker.in_flight is not None:  # leaving on purpose: not a crash of what is under way
                forget_in_flight(worker.in_flight.db.path, worker.in_flight.owner)
            os._exit(1)  # like a crash: SQLite rolls back what was not committed
    log.info("exiting: %s", worker.stats.line())
    if worker.error is not None:
        error = worker.error
        text = str(error) if isinstance(error, DeliveryError) else f"worker failed: {type(error).__name__}: {error}"
        proxy._send(("fatal", text, "outage") if isinstance(error, StoreOutage) else ("fatal", text))


class _ChildLink:
    """The parent's side of the pipe, driven by the connection's I/O loop."""

    def __init__(self, conn: Connection, process: BaseProcess) -> None:
        self.conn = conn
        self.process = process
        self.io: ConsumerIO | None = None
        self.fatal: str | None = None
        self.outage = False  # the fatal error is a StoreOutage
        self.closed = False
        self._pending: list[tuple[Any, ...]] = []

    # deliveries: buffered and sent once per turn of the loop
    def deliver(self, d: Delivery) -> None:
        if not self._pending:
            assert self.io is not None
            self.io.soon(self._flush)
        self._pending.append((d.generation, d.tag, d.body, d.routing_key, d.redelivered, d.message_id,
                              d.headers, d.content_type, d.exchange, d.content_encoding))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        self._send(("deliveries", pending))

    def _send(self, message: tuple[Any, ...]) -> None:
        if self.closed:
            return
        try:
            self.conn.send(message)
        except OSError:
            self._child_gone()

    def channel(self, generation: int) -> None:
        self._send(("channel", generation))

    def lost(self, generation: int, why: str) -> None:
        self._send(("lost", generation, why))

    def stop(self) -> None:
        self._send(("stop",))

    # messages from the child
    def readable(self) -> None:
        io = self.io
        assert io is not None
        try:
            while not self.closed and self.conn.poll():
                message = self.conn.recv()
                kind = message[0]
                if kind == "ack":
                    io.ack_now(message[1], message[2], multiple=message[3])
                elif kind == "publish":
                    request = message[1]
                    future = io.publish_now(message[2], message[3])
                    future.add_done_callback(partial(self._published, request))
                    crashpoint("connection-awaiting-confirm")  # kills this process alone
                elif kind == "reconnect":
                    io.reconnect_now(message[1])
                elif kind == "shutdown":
                    io.shutdown_now()
                elif kind == "fatal":
                    self.fatal, self.outage = message[1], message[-1] == "outage"
        except (EOFError, OSError):
            self._child_gone()

    def _published(self, request: int, future: Future[None]) -> None:
        error = future.exception()
        self._send(("published", request, str(error) if error else None))

    def _child_gone(self) -> None:
        if self.closed:
            return
        self.closed = True
        assert self.io is not None
        with suppress(Exception):  # the loop may be closing already
            self.io.unwatch(self.conn.fileno())
        self.process.join(5)
        code = self.process.exitcode
        if code is not None and code < 0:
            # The worker was killed by a signal (a crash, the OOM killer): so is
            # run, at once and without acking anything more. The broker
            # redelivers every unacked message; the inbox absorbs them.
            log.error("worker process killed by %s; stopping without acking", signal.Signals(-code).name)
            os.kill(os.getpid(), -code)
        self.io.shutdown_now()


ObserverFactory = Callable[[], Observer]


def run(config: RunConfig, observer_factory: ObserverFactory | None = None) -> int:
    """Run the consumer until SIGTERM/SIGINT or idle; returns the exit code.

    Starts the worker process (database) and runs the connection in this
    one. Raises DatabaseError or BrokerError (fatal) for the CLI to report,
    StoreOutage when the database stayed unusable past the outage limit.
    *observer_factory* is called in the worker process (metrics live there).
    """
    topology = config.topology()
    context = multiprocessing.get_context("fork")  # before any connection or thread exists
    parent_end, child_end = context.Pipe(duplex=True)
    process = context.Process(target=_child, args=(config, child_end, parent_end, observer_factory),
                              name=f"delivery-worker-{config.consumer}")
    process.start()
    child_end.close()
    link = _ChildLink(parent_end, process)
    try:
        first = parent_end.recv()
    except EOFError:
        process.join()
        raise DatabaseError(f"the worker process exited at start-up (exit code {process.exitcode})") from None
    if first[0] == "fatal":
        process.join()
        raise DatabaseError(first[1])
    io = ConsumerIO(
        config.url,
        topology,
        prefetch=config.prefetch,
        on_delivery=link.deliver,
        on_channel=link.channel,
        on_lost=link.lost,
        name=f"delivery-consumer run {config.consumer}",
        # a one-shot run (--exit-when-idle) must not wait forever for a broker it never reached
        retry_first_connect=config.exit_when_idle_s is None,
    )
    link.io = io
    io.watch(parent_end.fileno(), link.readable)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s received: finishing the current batch", signal.Signals(signum).name)
        link.stop()
        io.cancel()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        io.run()
    except BrokerError:
        link.stop()
        process.join(10)
        if process.is_alive():
            process.terminate()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    # The loop ended because the worker asked for it (idle, stop, fatal) or is
    # gone. Read what it still has to say (its last acks are moot now: the
    # connection is closed and the broker will redeliver those messages).
    while not link.closed:
        try:
            if not parent_end.poll(0.1):
                if not process.is_alive():
                    break
                continue
            message = parent_end.recv()
        except (EOFError, OSError):
            break
        if message[0] == "fatal":
            link.fatal, link.outage = message[1], message[-1] == "outage"
    process.join(30)
    if process.is_alive():
        process.terminate()
        process.join()
    if link.fatal is not None:
        raise (StoreOutage if link.outage else DatabaseError)(link.fatal)
    if process.exitcode:
        raise DatabaseError(f"the worker process exited with code {process.exitcode}")
    return 0


__all__ = ["BrokerUnavailable", "Observer", "RunConfig", "Stats", "Worker", "run"]
