"""Apply envelopes from files straight into a consumer's database (no broker).

The same path as a broker delivery: bytes -> :func:`envelope.parse` ->
:func:`inbox.apply_batch`, ``batch`` events per transaction; results do not
depend on the batch size.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from .contract import Outcome
from .envelope import MAX_BODY_BYTES, Envelope, body_digest, parse
from .errors import Rejection, TransientError
from .inbox import ConsumerDB, apply_batch
from .sources import Item

#: A whole batch that meets a busy database past its busy_timeout is tried
#: again this many times (with jittered backoff) before replay gives up.
BUSY_RETRIES = 5


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
            codes = ", ".join(f"{n} {k}" for k, n in sorted(self.transient.items()))
            parts.append(f"{sum(self.transient.values())} not applied, transient ({codes})")
        return f"{self.total} events: " + (", ".join(parts) if parts else "nothing to do")


def _parse_all(items: list[Item], max_bytes: int) -> tuple[list[Envelope | Rejection], list[str | None] | None]:
    """Parse a batch: envelopes or rejections, and the body digests of the
    rejected ones (None when nothing was rejected, the usual case)."""
    parsed: list[Envelope | Rejection] = []
    digests: list[str | None] | None = None
    for i, item in enumerate(items):
        try:
            parsed.append(parse(item.body, max_bytes=max_bytes))
        except Rejection as rej:
            parsed.append(rej)
            if digests is None:
                digests = [None] * len(items)
            digests[i] = body_digest(item.body)
    return parsed, digests


def _apply_batch(db: ConsumerDB, items: list[Item], max_bytes: int) -> list[Outcome]:
    parsed, digests = _parse_all(items, max_bytes)
    sources = [item.location for item in items]
    for attempt in range(BUSY_RETRIES + 1):
        try:
            return apply_batch(db, parsed, sources=sources, body_digests=digests)
        except TransientError as exc:
            if exc.code != "database-busy" or attempt == BUSY_RETRIES:
                raise
            import random  # only on this rare path: start-up time counts

            time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def replay(
    db: ConsumerDB, items: Iterable[Item], *, batch: int = 1, max_bytes: int = MAX_BODY_BYTES
) -> Iterator[tuple[Item, Outcome]]:
    """Apply *items* in order, *batch* per transaction; yield each outcome.

    Raises :class:`TransientError` when the database stays unusable (busy
    past every retry, disk full); what was yielded before is committed.
    """
    if batch < 1:
        raise ValueError("batch must be >= 1")
    # Lean on purpose: at --batch 1 this runs once per event (bench/bench_replay.py).
    pending: list[Item] = []
    for item in items:
        pending.append(item)
        if len(pending) >= batch:
            yield from zip(pending, _apply_batch(db, pending, max_bytes), strict=True)
            pending = []
    if pending:
        yield from zip(pending, _apply_batch(db, pending, max_bytes), strict=True)
