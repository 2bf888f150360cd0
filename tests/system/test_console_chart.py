"""The console's outcomes per minute: the minute cache gives what a fresh read
of the whole window gives, as time moves and receipts arrive. And its other
caches: a page and a dead queue's read shared by concurrent requests."""

from __future__ import annotations

import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import OpenDB

from delivery_consumer.console import chart
from delivery_consumer.inbox import ConsumerDB, counters
from delivery_consumer.store.sqlite import now_iso

RESULTS = st.sampled_from(["updated", "duplicate:updated", "stale", "same-state"])


def add(db: ConsumerDB, stamps: list[tuple[float, str]]) -> None:
    """Receipts in time order, as the store writes them (stamped under the write lock)."""
    with db.transaction() as tx:
        for i, (when, result) in enumerate(sorted(stamps)):
            key = f"{when:.6f}-{i}-{result}"
            tx.conn.execute("INSERT OR IGNORE INTO inbox (event_id, fingerprint, result, event_type, received_at)"
                            " VALUES (?, 'f', ?, 'material.published', ?)", (key, result, now_iso(when)))
        counters.rebuild(tx.conn)  # what the store's writers keep (stamped otherwise: now)


def window(db: ConsumerDB, window_s: float, now: float) -> chart.Minutes:
    return chart.read_minutes(db, now_iso(now - window_s)[:16])


# Each example opens a database of its own in the fixture's directory.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=st.lists(st.tuples(st.floats(0, 4 * 3600), RESULTS), max_size=40),
       later=st.lists(st.tuples(st.floats(0, chart.SETTLE_S - 1), RESULTS), max_size=20),
       step=st.floats(0, 600))
def test_the_cache_equals_a_fresh_read(open_db: OpenDB, before: list[tuple[float, str]],
                                       later: list[tuple[float, str]], step: float) -> None:
    """Receipts over four hours; the cache agrees with a fresh read of the 3-hour window, then again
    after new receipts in the unsettled minutes and the clock moving on by up to ten minutes."""
    db = open_db("catalog", name=f"chart-{time.monotonic_ns()}.db")
    now = 1_800_000_000.0
    add(db, [(now - ago, result) for ago, result in before])
    newest = max((now - ago for ago, _ in before), default=0.0)
    cache = chart.MinuteCache()
    assert window(db, 3 * 3600, now) == cache.minutes(db, 3 * 3600, now)
    now += step
    add(db, [(max(now - ago, newest), result) for ago, result in later])  # written later: not older
    assert window(db, 3 * 3600, now) == cache.minutes(db, 3 * 3600, now)


def test_the_chart_draws_one_bar_per_minute_with_a_tooltip(open_db: OpenDB) -> None:
    """The SVG has a bar per category of a minute with receipts, and the hour marks."""
    db = open_db("catalog")
    now = 1_800_000_045.0  # 45 s into a minute: the two receipts 30 and 31 s before share a minute
    add(db, [(now - 30, "updated"), (now - 31, "stale"), (now - 3600, "updated")])
    svg = chart.svg(chart.MinuteCache().minutes(db, 3 * 3600, now), 3 * 3600, now)
    assert svg.startswith("<svg") and svg.count("<rect") == 1 + 3
    assert "1 applied, 1 stale" in svg or "1 stale, 1 applied" in svg


def test_a_page_asked_for_by_many_threads_at_once_is_built_once() -> None:
    """console.Recent: threads asking together, or within its time to live, share one build."""
    import threading

    from delivery_consumer.console.server import Recent

    release, asked = threading.Event(), threading.Semaphore(0)

    def build() -> str:
        assert release.wait(60)
        return "page"

    recent = Recent(build, ttl_s=600)
    pages: list[str] = []

    def ask() -> None:
        asked.release()
        pages.append(recent.get())

    threads = [threading.Thread(target=ask) for _ in range(20)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert asked.acquire(timeout=60)
    release.set()
    for thread in threads:
        thread.join()
    assert ["page"] * 20 == pages and 1 == recent.builds
    recent.forget()
    assert "page" == recent.get() and 2 == recent.builds


def test_dead_queue_reads_are_shared_and_so_are_their_failures(monkeypatch: Any) -> None:
    """deadletters.SharedReads: concurrent readers of one queue share one read (its snapshot, or its
    error), and a queue is read again once the snapshot is older than the time to live."""
    import threading

    from delivery_consumer.amqp.dead_queue import QueueBusy
    from delivery_consumer.amqp.topology import Topology
    from delivery_consumer.ops import deadletters

    now = [0.0]
    release = threading.Event()
    outcomes: list[Any] = [deadletters.Snapshot("q.dead", [], [], 0), QueueBusy("held by another reader")]

    def list_dead(url: str, topology: Topology, **_kwargs: Any) -> Any:
        assert release.wait(60)
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(deadletters, "list_dead", list_dead)
    shared = deadletters.SharedReads(5.0, clock=lambda: now[0])
    topo = Topology(consumer="catalog")
    got: list[Any] = []

    def read() -> None:
        try:
            got.append(shared.list("amqp://x", topo))
        except QueueBusy as exc:
            got.append(exc)

    threads = [threading.Thread(target=read) for _ in range(10)]
    for thread in threads:
        thread.start()
    release.set()
    for thread in threads:
        thread.join()
    assert 1 == shared.reads and 1 == len({id(snapshot) for snapshot in got})
    now[0] = 5.5  # older than its time to live: read again, and this time it fails for everyone
    threads = [threading.Thread(target=read) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 2 == shared.reads and all(isinstance(x, QueueBusy) for x in got[10:]) and 15 == len(got)
