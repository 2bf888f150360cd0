"""A realistic, reproducible stream of envelopes for the benchmarks.

Shaped like what a consumer sees in production: several thousand articles,
a few of them hot; each article's revisions increase over time; some events
are withdrawals; about 3 % are redeliveries (the same line again, a little
later), about 3 % arrive late behind a newer revision of their article
(``stale``) and about 1 % re-announce the current revision with a new eventId
(``same-state``). Every event is valid: the benchmarks compare the store's
work, and an invalid event would make the baseline (which does not validate)
write something ours refuses.

Deterministic for a given (count, seed), so that every measurement and every
database comparison is about the same bytes. ``ids="v7"`` names the events as
the toolkit's producers do (time-ordered UUIDs made at each event's
``occurredAt``) instead of with random version 4 UUIDs; the rest of the
stream is the same.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from delivery_consumer.model.event_ids import EventIds

PUBLISHED = "material.published"
WITHDRAWN = "material.withdrawn"

_WORDS = (
    "delivery without loss", "inbox pattern", "idempotent consumers", "exactly once, almost",
    "dead letters", "retry tiers", "power loss", "write-ahead log", "quorum queues",
    "Доставка без потерь", "Идемпотентность", "Очередь недоставленных", "Журнал упреждающей записи",
    "heartbeats", "prefetch", "publisher confirms", "out-of-order revisions", "redelivery",
)


def _title(rng: random.Random, article: int, revision: int) -> str:
    words = rng.sample(_WORDS, 2)
    return f"{words[0].capitalize()}: {words[1]} (part {article % 17 + 1}, rev. {revision})"


def _timestamp(base: datetime, seconds: float, rng: random.Random) -> str:
    when = base + timedelta(seconds=seconds)
    style = rng.random()
    if style < 0.7:
        return when.strftime("%Y-%m-%dT%H:%M:%SZ")
    if style < 0.9:
        return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
    # Same instant written with a +03:00 offset (Moscow time).
    return (when + timedelta(hours=3)).strftime("%Y-%m-%dT%H:%M:%S") + "+03:00"


class _Ids:
    """Event ids drawn from *rng*: random (``v4``) or time-ordered (``v7``) at the stream's clock."""

    def __init__(self, rng: random.Random, kind: str) -> None:
        if kind not in ("v4", "v7"):
            raise ValueError(f"ids: v4 or v7, not {kind!r}")
        self.rng, self.kind, self.now_ns = rng, kind, 0
        self._bits = 0
        self._v7 = EventIds(clock=lambda: self.now_ns, entropy=lambda n: self._bits.to_bytes(16, "big")[:n])

    def __call__(self) -> str:
        self._bits = self.rng.getrandbits(128)
        if self.kind == "v4":
            return str(uuid.UUID(int=self._bits, version=4))
        return self._v7()


#: When the stream's first event occurs.
BASE = datetime(2026, 11, 29, 10, 0, 0, tzinfo=UTC)


def envelopes(count: int, *, seed: int = 42, ids: str = "v4") -> list[dict[str, Any]]:
    """*count* envelopes in delivery order (dicts, keys in producer order)."""
    rng = random.Random(seed)
    new_id = _Ids(rng, ids)
    articles = max(1, count // 4)
    hot = max(1, articles // 50)
    base = BASE
    revision = [0] * articles
    state: dict[int, dict[str, Any]] = {}
    fresh: list[dict[str, Any]] = []
    clock = 0.0
    while len(fresh) < count:
        clock += rng.expovariate(20.0)
        new_id.now_ns = int((base.timestamp() + clock) * 1e9)
        # A fifth of the traffic goes to the hot 2 % of articles.
        a = rng.randrange(hot) if rng.random() < 0.2 else rng.randrange(articles)
        current = state.get(a)
        if current is not None and rng.random() < 0.01:
            # The producer re-announces the current revision with a new id.
            again = dict(current, eventId=new_id())
            fresh.append(again)
            continue
        revision[a] += 1
        if current is not None and current["type"] == PUBLISHED and rng.random() < 0.08:
            kind, data = WITHDRAWN, dict(current["data"])
        else:
            kind = PUBLISHED
            data = {"title": _title(rng, a, revision[a]), "url": f"https://example.org/a/{a}"}
            if rng.random() < 0.1:
                data["lang"] = "ru"
        env = {
            "eventId": new_id(),
            "type": kind,
            "articleId": f"article-{a}",
            "revision": revision[a],
            "occurredAt": _timestamp(base, clock, rng),
            "data": data,
        }
        state[a] = env
        fresh.append(env)
    # Late arrivals: ~3 % of events are overtaken by the next revision of
    # their article (and a few more events), so they are answered stale.
    for i in range(len(fresh) - 1, -1, -1):
        if rng.random() < 0.03:
            article = fresh[i]["articleId"]
            later = next((j for j in range(i + 1, len(fresh))
                          if fresh[j]["articleId"] == article), None)
            if later is not None:
                fresh.insert(min(len(fresh), later + rng.randint(0, 50)), fresh.pop(i))
    # Redeliveries: ~3 % of positions repeat an event seen shortly before.
    stream: list[dict[str, Any]] = []
    for env in fresh:
        if len(stream) + 1 >= count:
            stream.append(env)
            break
        stream.append(env)
        if rng.random() < 0.03:
            stream.append(stream[max(0, len(stream) - 1 - rng.randint(0, 300))])
    return stream[:count]


def past_span(count: int) -> tuple[float, float]:
    """When the first of *count* prefilled receipts was received, and the
    seconds between two: over 80 days, ending ten days before the stream."""
    return BASE.timestamp() - 90 * 86400, 80 * 86400 / max(1, count)


def past_ids(kind: str, start: float, step: float) -> Callable[[int], str]:
    """Receipt *i*'s eventId: random (``v4``), or time-ordered (``v7``) made at
    its time, ``start + i * step`` (seconds), before any event of the stream."""
    if kind == "v4":
        return lambda i: str(uuid.UUID(bytes=os.urandom(16), version=4))
    clock = [0]
    made = EventIds(clock=lambda: clock[0])

    def v7(i: int) -> str:
        clock[0] = int((start + i * step) * 1e9)
        return made()

    return v7


def ndjson(events: list[dict[str, Any]]) -> bytes:
    """The events as NDJSON, one compact line each, as a producer writes them."""
    return b"".join(orjson.dumps(env) + b"\n" for env in events)


def invalid_envelopes(valid: list[dict[str, Any]], *, seed: int = 7) -> list[dict[str, Any]]:
    """One broken copy of some valid envelopes per kind of schema violation."""
    rng = random.Random(seed)
    breakers = (
        lambda e: e.pop("articleId"),
        lambda e: e.update(eventId=e["eventId"].upper()),
        lambda e: e.update(revision=0),
        lambda e: e.update(revision="3"),
        lambda e: e.update(occurredAt="2026-13-40T25:61:00Z"),
        lambda e: e.update(occurredAt="yesterday"),
        lambda e: e.update(articleId=""),
        lambda e: e.update(revison=2),
        lambda e: e.update(data={"title": "", "url": "https://example.org"}),
        lambda e: e.update(data={"url": "https://example.org"}),
        lambda e: e.update(type=7),
    )
    broken = []
    for env in rng.sample(valid, min(len(valid), 20 * len(breakers))):
        copy = orjson.loads(orjson.dumps(env))
        rng.choice(breakers)(copy)
        broken.append(copy)
    return broken
