"""Failure paths of ``run`` and ``publish`` against the real broker: bad bodies,
transient errors and retries, poison messages, signals, broker restarts, and
the errors that must stop the process with one clear line."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import flaky_consumer  # noqa: F401  (registers the "flaky" consumer in this process too)
import orjson
import pytest
from brokerkit import Namespace, RabbitNode, kill
from support import count_rows, new_event, read_rows, wait_until

FAST_RETRY = ("--retry-delays", "100ms,200ms,300ms")


def flaky_env(ns: Namespace) -> dict[str, str]:
    return ns.env(DELIVERY_PLUGINS="flaky_consumer", FLAKY_DIR=str(ns.workdir / "flaky"))


def test_malformed_bodies_are_dead_lettered_while_consumer_keeps_running(ns: Namespace) -> None:
    """Not JSON, not UTF-8 and over-size bodies go to the dead queue with their
    code and a safe reason; the valid events around them are applied."""
    good = [orjson.dumps(new_event(article_id=f"a-{i}")) for i in range(4)]
    huge = orjson.dumps(new_event(article_id="huge", title="x" * 3000))
    bodies = [good[0], b"\xff\xfe not utf-8", good[1], b"{not json", good[2], huge, b"[1, 2]", good[3]]
    ns.publish(bodies, declare=["audit"])
    done = ns.run_until_idle("audit", "--max-bytes", "2048")
    assert 0 == done.returncode, done.stderr
    db = ns.db("audit")
    assert 4 == len(read_rows(db, "audit"))
    dead = ns.drain(ns.topology("audit").dead_queue)
    codes = sorted(props.headers["x-error-code"] for props, _ in dead)
    assert ["invalid-envelope", "malformed-json", "malformed-json", "malformed-json"] == codes
    for props, body in dead:
        assert "audit" == props.headers["x-consumer"]
        assert 1 == props.headers["x-attempts"]
        assert props.headers["x-failed-at"].endswith("Z")
        assert body[:20].decode("utf-8", "replace") not in props.headers["x-error-reason"]
    assert 4 == len(read_rows(db, "rejected", where="dead_letter IS NOT NULL"))


def test_transient_failure_retries_through_tiers_then_succeeds(ns: Namespace) -> None:
    """A handler that fails twice transiently is retried via the TTL tiers and
    applied once on the third try; the attempts are counted durably."""
    event = new_event(article_id="retry-me", title="transient:2")
    ns.publish([orjson.dumps(event)], declare=["flaky"])
    done = ns.run_until_idle("flaky", *FAST_RETRY, env=flaky_env(ns), idle=3)
    assert 0 == done.returncode, done.stderr
    db = ns.db("flaky")
    assert [("recorded",)] == read_rows(db, "inbox", "result")
    assert [(1,)] == read_rows(db, "flaky", "count(*)")
    assert [(3, "recorded")] == read_rows(db, "deliveries", "attempts, last_outcome")
    assert "retry copy sent" in done.stderr


def test_transient_failure_exhausts_retries_into_dead_queue(ns: Namespace) -> None:
    """After --max-attempts transient failures the event is dead-lettered
    retries-exhausted with its attempt count, never retried forever."""
    event = new_event(article_id="never", title="transient:99")
    ns.publish([orjson.dumps(event)], declare=["flaky"])
    done = ns.run_until_idle("flaky", *FAST_RETRY, "--max-attempts", "3", env=flaky_env(ns), idle=3)
    assert 0 == done.returncode, done.stderr
    (props, body), = ns.drain(ns.topology("flaky").dead_queue)
    assert orjson.loads(body) == event
    assert "retries-exhausted" == props.headers["x-error-code"]
    assert 3 == props.headers["x-attempts"]
    assert "dependency-down" in props.headers["x-error-reason"]
    assert 3 == int((ns.workdir / "flaky" / f"{event['eventId']}.tries").read_text())
    db = ns.db("flaky")
    assert [] == read_rows(db, "inbox")
    assert [("retries-exhausted", 3)] == read_rows(db, "rejected", "code, attempts")


def test_poison_message_reaches_dead_queue_and_does_not_stall(ns: Namespace) -> None:
    """A message that kills the process every time is dead-lettered delivery-limit
    after exactly --max-crashes crashes while handled alone (a death in a batch
    only makes suspects); every other message is applied once, none gets a crash."""
    before = [orjson.dumps(new_event(article_id=f"a-{i}")) for i in range(5)]
    poison_event = new_event(article_id="p", title="poison")
    poison = orjson.dumps(poison_event)
    after = [orjson.dumps(new_event(article_id=f"b-{i}")) for i in range(5)]
    ns.publish([*before, poison, *after], declare=["flaky"])
    env = flaky_env(ns)
    deaths = 0
    for _ in range(10):
        done = ns.run_until_idle("flaky", "--max-crashes", "2", env=env, idle=2)
        if done.returncode == 0:
            break
        assert -signal.SIGKILL == done.returncode, done.stderr
        deaths += 1
    assert 0 == done.returncode, done.stderr
    assert deaths in (2, 3)  # 3 when the first death was in a batch
    db = ns.db("flaky")
    assert [(10,)] == read_rows(db, "flaky", "count(*)")
    (props, body), = ns.drain(ns.topology("flaky").dead_queue)
    assert poison == body
    assert "delivery-limit" == props.headers["x-error-code"]
    assert 0 == ns.count(ns.topology("flaky").queue)
    assert [(poison_event["eventId"], 2)] == read_rows(db, "deliveries", "key, crashes", "crashes > 0")
    traced = ns.cli("trace", poison_event["eventId"], "--db", str(db), "--json", env=env)
    assert 2 == orjson.loads(traced.stdout)["deliveries"]["crashes"], traced.stderr


def test_an_event_with_a_receipt_is_answered_from_it_whatever_its_crashes(ns: Namespace) -> None:
    """An applied event whose key counts --max-crashes crashes is answered
    duplicate:<result> from its receipt when it comes again, never dead-lettered."""
    event = new_event(article_id="applied")
    source = ns.workdir / "event.json"
    source.write_bytes(orjson.dumps(event))
    db = ns.db("audit")
    assert 0 == ns.cli("replay", "--consumer", "audit", "--db", str(db), str(source)).returncode
    ns.publish([orjson.dumps(event)], declare=["audit"])
    crashed = ns.run_until_idle("audit", env=ns.env(DELIVERY_CRASH_AT="before-commit"), idle=5)
    assert -signal.SIGKILL == crashed.returncode, crashed.stderr
    conn = sqlite3.connect(db)
    conn.execute("UPDATE deliveries SET crashes = 5")  # as if it had killed the process alone 5 times
    conn.commit()
    conn.close()
    done = ns.run_until_idle("audit", "--max-crashes", "3")
    assert 0 == done.returncode, done.stderr
    assert 0 == ns.count(ns.topology("audit").dead_queue) + ns.count(ns.topology("audit").queue)
    assert [(event["eventId"], "duplicate:recorded")] == read_rows(db, "deliveries", "key, last_outcome")
    assert [(1,)] == read_rows(db, "audit", "count(*)")


def test_sigterm_finishes_batch_and_exits_zero(ns: Namespace) -> None:
    """SIGTERM while consuming: the process acks what it committed and exits 0;
    a restart applies the rest, each event once."""
    ns.publish([orjson.dumps(new_event(article_id=f"a-{i}")) for i in range(2000)], declare=["audit"])
    proc = ns.start_run("audit", "--batch", "50", "--prefetch", "100")
    db = ns.db("audit")
    wait_until("100 receipts", lambda: count_rows(db, "inbox") > 100, procs=[proc])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert 0 == proc.returncode, err
    assert "SIGTERM received" in err
    done = ns.run_until_idle("audit")
    assert 0 == done.returncode, done.stderr
    assert [(2000, 2000)] == read_rows(db, "audit", "count(*), count(DISTINCT event_id)")
    assert [(2000,)] == read_rows(db, "inbox", "count(*)")


@pytest.mark.slow
def test_broker_restart_mid_consumption(private_ns: Namespace, private_broker: RabbitNode) -> None:
    """A broker restart (a private node's) while consuming: run reconnects with backoff, consumes
    what is published after the restart, and every event is applied exactly once."""
    ns = private_ns
    before = [orjson.dumps(new_event(article_id=f"a-{i}")) for i in range(3000)]
    ns.publish(before, declare=["audit"])
    proc = ns.start_run("audit", "--batch", "20", "--prefetch", "40")
    db = ns.db("audit")
    try:
        wait_until("200 receipts", lambda: count_rows(db, "inbox") > 200, procs=[proc])
        private_broker.restart()  # run may have applied every event by now: it stays to reconnect
        proc.wait_for_log("reconnecting")
        ns.publish([orjson.dumps(new_event(article_id=f"b-{i}")) for i in range(1000)])
        wait_until("4000 receipts", lambda: count_rows(db, "inbox") == 4000, 120, [proc])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.returncode is None:
            kill(proc)
    assert 0 == proc.returncode, err
    assert [(4000, 4000)] == read_rows(db, "audit", "count(*), count(DISTINCT event_id)")
    assert [(4000,)] == read_rows(db, "inbox", "count(*)")


def test_bad_credentials_exit_2_with_one_line(ns: Namespace) -> None:
    """Wrong password: run and publish stop with one clear line, exit 2, no retry loop."""
    bad = ns.url.replace("guest:guest", "guest:wrong")
    env = ns.env(DELIVERY_AMQP_URL=bad)
    started = time.monotonic()
    done = ns.cli("run", "--consumer", "catalog", "--db", str(ns.db("catalog")), env=env, timeout=60)
    assert 2 == done.returncode
    assert "authentication failed" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 30
    published = ns.cli("publish", str(Path(__file__).resolve().parents[2] / "sample_events"), env=env)
    assert 2 == published.returncode
    assert "authentication failed" in published.stderr


def test_missing_vhost_exits_2(ns: Namespace) -> None:
    """A vhost that does not exist is reported as such, exit 2."""
    env = ns.env(DELIVERY_AMQP_URL=ns.url.rsplit("/", 1)[0] + "/no-such-vhost")
    done = ns.cli("run", "--consumer", "catalog", "--db", str(ns.db("catalog")), env=env, timeout=60)
    assert 2 == done.returncode
    assert "vhost" in done.stderr
    assert "Traceback" not in done.stderr


def test_unusable_database_exits_2_before_consuming(ns: Namespace) -> None:
    """A database of another consumer (or a corrupt file) stops run at once, exit 2."""
    other = ns.cli("init", "--consumer", "audit", "--db", str(ns.workdir / "audit.db"))
    assert 0 == other.returncode, other.stderr
    done = ns.cli("run", "--consumer", "catalog", "--db", str(ns.workdir / "audit.db"), timeout=60)
    assert 2 == done.returncode
    assert "belongs to consumer 'audit'" in done.stderr
    corrupt = ns.workdir / "corrupt.db"
    corrupt.write_bytes(b"this is not sqlite" * 100)
    done = ns.cli("run", "--consumer", "catalog", "--db", str(corrupt), timeout=60)
    assert 2 == done.returncode
    assert "Traceback" not in done.stderr


def test_broker_down_run_keeps_retrying_and_stops_on_sigterm(ns: Namespace) -> None:
    """With nothing listening, run retries with backoff -- one warning for the
    outage, each further attempt at debug level -- and SIGTERM still stops it cleanly."""
    env = ns.env(DELIVERY_AMQP_URL="amqp://guest:guest@127.0.0.1:1/%2F")
    proc = ns.start_run("catalog", "--log-level", "debug", env=env)
    wait_until("a third attempt", lambda: "(attempt 3)" in proc.output()[1], procs=[proc])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert 0 == proc.returncode, err
    warnings = [line for line in err.splitlines() if "WARNING" in line and "reconnecting in" in line]
    assert 1 == len(warnings), err


def test_one_shot_run_against_an_unreachable_broker_exits_2(ns: Namespace) -> None:
    """run --exit-when-idle with a wrong port: retried for the idle time only, then one line naming the
    broker, exit 2."""
    env = ns.env(DELIVERY_AMQP_URL="amqp://guest:guest@127.0.0.1:1/%2F")
    done = ns.cli("run", "--consumer", "catalog", "--db", str(ns.db("catalog")), "--exit-when-idle", "2",
                  env=env, timeout=60)
    assert 2 == done.returncode
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("delivery-consumer: the broker could not be reached in 2s"), done.stderr
    assert "unreachable" in last
    assert "Traceback" not in done.stderr


def test_broker_down_publish_exits_2(ns: Namespace) -> None:
    """publish with the broker unreachable: one line naming the broker, exit 2."""
    env = ns.env(DELIVERY_AMQP_URL="amqp://guest:guest@127.0.0.1:1/%2F")
    done = ns.cli("publish", str(Path(__file__).resolve().parents[2] / "sample_events"), env=env)
    assert 2 == done.returncode
    assert "unreachable" in done.stderr
    assert "Traceback" not in done.stderr


def test_publish_reports_invalid_and_unroutable(ns: Namespace) -> None:
    """Invalid envelopes are not sent; with no queue bound every message is
    unroutable, named, and the exit code is 1."""
    src = ns.workdir / "events.ndjson"
    valid = [new_event(article_id=f"a-{i}") for i in range(3)]
    src.write_bytes(b"\n".join([*(orjson.dumps(e) for e in valid), b"{oops"]) + b"\n")
    done = ns.cli("publish", "--json", str(src))
    assert 1 == done.returncode
    lines = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert ["malformed-json"] == [x["rejected"] for x in lines if "rejected" in x]
    assert {e["eventId"] for e in valid} == {x["eventId"] for x in lines if x.get("published") == "returned"}


def test_publish_confirms_and_consumer_sees_all(ns: Namespace) -> None:
    """publish with --consumer declares the queue; every message is confirmed (exit 0) and delivered."""
    src = ns.workdir / "events.ndjson"
    events = [new_event(article_id=f"a-{i % 50}", revision=i // 50 + 1) for i in range(500)]
    src.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    done = ns.cli("publish", "--consumer", "catalog", str(src))
    assert 0 == done.returncode, done.stderr
    assert "500 confirmed" in done.stderr
    assert 500 == ns.count(ns.topology("catalog").queue)


def test_ack_after_commit_is_visible_to_the_broker(ns: Namespace) -> None:
    """While run holds deliveries it has not committed, the broker still owns them:
    a SIGKILL returns them all to the queue."""
    ns.publish([orjson.dumps(new_event(article_id=f"a-{i}")) for i in range(50)], declare=["audit"])
    env = ns.env(DELIVERY_CRASH_AT="before-commit")
    done = ns.run_until_idle("audit", env=env, idle=5)
    assert -signal.SIGKILL == done.returncode
    assert 50 == ns.count(ns.topology("audit").queue)
    assert [(0,)] == read_rows(ns.db("audit"), "inbox", "count(*)")


def test_topology_declare_is_idempotent(ns: Namespace) -> None:
    """topology declare twice succeeds and names the queues."""
    for _ in range(2):
        done = ns.cli("topology", "declare", "--consumer", "catalog", "--consumer", "audit")
        assert 0 == done.returncode, done.stderr
    assert f"{ns.prefix}.catalog.dead" in done.stdout
    assert f"{ns.prefix}.audit.retry.60000ms" in done.stdout
    mismatch = ns.cli("topology", "declare", "--consumer", "catalog", "--delivery-limit", "7")
    assert 2 == mismatch.returncode
    assert "precondition failed" in mismatch.stderr


def test_run_rejects_batch_larger_than_prefetch(ns: Namespace) -> None:
    """--batch larger than --prefetch can never fill: refused as a usage error."""
    done = ns.cli("run", "--consumer", "catalog", "--batch", "500", "--prefetch", "100")
    assert 2 == done.returncode
    assert "--prefetch" in done.stderr


