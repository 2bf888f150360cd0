"""Apply envelopes from files straight into a consumer's database (no broker).

The same path as a broker delivery: bytes -> :func:`cloudevents.parse_body` (what
``parse_message`` does for a message without properties) -> :func:`inbox.apply_batch`,
``batch`` events per transaction; results do not depend on the batch size.
Large batches are parsed one ahead, in a thread, while the one before
commits (docs/hot-path.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter

from ..inbox import ConsumerDB, Transaction, apply_batch
from ..inbox.apply import BatchHook
from ..model.cloudevents import parse_body
from ..model.contract import Outcome
from ..model.envelope import MAX_BODY_BYTES, Envelope, body_digest
from ..model.errors import Rejection, TransientError
from ..model.event_types import EventTypes
from ..model.plural import count
from ..store.sqlite import DATABASE_BUSY
from .sources import Item

#: Bodies held parsed ahead of the database at most (see :func:`replay`),
#: beyond a single batch.
READ_AHEAD_BYTES = 4 << 20

#: A whole batch that meets a busy database past its busy_timeout is tried
#: again this many times (with jittered backoff) before replay gives up.
BUSY_RETRIES = 5

#: From this batch size on, when reading ahead is allowed (files, not
#: standard input), the next batch is parsed in a thread while the current
#: one commits (:class:`_ParsedAhead`). Below it, handing a batch over costs
#: about what parsing it does.
PARSE_AHEAD_MIN_BATCH = 16


@dataclass
class Summary:
    """Counts of a replay, by result and by rejection code."""

    results: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    transient: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: Outcome) -> None:
        if outcome.result is not None:
            self.results[outcome.result] += 1
        elif outcome.rejection is not None:
            self.rejected[outcome.rejection.code] += 1
        elif outcome.transient is not None:
            self.transient[outcome.transient.code] += 1

    @property
    def total(self) -> int:
        return sum(self.results.values()) + sum(self.rejected.values()) + sum(self.transient.values())

    @property
    def failed(self) -> bool:
        return bool(self.rejected or self.transient)

    def line(self) -> str:
        parts = [f"{n} {k}" for k, n in sorted(self.results.items())]
        if self.rejected:
            codes = ", ".join(f"{n} {k}" for k, n in sorted(self.rejected.items()))
            parts.append(f"{sum(self.rejected.values())} rejected ({codes})")
        if self.transient:
            named = {k: n for k, n in self.transient.items() if k != "transient"}  # the generic code says nothing
            codes = f" ({', '.join(f'{n} {k}' for k, n in sorted(named.items()))})" if named else ""
            parts.append(f"{sum(self.transient.values())} not applied, transient{codes}")
        return f"{count(self.total, 'event')}: " + (", ".join(parts) if parts else "nothing to do")


def _parse_all(items: list[Item], max_bytes: int,
               types: EventTypes) -> tuple[list[Envelope | Rejection], list[str | None] | None]:
    """Parse a batch of the consumer's *types*: envelopes or rejections, and
    the body digests of the rejected ones (None when nothing was rejected, the usual case)."""
    try:  # the usual batch, none rejected: one comprehension, no bookkeeping per event
        return [parse_body(item.body, max_bytes, types) for item in items], None
    except Rejection:
        pass  # parsing is pure: the batch is parsed again, a rejection kept in its place
    parsed: list[Envelope | Rejection] = []
    digests: list[str | None] | None = None
    for i, item in enumerate(items):
        try:
            parsed.append(item.parse(max_bytes, types))
        except Rejection as rej:
            parsed.append(rej)
            if digests is None:
                digests = [None] * len(items)
            digests[i] = body_digest(item.body)
    return parsed, digests


def _apply_parsed(db: ConsumerDB, parsed: list[Envelope | Rejection], sources: list[str | None],
                  digests: list[str | None] | None, before_commit: BatchHook | None = None) -> list[Outcome]:
    for attempt in range(BUSY_RETRIES + 1):
        try:
            return apply_batch(db, parsed, sources=sources, body_digests=digests, before_commit=before_commit)
        except TransientError as exc:
            if exc.code != DATABASE_BUSY or attempt == BUSY_RETRIES:
                raise
            import random  # only on this rare path: start-up time counts

            time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def _apply_chunk(db: ConsumerDB, items: list[Item], batch: int, max_bytes: int) -> Iterator[tuple[Item, Outcome]]:
    """Parse *items* at once, then apply them *batch* per transaction."""
    parsed, digests = _parse_all(items, max_bytes, db.spec.event_types)
    if batch == 1:  # no slices: this runs once per event
        for i, item in enumerate(items):
            (outcome,) = _apply_parsed(db, [parsed[i]], [item.location], None if digests is None else [digests[i]])
            yield item, outcome
        return
    sources: list[str | None] = [item.location for item in items]
    for start in range(0, len(items), batch):
        end = start + batch
        outcomes = _apply_parsed(db, parsed[start:end], sources[start:end],
                                 digests[start:end] if digests is not None else None)
        yield from zip(items[start:end], outcomes, strict=True)


class _ParsedAhead:
    """Reads and parses the next batch in a thread while the current one commits.

    The thread runs only when asked, and it is asked right before a COMMIT:
    the commit releases the GIL while SQLite writes and syncs, so parsing
    goes on beside it instead of after it. The thread stays idle while the
    transaction runs its statements, each of which also releases the GIL:
    a busy parser would take it at every statement and make the writer wait.
    Only for sources that never block for long (files): :meth:`close` waits
    for the thread, which stops once it has read the batch it is reading.
    """

    def __init__(self, items: Iterable[Item], batch: int, max_bytes: int, types: EventTypes):
        self._items = iter(items)
        self._batch = batch
        self._max_bytes = max_bytes
        self._types = types
        # A lock held until asked: cheaper than a Semaphore, all in C.
        self._asked = threading.Lock()
        self._asked.acquire()
        self._done: queue.SimpleQueue[_Parsed | BaseException] = queue.SimpleQueue()
        self._closed = False
        # A daemon only as a last resort: close() joins it.
        self._thread = threading.Thread(target=self._work, name="replay-parse", daemon=True)
        self._thread.start()

    def ask(self) -> None:
        """Start on the next batch."""
        self._asked.release()

    def take(self) -> _Parsed:
        """The batch asked for (no items at the end); what reading it raised, raised here."""
        done = self._done.get()
        if isinstance(done, BaseException):
            raise done
        return done

    def close(self) -> None:
        """Stop the thread and wait for it: after this, nothing reads *items*."""
        self._closed = True
        if self._asked.locked():  # only this side releases: no race with the thread
            self._asked.release()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _work(self) -> None:
        while True:
            self._asked.acquire()
            try:
                if self._closed:  # take no more
                    return
                items = list(islice(self._items, self._batch))
                if self._closed:  # while reading: that batch is not wanted
                    return
                parsed, digests = _parse_all(items, self._max_bytes, self._types)
            except BaseException as exc:  # handed to the replaying thread, which raises it
                self._done.put(exc)
                return
            self._done.put((items, parsed, digests))
            if not items:
                return


_Parsed = tuple[list[Item], list[Envelope | Rejection], list[str | None] | None]


def _replay_parsing_ahead(db: ConsumerDB, items: Iterable[Item], batch: int,
                          max_bytes: int) -> Generator[tuple[Item, Outcome], None, None]:
    ahead = _ParsedAhead(items, batch, max_bytes, db.spec.event_types)
    try:
        ahead.ask()
        while True:
            chunk, parsed, digests = ahead.take()
            if not chunk:
                return
            asked = False

            def ask_next(tx: Transaction, outcomes: list[Outcome]) -> None:
                nonlocal asked
                if not asked:  # once, though a busy database makes the batch run again
                    asked = True
                    ahead.ask()

            # apply_batch calls the hook whenever it returns: the next batch is asked for.
            outcomes = _apply_parsed(db, parsed, [item.location for item in chunk], digests, ask_next)
            yield from zip(chunk, outcomes, strict=True)
    finally:
        ahead.close()


def replay(
    db: ConsumerDB, items: Iterable[Item], *, batch: int = 1, max_bytes: int = MAX_BODY_BYTES,
    read_ahead: int = 0,
) -> Generator[tuple[Item, Outcome], None, None]:
    """Apply *items* in order, *batch* per transaction: a generator of each outcome.

    *read_ahead*: parse up to that many items (whole batches, at most
    :data:`READ_AHEAD_BYTES` beyond one batch) before applying the first.
    Parsing does not depend on the database, so outcomes and commits are the
    same; parsing a run of bodies together, away from the commits, keeps
    that code and its data in the CPU caches. Leave it 0 when items trickle
    in (standard input): an event is then applied as soon as its batch is
    complete. With *read_ahead* and at least :data:`PARSE_AHEAD_MIN_BATCH`
    events a batch, the next batch is read and parsed in a thread while the
    current one commits instead (:class:`_ParsedAhead`). Either way, a
    caller that stops early may find up to *read_ahead* items (or one batch)
    taken from *items* beyond the last outcome yielded.

    Raises :class:`TransientError` when the database stays unusable (busy
    past every retry, disk full); what was yielded before is committed.
    """
    if batch < 1:
        raise ValueError("batch must be >= 1")
    # The generator that applies them, returned rather than delegated to
    # (yield from): one generator fewer to resume per event.
    if read_ahead and batch >= PARSE_AHEAD_MIN_BATCH:
        return _replay_parsing_ahead(db, items, batch, max_bytes)
    return _replay_chunks(db, items, batch, max_bytes, read_ahead)


def _replay_chunks(db: ConsumerDB, items: Iterable[Item], batch: int, max_bytes: int,
                   read_ahead: int) -> Generator[tuple[Item, Outcome], None, None]:
    """:func:`replay` without the parsing thread: a chunk of whole batches parsed, then applied."""
    chunk = -(-max(batch, read_ahead) // batch) * batch  # whole batches
    # A chunk is taken at once (islice), not an item at a time: at --batch 1
    # this loop served every event (bench/bench_replay.py).
    source = iter(items)
    pending: list[Item] = []
    while True:
        pending += islice(source, chunk - len(pending))
        if not pending:
            return
        end = _chunk_end(pending, batch)
        yield from _apply_chunk(db, pending[:end], batch, max_bytes)
        del pending[:end]


def _chunk_end(pending: list[Item], batch: int) -> int:
    """How many of *pending* to apply now: all of them, or up to the first
    whole batch that brings the bodies to :data:`READ_AHEAD_BYTES`."""
    if sum(map(len, map(_body, pending))) < READ_AHEAD_BYTES:
        return len(pending)
    size = 0
    for end, item in enumerate(pending, 1):
        size += len(item.body)
        if end % batch == 0 and size >= READ_AHEAD_BYTES:
            return end
    return len(pending)


_body = attrgetter("body")
