"""The ledger test, in the spirit of a chaos rig: thousands of events with
duplicates and out-of-order revisions go through the real broker to two real
``run`` processes (catalog and audit) that are SIGKILLed at random moments
-- the main PID alone in some rounds (supervisord, ``kill -9 PID``), the whole
process group in others (systemd, a container stop) -- and restarted, then
drained. The ledger must balance exactly."""

from __future__ import annotations

import functools
import os
import random

import orjson
import pytest
from brokerkit import Namespace, RunProcess, kill
from support import count_rows, new_event, read_rows, wait_until

ARTICLES = 300
REVISIONS = 10  # 3000 distinct events
KILLS = 4


def make_stream(rng: random.Random) -> tuple[list[dict[str, object]], list[bytes], list[bytes]]:
    """Distinct events, the shuffled stream with duplicates, and the bad bodies."""
    events = []
    for a in range(ARTICLES):
        for r in range(1, REVISIONS + 1):
            kind = "material.withdrawn" if rng.random() < 0.2 else "material.published"
            events.append(new_event(article_id=f"article-{a}", revision=r, type=kind,
                                    title=f"Статья {a}, редакция {r}", url=f"https://example.org/a/{a}/{r}"))
    bad = [b"{broken json %d" % i for i in range(10)]
    bad += [orjson.dumps({**new_event(), "revision": 0, "articleId": f"bad-{i}"}) for i in range(5)]
    bad += [b"\xff\xfe\x00 not utf-8 %d" % i for i in range(5)]
    stream = [orjson.dumps(e) for e in events]
    stream += [orjson.dumps(e) for e in rng.sample(events, len(events) // 5)]  # redeliveries by the producer
    stream += bad
    rng.shuffle(stream)  # out-of-order revisions
    return events, stream, bad


def expected_catalog(events: list[dict[str, object]]) -> list[tuple[object, ...]]:
    latest: dict[str, dict[str, object]] = {}
    for e in events:
        current = latest.get(str(e["articleId"]))
        if current is None or int(e["revision"]) > int(current["revision"]):  # type: ignore[call-overload]
            latest[str(e["articleId"])] = e
    return sorted(
        (a, e["revision"], e["data"]["title"], e["data"]["url"],  # type: ignore[index]
         int(e["type"] == "material.published"), e["eventId"])
        for a, e in latest.items()
    )


def progressed(ns: Namespace, procs: dict[str, RunProcess], targets: dict[str, int]) -> bool:
    """Each run has committed its target number of receipts, or exited."""
    return all(p.poll() is not None or count_rows(ns.db(c), "inbox") >= targets[c] for c, p in procs.items())


@pytest.mark.slow
def test_ledger_balances_after_random_kills(ns: Namespace) -> None:
    """Every distinct eventId has one receipt, audit holds exactly the distinct
    events, the catalog equals the expected final state and the dead queues
    hold exactly the deliberately bad messages, despite random SIGKILLs."""
    rng = random.Random(int(os.environ.get("LEDGER_SEED", "20261130")))
    events, stream, bad = make_stream(rng)
    ns.publish(stream, declare=["catalog", "audit"])
    args = {"catalog": ("--batch", "50", "--prefetch", "100"), "audit": ("--batch", "20", "--prefetch", "60")}
    kills = {"catalog": 0, "audit": 0}
    for round_ in range(KILLS):
        procs = {c: ns.start_run(c, *a) for c, a in args.items()}
        # Killed at a random point of their progress: once each has committed a random
        # number of receipts more (or exited), wherever that finds it. A target is never
        # past the last distinct event: a run that has applied everything waits for more
        # deliveries and would never reach it.
        targets = {c: min(len(events), count_rows(ns.db(c), "inbox") + rng.randint(1, len(events) // KILLS))
                   for c in procs}
        wait_until("each run's next receipts", functools.partial(progressed, ns, procs, targets), timeout=300)
        for consumer, proc in procs.items():
            if proc.poll() is None:
                kill(proc, main_only=round_ % 2 == 0)
                kills[consumer] += 1
            else:  # it may only have died from the kill of an earlier round's straggler
                proc.communicate()
    for consumer, a in args.items():
        done = ns.run_until_idle(consumer, *a, idle=2, timeout=300)
        assert 0 == done.returncode, done.stderr
    assert kills["catalog"] >= 2 and kills["audit"] >= 2, kills

    distinct = {str(e["eventId"]) for e in events}
    catalog_db, audit_db = ns.db("catalog"), ns.db("audit")
    for db in (catalog_db, audit_db):
        assert [(len(distinct), len(distinct))] == read_rows(db, "inbox", "count(*), count(DISTINCT event_id)")
        assert distinct == {row[0] for row in read_rows(db, "inbox", "event_id")}
    assert [(len(distinct),)] == read_rows(audit_db, "audit", "count(*)")
    assert distinct == {row[0] for row in read_rows(audit_db, "audit", "event_id")}
    assert expected_catalog(events) == read_rows(
        catalog_db, "catalog", "article_id, revision, title, url, published, event_id")
    for consumer in ("catalog", "audit"):
        topo = ns.topology(consumer)
        assert 0 == ns.count(topo.queue)
        dead = ns.drain(topo.dead_queue)
        assert set(bad) == {body for _, body in dead}
        # a duplicate dead copy is possible only for a kill between its confirm and the ack
        assert len(bad) <= len(dead) <= len(bad) + kills[consumer]
