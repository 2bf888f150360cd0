"""Crash tests: a real ``run`` process SIGKILLed at each boundary of the
delivery protocol, then restarted. Nothing may be lost, nothing applied twice.

The kill is exact: ``DELIVERY_CRASH_AT=<point>`` makes the process SIGKILL
itself when it reaches that point (delivery_consumer/model/faults.py).
"""

from __future__ import annotations

import re
import signal

import flaky_consumer  # noqa: F401  (registers the "flaky" consumer here too)
import orjson
from brokerkit import Namespace
from support import new_event, read_rows

FAST_RETRY = ("--retry-delays", "100ms,200ms,300ms")


def events(n: int, **kwargs: object) -> list[bytes]:
    return [orjson.dumps(new_event(article_id=f"article-{i}", **kwargs)) for i in range(n)]


def crash_then_recover(ns: Namespace, consumer: str, point: str, *args: str) -> str:
    """Run until the crash point kills the process, then run again until idle;
    returns the second run's log."""
    env = ns.env(DELIVERY_CRASH_AT=point, DELIVERY_PLUGINS="flaky_consumer", FLAKY_DIR=str(ns.workdir / "flaky"))
    crashed = ns.run_until_idle(consumer, *args, env=env, idle=5)
    assert -signal.SIGKILL == crashed.returncode, crashed.stderr
    assert f"crash point {point} reached" in crashed.stderr
    env.pop("DELIVERY_CRASH_AT")
    recovered = ns.run_until_idle(consumer, *args, env=env)
    assert 0 == recovered.returncode, recovered.stderr
    return recovered.stderr


def test_crash_before_commit_loses_nothing(ns: Namespace) -> None:
    """SIGKILL before COMMIT: nothing was applied, the restart applies every event once."""
    ns.publish(events(30), declare=["audit"])
    crash_then_recover(ns, "audit", "before-commit", "--batch", "10")
    db = ns.db("audit")
    assert [(30,)] == read_rows(db, "inbox", "count(*)")
    assert [(30,)] == read_rows(db, "audit", "count(*)")
    assert [(30,)] == read_rows(db, "inbox", "count(*)", where="result = 'recorded'")
    assert 0 == ns.count(ns.topology("audit").queue)


def test_crash_after_commit_before_ack_applies_once(ns: Namespace) -> None:
    """SIGKILL between COMMIT and ack: the redelivered batch is absorbed as duplicates."""
    ns.publish(events(30), declare=["audit"])
    log = crash_then_recover(ns, "audit", "after-commit", "--batch", "10")
    db = ns.db("audit")
    assert [(30,)] == read_rows(db, "inbox", "count(*)")
    assert [(30,)] == read_rows(db, "audit", "count(*)")
    # The first batch (up to 10 events: fewer when the rest had not arrived
    # within the batch's wait) was committed, then redelivered after the crash
    # with the others that had been prefetched: answered from its receipts.
    answered = re.search(r"(\d+) recorded, (\d+) duplicate:recorded", log)
    assert answered is not None, log[-2000:]
    fresh, duplicates = int(answered[1]), int(answered[2])
    assert 30 == fresh + duplicates and 1 <= duplicates <= 10
    assert [(30,)] == read_rows(db, "deliveries", "count(*)", where="redeliveries > 0 AND deliveries = 2")
    assert 0 == ns.count(ns.topology("audit").queue)


def test_crash_after_retry_copy_confirmed_applies_once(ns: Namespace) -> None:
    """SIGKILL after the retry copy is confirmed but before the original's ack:
    the original and the copy both come back, the effect happens once."""
    bodies = [*events(5), orjson.dumps(new_event(article_id="flaky-1", title="transient:1"))]
    ns.publish(bodies, declare=["flaky"])
    crash_then_recover(ns, "flaky", "after-retry-confirm", *FAST_RETRY)
    db = ns.db("flaky")
    assert [(6,)] == read_rows(db, "inbox", "count(*)")
    assert [(6,)] == read_rows(db, "flaky", "count(*)")
    topo = ns.topology("flaky", retry_delays_ms=(100, 200, 300))
    assert 0 == ns.count(topo.queue) + ns.count(topo.retry_queue(0)) + ns.count(topo.dead_queue)


def test_crash_after_dead_copy_confirmed_loses_nothing(ns: Namespace) -> None:
    """SIGKILL after the dead-letter copy is confirmed but before the ack: the
    bad message is in the dead queue (at worst twice), the good ones apply once."""
    bad = b'{"eventId": "not json'
    ns.publish([*events(3), bad, *events(3)], declare=["audit"])
    crash_then_recover(ns, "audit", "after-dead-confirm")
    db = ns.db("audit")
    assert [(6,)] == read_rows(db, "audit", "count(*)")
    assert [(6,)] == read_rows(db, "inbox", "count(*)")
    dead = ns.drain(ns.topology("audit").dead_queue)
    assert {bad} == {body for _, body in dead}
    assert 1 <= len(dead) <= 2
    assert {"malformed-json"} == {props.headers["x-error-code"] for props, _ in dead}
    assert 1 <= read_rows(db, "rejected", "count(*)", where="code = 'malformed-json'")[0][0]
