"""The dispatcher: moves the outbox's pending rows to RabbitMQ, at least once.

Each round claims a batch under a lease (one write transaction), publishes it
persistent and mandatory (``message_id`` = eventId, pipelined confirms) and
marks ``published_at`` only for confirmed rows; the inbox absorbs duplicates.
Rounds, leases, order per article, failures and crash points: docs/outbox.md;
the same logic on SQLite and on PostgreSQL (:mod:`.db`): the same page.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from ..amqp.backoff import Backoff
from ..amqp.partitions import slot_headers
from ..amqp.retry import RECONNECT_CAP_S, reconnect_delay_s
from ..amqp.topology import H_PRODUCED_MS
from ..model.deliveries import OutMessage
from ..model.errors import BrokerUnavailable, DeliveryError, TransientError, safe_reason
from ..model.faults import crashpoint
from ..model.plural import count
from ..observability import tracing
from ..store.sqlite import now_iso
from . import owners, wake
from .db import OutboxDb, WakeListener, as_db
from .outage import PROBE_CAP_S, PROBE_ROWS, Destination, Outage, describe, destination, own_nacks
from .table import MAX_ERROR_CHARS, routing_key_problem

if TYPE_CHECKING:
    from ..model.deliveries import PublishResult

log = logging.getLogger("delivery_consumer.dispatch")

#: Publication results that retrying the same row cannot change.
PERMANENT: Final = frozenset({"returned", "unencodable"})
#: How often (seconds of the dispatcher's clock) registered owners are checked for death.
REAP_EVERY_S: Final = 1.0
#: A connect or a batch's confirms waiting this long (seconds) is logged, once, and so is its end.
STALL_LOG_S = 5.0
#: Rows of the first batch after a reconnect during an outage (the probe; one batch in
#: flight): confirms that never come cost the fewest rows (duplicates if they come late).
LINK_PROBE_ROWS: Final = 10


@contextmanager
def _logged_if_slow(what: str) -> Iterator[None]:
    """Log once when the block has waited STALL_LOG_S for the broker, and again when it ends
    (a blackholed or half-open broker is otherwise silent until the publisher's timeout)."""
    started, lock, state = time.monotonic(), threading.Lock(), {"done": False, "warned": False}

    def warn() -> None:
        with lock:
            if not state["done"]:
                state["warned"] = True
                log.warning("%s: no answer from the broker for %.0fs (stalled, or a half-open connection?)",
                            what, time.monotonic() - started)

    timer = threading.Timer(STALL_LOG_S, warn)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
        if state["warned"]:
            log.warning("%s: the broker's answer came after %.1fs", what, time.monotonic() - started)


class PublisherLike(Protocol):
    """What the dispatcher needs of :class:`delivery_consumer.amqp.publisher.StreamPublisher`:
    batches sent one behind the other on one channel, collected in order."""

    def connect(self) -> None: ...

    def send(self, messages: Sequence[OutMessage]) -> Any: ...

    def collect(self, ticket: Any) -> list[PublishResult]: ...

    def wait(self, ticket: Any, wake: int) -> bool:
        """Service the connection until *ticket* is settled (True) or the
        file descriptor *wake* is readable (False)."""

    def idle(self, seconds: float, wake: int | None = None) -> None:
        """Service the connection for *seconds*, or until the file
        descriptor *wake* is readable."""

    def renew_channel(self) -> None:
        """Publish on a new channel of the connection from now on (nothing
        in flight); raises BrokerUnavailable when the connection fails."""


class Claimed(NamedTuple):
    """One row leased by this dispatcher (a tuple: made once per row, cheaply)."""

    seq: int
    event_id: str
    routing_key: str
    body: bytes
    attempts: int
    #: The event's key (articleId, orderId, ...): the message carries its slot (partitions.py).
    ordering_key: str = ""
    #: When the producer wrote the row, in milliseconds since the epoch (None:
    #: ``created_at`` is not a time): the message carries it (``x-produced-ms``),
    #: for the consumers' age at commit.
    produced_ms: int | None = None


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
    #: The timed poll: the fallback for commits that wake no dispatcher
    #: (another host, a producer committing on its own, a lost wake-up).
    poll_s: float = 0.5
    #: Listen for wake-ups from producers' commits on this host (.wake).
    wake: bool = True
    #: Exit after this long without progress (a row published or quarantined).
    exit_when_idle_s: float | None = None
    #: Backoff of a row's transient failures: base * 2^(n-1), jittered, capped.
    retry_base_s: float = 1.0
    retry_cap_s: float = 300.0
    #: Transient failures of one row (nacks) before it is quarantined; with
    #: the default backoff, 20 take half an hour to an hour.
    max_attempts: int = 20
    #: How often a running dispatcher proves it is alive (see .owners).
    heartbeat_s: float = 2.0
    owner: str = field(default_factory=lambda: default_owner())

    def __post_init__(self) -> None:
        if self.batch < 1 or self.batch_bytes < 1 or self.depth < 1 or self.max_attempts < 1:
            raise ValueError("batch, batch_bytes, depth and max_attempts must be >= 1")
        if min(self.lease_s, self.poll_s, self.retry_base_s, self.retry_cap_s, self.heartbeat_s) <= 0:
            raise ValueError("lease, poll, retry and heartbeat durations must be positive")
        problem = routing_key_problem(self.exchange)
        if problem is not None:
            raise ValueError(f"exchange name: {problem.removeprefix('routing key ')}")

    @property
    def publish_timeout_s(self) -> float:
        """The publisher's timeout: a connect plus the confirms of every
        batch in flight fit in the lease with room to spare, so a live
        dispatcher never outlives its lease."""
        return max(0.5, min(30.0, self.lease_s / (self.depth + 2)))


def _own_nacks(rows: Sequence[Claimed], results: Sequence[PublishResult]) -> set[int]:
    """Indexes of the nacks of *results* that are their row's own (:func:`.outage.own_nacks`)."""
    if not any(r.status == "nacked" for r in results):
        return set()
    return own_nacks([destination(r.routing_key, r.ordering_key) for r in rows], [r.status for r in results])


def default_owner() -> str:
    """A dispatcher's lease owner id: host, pid and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class DispatchStats:
    """Totals of one dispatcher run (the exit line and the benchmark read them)."""

    results: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    outages: int = 0
    #: Rows this dispatcher quarantined (a permanent failure, or max_attempts).
    quarantined: int = 0
    #: Whether the broker was reached at least once, and the last outage's reason.
    connected: bool = False
    last_outage: str = ""
    #: Whether the broker answers now (the ``outbox_dispatch_connected`` gauge).
    online: bool = False
    #: Whether an outage is open (the ``outbox_dispatch_outage`` gauge): no
    #: connection, confirms lost, or destinations that nack everything.
    in_outage: bool = False
    #: time.perf_counter() of the first claim and of the last mark.
    first_claim: float = 0.0
    last_mark: float = 0.0

    @property
    def published(self) -> int:
        return self.results["confirmed"]

    @property
    def progress(self) -> int:
        """Rows that left the stream for good: published or quarantined."""
        return self.published + self.quarantined

    def line(self) -> str:
        span = self.last_mark - self.first_claim if self.batches else 0.0
        rate = f" ({self.published / span:.0f}/s)" if span > 0 and self.published else ""
        failed = ", ".join(f"{n} {k}" for k, n in sorted(self.results.items()) if k != "confirmed") or "0 failed"
        return (f"{self.published} published in {count(self.batches, 'batch', 'batches')}, {failed}, "
                f"{self.quarantined} quarantined; {count(self.outages, 'broker outage')}; first claim to last mark "
                f"{span:.3f}s{rate}")


#: How often (seconds) a dispatcher whose wake-up source broke tries to listen again.
RELISTEN_S: Final = 5.0


class Dispatcher:
    """Moves outbox rows to the broker; one per process, single-threaded
    (plus the heartbeat thread of :meth:`run`).

    *conn* must be this thread's own writable connection: a sqlite3 one
    (:func:`~delivery_consumer.outbox.connect`) or an :class:`.db.OutboxDb`
    (:func:`.db.open_db`: SQLite or PostgreSQL); *publisher* is a
    :class:`delivery_consumer.amqp.publisher.StreamPublisher` (or a fake in tests);
    *clock* (seconds since the epoch) and *sleep* are replaceable for tests.
    """

    def __init__(
        self,
        conn: Any,
        publisher: PublisherLike,
        config: DispatchConfig,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.conn = conn
        self.db: OutboxDb = as_db(conn)
        self.publisher = publisher
        self.config = config
        self.clock = clock
        self.sleep = sleep or self._nap
        self.stats = DispatchStats()
        self.stopping = False
        self.identity = owners.Identity.mine(config.owner)
        self._link = Backoff()  # consecutive broker failures, for the backoff
        self._db_wait = Backoff()  # consecutive database-busy failures
        self._connected = False
        self._episode: Outage | None = None  # the outage being waited out (.outage)
        self._probes: set[int] = set()  # seqs in flight as probes of refusing destinations
        # The channel met a nack storm: a probe goes on a new one (a channel can stay refused, docs/outbox.md).
        self._stale_channel = False
        # During an outage a claim that found nothing is not repeated before this (the clock's) time,
        # wake-ups or not, unless a probe is due: every claim scans the rows waiting on the outage.
        self._scan_at = float("-inf")
        #: The rows of the last batch marked whose nacks were their destination's, not their own.
        self.storm_nacked: set[int] = set()
        self._inflight: deque[tuple[list[Claimed], Any]] = deque()  # sent, not yet collected
        self._reaped_at = float("-inf")
        self._good_keys: set[str] = set()  # routing keys already checked and found good
        self._idle_deadline: float | None = None  # when run() gives up for want of progress
        self._listener: WakeListener | None = None  # producers' commits wake run() (see run)
        self._listen_at = float("inf")  # when to try listening again after the wake-up source broke
        # Batches published whose mark failed (the database went away): marked first when it is back.
        self._unmarked: deque[tuple[list[Claimed], list[PublishResult]]] = deque()

    def stop(self) -> None:
        """Claim no more; :meth:`run` settles the batches in flight and returns (signal-safe)."""
        self.stopping = True

    # -- claim and mark (each one BEGIN IMMEDIATE transaction) --

    def _key_problem(self, key: str) -> str | None:
        """routing_key_problem, remembering good keys (a few, used by every row)."""
        problem = routing_key_problem(key)
        if problem is None:
            if len(self._good_keys) > 10_000:
                self._good_keys.clear()
            self._good_keys.add(key)
        return problem

    def claim(self, limit: int | None = None) -> list[Claimed]:
        """Lease up to ``batch`` (or *limit*) publishable rows, in creation order.

        A row is publishable when it is pending, not under a live lease, past
        its backoff, and no earlier pending row of its ordering key is under
        a live lease (another dispatcher's, or this one's batch in flight),
        waiting for its backoff, or being retried in this batch. A row whose
        routing key AMQP cannot carry is quarantined here. Leases of owners
        known dead are taken back first (:func:`.owners.reap`). Raises
        DatabaseLost, claiming nothing, once the database file was deleted or
        replaced: nothing more is published from a file nobody else will read.

        During an outage the rows of a destination that refuses (nacks
        everything) are not claimed, and hold their keys, except for its
        probe when one is due: its oldest waiting rows, of different keys
        (:data:`.outage.PROBE_ROWS`). A destination none of whose rows is
        found waiting any more is let go.
        """
        db = self.db
        db.check_alive()
        now = self.clock()
        if now - self._reaped_at >= REAP_EVERY_S:
            self._reaped_at = now
            owners.reap(db, self.identity, now)
        now_s, until = now_iso(now), now_iso(now + self.config.lease_s)
        taken: list[Claimed] = []
        expired: list[tuple[str, int]] = []
        invalid: list[tuple[str, str, int]] = []
        batch = self.config.batch if limit is None else max(1, min(limit, self.config.batch))
        episode = self._episode
        refused = episode.refused if episode is not None else {}
        probing = bool(refused) and episode is not None and episode.probe_at <= now
        # An idle poll only reads: the write lock (which the producer needs
        # for its own transactions) is taken only when some row is due.
        due = db.execute(
            "SELECT 1 FROM outbox WHERE status = 'pending' AND coalesce(next_attempt_at, '') <= ?1"
            " AND coalesce(lease_until, '') <= ?1 LIMIT 1", (now_s,)).fetchone()
        if due is None:
            if probing and not self._inflight:  # nothing of the refusing destinations waits any more
                refused.clear()
                self._maybe_end()
            return taken
        good = self._good_keys
        probed: dict[Destination, int] = {}  # refusing destination -> rows taken as its probe
        seen: set[Destination] = set()  # refusing destinations with a row waiting
        complete = True  # the scan saw every pending row
        with db.transaction() as conn:
            conn.lock_claims()
            blocked: set[str] = set()
            size = 0
            # The body itself, or its size when the backend fetches the bodies of the rows taken apart
            # (a server would otherwise send the bodies of every leased row the scan passes).
            apart = conn.body_sql != "body"
            cur = conn.scan(
                f"SELECT seq, event_id, routing_key, ordering_key, {conn.body_sql}, attempts, next_attempt_at,"
                f" lease_owner, lease_until, {conn.created_ms_sql} FROM outbox WHERE status = 'pending' ORDER BY seq",
                (), batch * 2)
            try:
                for seq, event_id, routing_key, key, body, attempts, next_at, owner, lease_until, created in cur:
                    if key in blocked:
                        continue
                    if (next_at is not None and next_at > now_s) or (lease_until is not None and lease_until > now_s):
                        blocked.add(key)
                        if refused and owner == self.config.owner:  # in flight here: it still waits on it
                            seen.add(destination(routing_key, key))
                        continue
                    if routing_key not in good and (problem := self._key_problem(routing_key)) is not None:
                        reason = safe_reason(f"invalid: {problem}", MAX_ERROR_CHARS)
                        invalid.append((reason, now_s, seq))
                        continue
                    if refused and (dest := destination(routing_key, key)) in refused:
                        # It waits on the outage, and so do the later rows of its key.
                        seen.add(dest)
                        blocked.add(key)
                        if not probing or probed.get(dest, 0) >= PROBE_ROWS:
                            continue
                        probed[dest] = probed.get(dest, 0) + 1
                    length = body if apart else len(body)
                    if taken and size + length > self.config.batch_bytes:
                        complete = False
                        break
                    size += length
                    taken.append(Claimed(seq, event_id, routing_key, b"" if apart else body, attempts, key, created))
                    if key in blocked:  # a probe
                        self._probes.add(seq)
                    elif next_at is not None:  # a retry goes out alone for its article
                        blocked.add(key)
                    if owner is not None:
                        expired.append((safe_reason(f"lease of {owner} expired before it marked this row",
                                                    MAX_ERROR_CHARS), seq))
                    if len(taken) >= batch:
                        complete = False
                        break
            finally:
                cur.close()
            if taken:
                seqs = conn.seqs(row.seq for row in taken)
                conn.execute(f"UPDATE outbox SET lease_owner = ?, lease_until = ? WHERE {conn.seq_in_sql}",
                             (self.config.owner, until, seqs))
                if apart:
                    bodies = dict(conn.execute(f"SELECT seq, body FROM outbox WHERE {conn.seq_in_sql}",
                                               (seqs,)).fetchall())
                    taken = [row._replace(body=bytes(bodies[row.seq])) for row in taken]
            conn.executemany("UPDATE outbox SET last_error = ? WHERE seq = ?", expired)
            conn.executemany(
                "UPDATE outbox SET status = 'quarantined', quarantined_at = ?2, quarantine_reason = ?1,"
                " last_error = ?1, lease_owner = NULL, lease_until = NULL WHERE seq = ?3 AND status = 'pending'",
                invalid)
        if expired:
            log.warning("claimed %d rows whose previous dispatcher died or stalled holding them", len(expired))
        if invalid:
            self.stats.quarantined += len(invalid)
            log.warning("quarantined %d rows at claim: %s", len(invalid), invalid[0][0])
        # A claim during an outage that took nothing is not repeated for a poll (see _quiet).
        self._scan_at = now + self.config.poll_s if refused and not taken and not invalid else float("-inf")
        if probing and episode is not None:
            if probed:
                episode.probes += 1
                episode.probe_at = float("inf")  # the next one is scheduled when this one is settled
            if complete:  # nothing of theirs waits here any more (published elsewhere, dropped)
                for dest in [d for d in refused if d not in seen]:
                    del refused[dest]
                self._maybe_end()
        return taken

    def mark(self, rows: Sequence[Claimed], results: Sequence[PublishResult]) -> None:
        """Record the fate of each claimed row and release the leases.

        Confirmed: ``published_at`` (kept if another dispatcher set it first).
        Otherwise ``published_at`` stays empty, ``attempts + 1`` and a short
        ``last_error``; a permanent failure quarantines the row; a nack of
        the row's own (:func:`.outage.own_nacks`, or the row failed before:
        its earlier nacks were its own) adds a failure and a backoff, or
        quarantines at ``max_attempts``; any other nack (its destination
        refuses everything: an outage) makes it a retry due at once, with no
        failure: it waits on the outage, not on a backoff of its own
        (:attr:`storm_nacked` names them for the outage's bookkeeping); an
        unconfirmed row (connection lost) goes again without either. A
        failure is recorded only while this dispatcher still owns the row.
        """
        now = self.clock()
        now_s = now_iso(now)
        cfg = self.config
        own = _own_nacks(rows, results)
        published: list[int] = []
        failed: list[tuple[str, str | None, int, str, int]] = []
        quarantined: list[tuple[str, str, int, str]] = []
        nacked: list[tuple[int, str, bool]] = []  # seq, error, its own
        waiting: list[tuple[str, int, str]] = []
        for i, (row, result) in enumerate(zip(rows, results, strict=True)):
            if result.ok:
                published.append(row.seq)
                continue
            error = safe_reason(f"{result.status}: {result.reason}" if result.reason else result.status,
                                MAX_ERROR_CHARS)
            if result.status == "unconfirmed":  # an outage is backed off by the loop, not per row
                failed.append((error, None, row.seq, cfg.owner, 0))
            elif result.status in PERMANENT:
                quarantined.append((error, error, row.seq, cfg.owner))
            else:
                nacked.append((row.seq, error, i in own))
        half = len(published) // 2
        with self.db.transaction() as conn:
            # The failure count is read only for the rows that need it (rare),
            # so the claim of every row does not carry it.
            failures = dict(conn.execute(f"SELECT seq, failures FROM outbox WHERE {conn.seq_in_sql}",
                                         (conn.seqs(seq for seq, _, _ in nacked),)).fetchall()) if nacked else {}
            for seq, error, its_own in nacked:
                if not its_own and not failures.get(seq, 0):
                    waiting.append((error, seq, cfg.owner))
                    continue
                n = failures.get(seq, 0) + 1
                if n >= cfg.max_attempts:
                    reason = safe_reason(f"{error} (failed {n} times, max-attempts {cfg.max_attempts})",
                                         MAX_ERROR_CHARS)
                    quarantined.append((error, reason, seq, cfg.owner))
                else:
                    delay = reconnect_delay_s(n, base_s=cfg.retry_base_s, cap_s=cfg.retry_cap_s)
                    failed.append((error, now_iso(now + delay), seq, cfg.owner, 1))
            sql = ("UPDATE outbox SET published_at = coalesce(published_at, ?1), status = 'published',"
                   " attempts = attempts + 1, last_attempt_at = ?1, next_attempt_at = NULL, lease_owner = NULL,"
                   f" lease_until = NULL WHERE {conn.seq_in_sql.replace('?', '?2')}")
            if half:
                conn.execute(sql, (now_s, conn.seqs(published[:half])))
            crashpoint("dispatch-mid-batch")
            if published[half:]:
                conn.execute(sql, (now_s, conn.seqs(published[half:])))
            conn.executemany(
                # An unconfirmed row keeps its next_attempt_at: a retry stays a
                # retry (alone for its article) through an outage.
                "UPDATE outbox SET attempts = attempts + 1, failures = failures + ?5, last_error = ?1,"
                " last_attempt_at = ?6, next_attempt_at = coalesce(?2, next_attempt_at), lease_owner = NULL,"
                " lease_until = NULL"
                " WHERE seq = ?3 AND status = 'pending' AND lease_owner = ?4",
                [(*f, now_s) for f in failed],
            )
            conn.executemany(
                # Waits on the outage: a retry (alone for its key), due now; the dispatcher probes.
                "UPDATE outbox SET attempts = attempts + 1, last_error = ?1, last_attempt_at = ?4,"
                " next_attempt_at = coalesce(next_attempt_at, ?4), lease_owner = NULL, lease_until = NULL"
                " WHERE seq = ?2 AND status = 'pending' AND lease_owner = ?3",
                [(*w, now_s) for w in waiting],
            )
            cur = conn.executemany(
                "UPDATE outbox SET status = 'quarantined', attempts = attempts + 1, failures = failures + 1,"
                " last_error = ?1, quarantine_reason = ?2, quarantined_at = ?5, last_attempt_at = ?5,"
                " next_attempt_at = NULL, lease_owner = NULL, lease_until = NULL"
                " WHERE seq = ?3 AND status = 'pending' AND lease_owner = ?4",
                [(*q, now_s) for q in quarantined],
            )
        if quarantined:
            self.stats.quarantined += max(0, cur.rowcount)
        self.storm_nacked = {seq for _, seq, _ in waiting}

    def release(self, rows: Sequence[Claimed]) -> None:
        """Give up the leases of *rows* without publishing them."""
        with self.db.transaction() as conn:
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
        while self._unmarked:  # published before the database went away: their marks come first
            rows, results = self._unmarked[0]
            self._settle(rows, results, retry=False)
            self._unmarked.popleft()
        if self.config.wake and self._listener is None and time.monotonic() >= self._listen_at:
            self._listen()
        if not self._connected:
            # Batches left by a lost connection come back at once (unconfirmed
            # or not sent); they must be settled before connecting again.
            while self._inflight:
                later, ticket = self._inflight.popleft()
                self._settle(later, self.publisher.collect(ticket))
            started = time.monotonic()
            try:
                with _logged_if_slow("connecting"):
                    self.publisher.connect()
            except BrokerUnavailable as exc:
                if not self.stopping:  # else: interrupted by a stop, nothing to wait out
                    self._outage(str(exc), spent=time.monotonic() - started, connect=True)
                return 0
            self._connected = self.stats.connected = self.stats.online = True
            self._stale_channel = False  # a connection's channels are new
        while len(self._inflight) < self._depth() and not self.stopping:
            limit = self._limit()
            if self._quiet():
                break
            if self._renew_due():
                if self._inflight:  # the probe waits until the channel has nothing in flight
                    break
                try:
                    self.publisher.renew_channel()
                except BrokerUnavailable as exc:
                    self._connected = False
                    self._outage(str(exc))
                    return 0
                except BaseException:
                    self._abandon([])
                    raise
                self._stale_channel = False
            rows = self.claim(limit)  # a busy database raises here; what is in flight stays in flight
            if not rows:
                break
            if limit is not None and self._episode is not None:
                self._episode.probes += 1
            self._send(rows)
        if not self._inflight:
            episode = self._episode
            if episode is not None and episode.link is not None and not self.stopping:
                episode.link = None  # connected, and nothing to prove it with: nothing waits on it
                self._maybe_end()
            return 0
        rows, ticket = self._inflight[0]
        listener = self._listener
        # Rows committed while the oldest batch waits for its confirms go out
        # behind it at once, not after it is marked.
        while listener is not None and len(self._inflight) < self._depth() and not self.stopping:
            if self.publisher.wait(ticket, listener.fileno()):
                break
            self._woken(listener)
            if self._listener is None:
                break
            more = [] if self._quiet() or self._renew_due() else self.claim(self._limit())
            if more:
                self._send(more)
        try:
            with _logged_if_slow(f"the confirms of a batch of {len(rows)}"):
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
            self._link.end()
            return len(rows)
        # The connection is gone: the batches behind this one come back at
        # once (unconfirmed, or not sent); record them, then wait it out.
        while self._inflight:
            later, ticket = self._inflight.popleft()
            self._settle(later, self.publisher.collect(ticket))
        self._outage(lost)
        return len(rows)

    def _quiet(self) -> bool:
        """Whether the next claim would only scan the rows waiting on the outage again: one found nothing
        less than ``poll`` ago, and no probe is due."""
        episode = self._episode
        if episode is None or not episode.refused:
            return False
        now = self.clock()
        return now < self._scan_at and now < episode.probe_at

    def _renew_due(self) -> bool:
        """Whether a probe is due on a channel that met a nack storm: it goes on a new channel."""
        episode = self._episode
        return (self._stale_channel and episode is not None and bool(episode.refused)
                and episode.probe_at <= self.clock())

    def _depth(self) -> int:
        """Batches in flight: one while an outage's connection is being proved."""
        episode = self._episode
        return 1 if episode is not None and episode.link is not None else self.config.depth

    def _limit(self) -> int | None:
        """Rows of the next claim: a probe's few while an outage's connection is being proved."""
        episode = self._episode
        return LINK_PROBE_ROWS if episode is not None and episode.link is not None else None

    def _send(self, rows: list[Claimed]) -> None:
        """Send *rows* behind the batches in flight."""
        if not self.stats.batches and not self._inflight:
            self.stats.first_claim = time.perf_counter()
        crashpoint("dispatch-before-publish")
        exchange = self.config.exchange
        try:
            ticket = self.publisher.send([OutMessage(routing_key=r.routing_key, body=r.body, exchange=exchange,
                                                     message_id=r.event_id, headers=self._headers(r))
                                             for r in rows])
        except BaseException:
            self._abandon(rows)
            raise
        self._inflight.append((rows, ticket))

    def _headers(self, row: Claimed) -> dict[str, Any]:
        headers = slot_headers(row.ordering_key)
        if row.produced_ms is not None:
            headers[H_PRODUCED_MS] = row.produced_ms
        return tracing.message_headers(headers, row.body) or headers

    def _abandon(self, rows: list[Claimed]) -> None:
        """The publisher failed for good (BrokerFatal, an interrupt): give up
        the leases of *rows* and of every batch in flight."""
        self._connected = False
        with suppress(DeliveryError):
            self.release([*rows, *(row for batch, _ in self._inflight for row in batch)])
        self._inflight.clear()
        self._probes.clear()

    def _settle(self, rows: list[Claimed], results: list[PublishResult], *, retry: bool = True) -> None:
        """Mark a collected batch. When the database fails (an outage, a timeout)
        the batch is kept and marked first at the next step: no row spends an
        attempt, and none waits for its lease to expire."""
        try:
            self.mark(rows, results)
        except TransientError:
            if retry:
                self._unmarked.append((rows, results))
            raise
        self.stats.last_mark = time.perf_counter()
        self.stats.batches += 1
        self.stats.results.update(r.status for r in results)
        self._observe(rows, results)
        bad = [(row, r) for row, r in zip(rows, results, strict=True) if not r.ok]
        episode = self._episode
        if episode is not None and episode.logged:  # the outage's own lines say it, not one per row
            bad = [(row, r) for row, r in bad if r.status not in ("nacked", "unconfirmed")]
        for row, r in bad[:3]:
            log.warning("%s not published: %s %s", row.event_id, r.status, r.reason)
        log.debug("batch of %d: %d confirmed", len(rows), sum(r.ok for r in results))

    # -- outages (.outage) --

    def _begin(self, why: str) -> Outage:
        if self._episode is None:
            self._episode = Outage(why=why, since=time.monotonic(), probe_at=self.clock())
        return self._episode

    def _announce(self, episode: Outage, line: str, *args: Any) -> None:
        """The outage's first line: logged once, and counted."""
        if not episode.logged:
            episode.logged = True
            self.stats.outages += 1
            self.stats.in_outage = True
            log.warning(line, *args)

    def _observe(self, rows: Sequence[Claimed], results: Sequence[PublishResult]) -> None:
        """What a settled batch says of the outage: a destination whose every
        message was nacked refuses (its rows wait on the outage); a confirm
        ends the refusal of its destination; any answer proves the connection."""
        statuses = [r.status for r in results]
        storm_nacked = self.storm_nacked  # as mark() judged them
        storm = bool(storm_nacked)
        probe = bool(self._probes) and any(row.seq in self._probes for row in rows)
        if probe:
            self._probes.difference_update(row.seq for row in rows)
        lost = next((r.reason for r in results if r.status == "unconfirmed"), None)
        episode = self._episode
        if episode is None:
            if not storm and lost is None:
                return
            episode = self._begin(lost or "the broker nacked every message of a destination")
        if episode.link is not None and any(s in ("confirmed", "nacked", "returned") for s in statuses):
            episode.link = None  # the broker answers
        if lost is not None:
            episode.link = lost
        recovered = refusing = False
        for row, status in zip(rows, statuses, strict=True):
            if status == "unconfirmed":
                episode.unconfirmed += 1
            elif status == "confirmed":
                if episode.refused and episode.confirmed(destination(row.routing_key, row.ordering_key)):
                    recovered = True
            elif status == "nacked" and row.seq in storm_nacked:
                episode.refuse(destination(row.routing_key, row.ordering_key), row.seq)
                refusing = True
        if refusing:
            self._stale_channel = True
            self._announce(
                episode, "the broker nacks every message to %s (no quorum, a queue full or unavailable?): one"
                " outage; its rows wait for it, no backoff of their own; probing every %.0fs at most, other"
                " destinations go on", describe(episode.refused), PROBE_CAP_S)
        now = self.clock()
        if recovered:
            episode.tries, episode.probe_at = 0, now  # it confirms again: probe the rest at once
        elif refusing or probe:
            episode.tries += 1
            if probe or episode.probe_at != float("inf"):
                episode.probe_at = now + reconnect_delay_s(episode.tries, cap_s=PROBE_CAP_S)
        self._maybe_end()

    def _maybe_end(self) -> None:
        """Close the outage once the broker answers and no destination refuses; one line, with its counts."""
        episode = self._episode
        if episode is None or not episode.over:
            return
        self._episode = None
        self._probes.clear()
        self.stats.in_outage = False
        if episode.logged:
            log.warning("broker %s again after %.1fs: one outage, %s; every row that waited on it goes now",
                        "reachable" if episode.link_seen else "confirms", time.monotonic() - episode.since,
                        episode.summary())

    def _outage(self, why: str, spent: float = 0.0, *, connect: bool = False) -> None:
        """No connection (*connect*: a connect failed), or the confirms were
        lost: wait before the next attempt; *spent*: what the failed one took
        (a handshake that timed out), which counts towards the wait."""
        self.stats.last_outage = why
        delay = self._link.delay(spent)
        if self._idle_deadline is not None:  # never wait past the time --exit-when-idle allows
            delay = min(delay, max(0.01, self._idle_deadline - self.clock()))
        self.stats.online = False
        episode = self._begin(why)
        episode.link = why
        episode.link_seen = True
        episode.connects += connect
        episode.probe_at = self.clock()  # after reconnecting, probe the refusing destinations at once
        self._probes.clear()
        # Logged once per outage (and once per change of its reason), not once per attempt.
        if not episode.logged:
            self._announce(episode, "%s; retrying in %.1fs, then every %.0fs at most until it answers", why, delay,
                           RECONNECT_CAP_S)
        elif why != episode.last_why:
            log.info("still waiting for the broker: %s", why)
        else:
            log.debug("%s; retrying in %.1fs (attempt %d)", why, delay, self._link.tries)
        episode.last_why = why
        self.sleep(delay)

    def _pause(self, seconds: float) -> None:
        """Wait between passes, servicing the connection's heartbeats.

        ``Publisher.idle`` returns at once when the connection is gone: then
        the rest is slept, and the next pass reconnects (never a spin).
        """
        listener = self._listener
        if self._connected:
            started = time.monotonic()
            if listener is None:
                self.publisher.idle(seconds)
            else:
                self.publisher.idle(seconds, listener.fileno())
                if self._woken(listener):  # a producer committed: claim now (drained before that claim's read)
                    return
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

    def _register(self) -> owners.Heartbeat | None:
        """Make this dispatcher's leases reclaimable at once if it dies:
        register it and start its heartbeat (skipped for a SQLite database
        without a file). A busy database only delays the registration: the
        first heartbeat makes it."""
        if self.db.kind == "sqlite" and not os.path.isfile(self.db.label):
            return None
        with suppress(DeliveryError):
            owners.register(self.db, self.identity, self.config.heartbeat_s, self.clock())
        beat = owners.Heartbeat(self.db.reopen, self.identity, self.config.heartbeat_s, self.clock)
        beat.start()
        return beat

    def _listen(self) -> None:
        """Bind the wake-up source (LISTEN on PostgreSQL, a socket slot on SQLite)."""
        self._listen_at = float("inf")
        self._listener = self.db.listener()
        if self._listener is None:
            log.info("no wake-up source for this outbox (%s); polling every %gs",
                     f"{wake.SLOTS} dispatchers listen already" if self.db.kind == "sqlite" else "LISTEN failed",
                     self.config.poll_s)
            if self.db.kind != "sqlite":
                self._listen_at = time.monotonic() + RELISTEN_S

    def _woken(self, listener: WakeListener) -> int:
        """Drain *listener*; when it broke, fall back to polling and listen again later."""
        n = listener.drain()
        if listener.broken:
            log.warning("the wake-up source was lost; polling every %gs until it is back", self.config.poll_s)
            listener.close()
            self._listener = None
            self._listen_at = time.monotonic() + RELISTEN_S
        return n

    def run(self) -> DispatchStats:
        """Dispatch until :meth:`stop`, or ``exit_when_idle_s`` without
        progress (a row published or quarantined).

        Broker outages and a busy database are waited out with backoff;
        BrokerFatal and DatabaseError propagate. On the way out the
        dispatcher gives back any lease it still holds and unregisters.
        """
        beat = self._register()
        if self.config.wake:
            self._listen()
        try:
            self._loop()
        finally:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            if beat is not None:
                beat.stop()
                with suppress(DeliveryError):
                    owners.unregister(self.db, self.config.owner)
        return self.stats

    def _loop(self) -> None:
        limit = self.config.exit_when_idle_s
        seen = self.stats.progress
        idle_since = self.clock()
        while not self.stopping or self._inflight or self._unmarked:  # a stop still settles what is in flight
            self._idle_deadline = None if limit is None else idle_since + limit
            try:
                settled = self.step()
            except TransientError as exc:
                # The database is busy past its timeout, or the disk is full:
                # wait and try again. Rows published but not marked stay
                # leased; after the lease they go again (duplicates, no loss).
                delay = self._db_wait.delay()
                log.warning("%s; retrying in %.1fs", exc, delay)
                self.sleep(delay)
                continue
            self._db_wait.end()
            now = self.clock()
            if self.stats.progress != seen:
                seen, idle_since = self.stats.progress, now
            if limit is not None and now - idle_since >= limit and not self._inflight:
                log.info("no row published or quarantined for %.1fs; exiting", limit)
                break
            if settled:
                continue
            pause = self.config.poll_s
            episode = self._episode
            if episode is not None and episode.refused and episode.probe_at != float("inf"):
                pause = min(pause, max(0.01, episode.probe_at - now))  # the next probe is due then
            if limit is not None:
                pause = min(pause, max(0.01, limit - (now - idle_since)))
            self._pause(pause)


__all__ = ["PERMANENT", "Claimed", "DispatchConfig", "DispatchStats", "Dispatcher", "PublisherLike",
           "default_owner"]
