"""``kill -9`` of one process of ``run``, the way supervisord or a hand at a
terminal does it: the main PID alone, or the worker alone. Whatever the moment
(idle, mid-batch, mid-call of a slow webhook, waiting for a confirm), no
process of that run may be alive 5 s later, and a restart applies every event
exactly once."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, RunProcess, kill, session_processes, wait_session_gone
from support import count_rows, new_event, read_rows, wait_until
from webhook_server import WebhookServer

pytestmark = pytest.mark.broker

CONSUMERS = ("catalog", "audit", "webhook")
#: Long enough a first retry delay that the webhook's read timeout (80 % of it) outlasts a slow call.
SLOW_TIERS = ("--retry-delays", "5s")


def worker_of(proc: RunProcess) -> int:
    """The worker process of a run (the other process of its session)."""
    wait_until("the worker process", lambda: len(session_processes(proc.pid)) == 2, procs=[proc])
    (worker,) = [pid for pid in session_processes(proc.pid) if pid != proc.pid]
    return worker


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    """A webhook endpoint that answers every call 50 ms late."""
    with WebhookServer(delay_s=0.05) as endpoint:
        yield endpoint


def start(ns: Namespace, consumer: str, server: WebhookServer, n: int, *args: str,
          **event: Any) -> tuple[RunProcess, dict[str, str], list[dict[str, Any]]]:
    """Publish *n* events for *consumer* and start run on them."""
    events = [new_event(article_id=f"a-{i}", **event) for i in range(n)]
    ns.publish([orjson.dumps(e) for e in events], declare=[consumer])
    env = ns.env(DELIVERY_WEBHOOK_URL=server.url)
    tiers = SLOW_TIERS if consumer == "webhook" else ()
    return ns.start_run(consumer, *tiers, *args, env=env), env, events


def restart_applies_each_once(ns: Namespace, consumer: str, server: WebhookServer, env: dict[str, str],
                              events: list[dict[str, Any]]) -> None:
    """Run again until idle: every event has one receipt, the webhook one effect per key, nothing dead."""
    tiers = SLOW_TIERS if consumer == "webhook" else ()
    done = ns.run_until_idle(consumer, *tiers, env=env, idle=2)
    assert 0 == done.returncode, done.stderr
    assert len(events) == count_rows(ns.db(consumer), "inbox")
    if consumer == "webhook":
        assert {f"a-{i}:1:notify" for i in range(len(events))} == set(server.effects())
        assert 1 == max(server.effects().values())
    topo = ns.topology(consumer)
    assert 0 == ns.count(topo.queue) + ns.count(topo.dead_queue)


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_kill_9_of_the_main_pid_when_idle_leaves_no_process(ns: Namespace, server: WebhookServer,
                                                             consumer: str) -> None:
    """Idle (everything applied): kill -9 of the main PID alone; the worker is gone within 5 s."""
    proc, _, events = start(ns, consumer, server, 3)
    worker_of(proc)
    wait_until("every receipt", lambda: count_rows(ns.db(consumer), "inbox") == len(events), procs=[proc])
    kill(proc, main_only=True)


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_kill_9_of_the_main_pid_mid_batch_leaves_no_process_and_loses_nothing(
        ns: Namespace, server: WebhookServer, consumer: str) -> None:
    """Mid-batch of a backlog: kill -9 of the main PID alone; nothing of the run is
    alive 5 s later, and a restart applies every event once (one effect per key)."""
    n = 60 if consumer == "webhook" else 3000
    proc, env, events = start(ns, consumer, server, n, "--batch", "20" if consumer == "webhook" else "100")
    wait_until("the first receipts", lambda: count_rows(ns.db(consumer), "inbox") > 0, procs=[proc])
    kill(proc, main_only=True)
    assert count_rows(ns.db(consumer), "inbox") < n
    restart_applies_each_once(ns, consumer, server, env, events)


def test_kill_9_of_the_main_pid_during_a_slow_call_leaves_no_process(ns: Namespace, server: WebhookServer) -> None:
    """While the webhook waits 3 s for an answer: kill -9 of the main PID alone;
    the worker is gone within 5 s and a restart notifies once (same key, one effect)."""
    proc, env, events = start(ns, "webhook", server, 1, title="slow:3")
    wait_until("the call", lambda: server.served > 0, procs=[proc])
    kill(proc, main_only=True)
    server.healed = True
    restart_applies_each_once(ns, "webhook", server, env, events)
    # the call was cut short by the kill of another process: not this message's crash
    assert [(0,)] == read_rows(ns.db("webhook"), "deliveries", "coalesce(sum(crashes), 0)")


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_kill_9_of_the_main_pid_awaiting_a_confirm_leaves_no_process(ns: Namespace, server: WebhookServer,
                                                                     consumer: str) -> None:
    """The main process dies (alone) right after publishing a dead-letter copy,
    before its confirm: the worker stops within 5 s; a restart leaves the bad
    message in the dead queue (at most twice) and every good one applied once."""
    good = [new_event(article_id=f"a-{i}") for i in range(3)]
    ns.publish([orjson.dumps(good[0]), b"{not json", *(orjson.dumps(e) for e in good[1:])], declare=[consumer])
    env = ns.env(DELIVERY_WEBHOOK_URL=server.url, DELIVERY_CRASH_AT="connection-awaiting-confirm")
    tiers = SLOW_TIERS if consumer == "webhook" else ()
    proc = ns.start_run(consumer, *tiers, env=env)
    proc.wait(60)
    assert -signal.SIGKILL == proc.returncode
    assert [] == wait_session_gone(proc.pid, 5.0), proc.output()[1]
    proc.communicate()
    env.pop("DELIVERY_CRASH_AT")
    done = ns.run_until_idle(consumer, *tiers, env=env, idle=2)
    assert 0 == done.returncode, done.stderr
    assert 3 == count_rows(ns.db(consumer), "inbox")
    dead = ns.drain(ns.topology(consumer).dead_queue)
    assert 1 <= len(dead) <= 2 and {b"{not json"} == {body for _, body in dead}


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_kill_9_of_the_worker_stops_the_main_process(ns: Namespace, server: WebhookServer, consumer: str) -> None:
    """kill -9 of the worker alone mid-batch: the main process stops too (killed
    the same way, acking nothing more), and a restart applies every event once."""
    n = 60 if consumer == "webhook" else 3000
    proc, env, events = start(ns, consumer, server, n, "--batch", "20" if consumer == "webhook" else "100")
    worker = worker_of(proc)
    wait_until("the first receipts", lambda: count_rows(ns.db(consumer), "inbox") > 0, procs=[proc])
    os.kill(worker, signal.SIGKILL)
    proc.communicate(timeout=10)
    assert -signal.SIGKILL == proc.returncode
    assert [] == wait_session_gone(proc.pid, 5.0)
    restart_applies_each_once(ns, consumer, server, env, events)
