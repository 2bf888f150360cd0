"""``dead list / requeue / purge`` against the real broker, real consumer
databases and real processes, SIGKILL included.

Dead letters are made the way production makes them: ``run --max-bytes 2048``
dead-letters large bodies ``invalid-envelope`` (and records them in
``rejected``); the "fix" is running again with the default limit. Broker-side
dead letters come from a main queue with ``x-delivery-limit`` 1.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pika
from brokerkit import Namespace
from support import new_event, read_rows, wait_until

from delivery_consumer import consumers
from delivery_consumer.amqp.admin import declare
from delivery_consumer.amqp.dead_queue import DeadQueue
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.model.deliveries import OutMessage
from delivery_consumer.store.sqlite import now_iso

SMALL_LIMIT = ("--max-bytes", "2048")


def big_events(n: int) -> list[dict[str, Any]]:
    return [new_event(article_id=f"big-{i}", title=f"{i} " + "x" * 3000) for i in range(n)]


def make_dead_letters(ns: Namespace, n: int, consumer: str = "catalog") -> list[str]:
    """*n* events dead-lettered invalid-envelope by run; returns their eventIds in publication order."""
    events = big_events(n)
    ns.publish([orjson.dumps(e) for e in events], declare=[consumer])
    done = ns.run_until_idle(consumer, *SMALL_LIMIT, idle=1)
    assert 0 == done.returncode, done.stderr
    assert n == ns.count(ns.topology(consumer).dead_queue)
    return [e["eventId"] for e in events]


def ids(messages: list[tuple[Any, bytes]]) -> list[str]:
    return [props.message_id for props, _ in messages]


def age_rejections(db: Path, seconds: float = 60) -> None:
    """Make the rejections older, as if the dead letters had waited a while."""
    conn = sqlite3.connect(db)
    try:
        conn.execute("UPDATE rejected SET rejected_at = ?", (now_iso(time.time() - seconds),))
        conn.commit()
    finally:
        conn.close()


def dead_json(ns: Namespace, *args: str) -> dict[str, Any]:
    done = ns.cli("dead", "list", "--consumer", "catalog", "--json", *args)
    assert 0 == done.returncode, done.stderr
    result: dict[str, Any] = orjson.loads(done.stdout)
    return result


def requeue(ns: Namespace, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return ns.cli("dead", "requeue", "--consumer", "catalog", "--db", str(ns.db("catalog")), *args, env=env)


# -- list --------------------------------------------------------------------------


def test_list_shows_code_reason_attempts_and_gives_everything_back(ns: Namespace) -> None:
    """dead list names each runner dead letter with its code, reason, attempts and
    failed-at, counts them by code, and leaves the queue exactly as it was."""
    event_ids = make_dead_letters(ns, 3)
    dead_queue = ns.topology("catalog").dead_queue
    before = ids(ns.peek(dead_queue))
    listed = dead_json(ns)
    assert event_ids == [m["eventId"] for m in listed["messages"]]
    assert {"invalid-envelope": 3} == listed["byCode"]
    assert listed["complete"]
    first = listed["messages"][0]
    assert (1, 1, "material.published", "catalog") == (
        first["position"], first["attempts"], first["routingKey"], first["consumer"])
    assert "over the limit of 2048" in first["reason"]
    assert first["failedAt"].endswith("Z")
    assert before == ids(ns.peek(dead_queue))
    text = ns.cli("dead", "list", "--consumer", "catalog")
    assert 0 == text.returncode, text.stderr
    assert "invalid-envelope      3" in text.stdout
    assert f"3 dead letters in {dead_queue}" in text.stderr


def test_list_names_broker_dead_letters_by_their_x_death(ns: Namespace) -> None:
    """A message the broker dead-lettered past x-delivery-limit has none of our headers:
    dead list reports it as delivery-limit with the broker's reason and routing key."""
    topo = ns.topology("catalog", delivery_limit=1)
    declare(ns.url, [topo])
    event = new_event()
    ns.publish([orjson.dumps(event)])
    conn, ch = ns.channel()
    try:
        for _ in range(2):
            method, _props, _body = ch.basic_get(topo.queue, auto_ack=False)
            ch.basic_reject(method.delivery_tag, requeue=True)
    finally:
        conn.close()
    wait_until("the broker to dead-letter it", lambda: ns.count(topo.dead_queue) == 1)
    (letter,) = dead_json(ns)["messages"]
    assert ("delivery-limit", event["eventId"], "material.published") == (
        letter["code"], letter["eventId"], letter["routingKey"])
    assert "dead-lettered by the broker from " + topo.queue in letter["reason"]


def test_list_while_dead_letters_arrive_loses_and_reorders_nothing(ns: Namespace) -> None:
    """Dead letters published during a listing stay behind the listed ones; the listing
    is the queue's head in order, and afterwards the queue holds every message in
    publication order."""
    topo = ns.topology("catalog")
    declare(ns.url, [topo])
    body = orjson.dumps(new_event())
    head = [f"m{i:05d}" for i in range(3000)]
    with Publisher(ns.url) as pub:
        results = pub.publish([OutMessage(topo.dead_queue, body, message_id=m, headers={"x-error-code": "test"})
                               for m in head])
    assert all(r.ok for r in results)
    late: list[str] = []
    stop = threading.Event()
    listing_done = threading.Event()
    late_during_listing: list[int] = []

    def publish_late() -> None:
        conn = pika.BlockingConnection(pika.URLParameters(ns.url))
        ch = conn.channel()
        ch.confirm_delivery()
        i = 0
        while not stop.is_set():
            mid = f"late{i:05d}"
            ch.basic_publish("", topo.dead_queue, body, pika.BasicProperties(delivery_mode=2, message_id=mid))
            late.append(mid)
            if listing_done.is_set() and not late_during_listing:
                late_during_listing.append(len(late))
            i += 1
            time.sleep(0.002)  # paces the publisher, so that the listing is not starved; no test waits on it
        conn.close()

    thread = threading.Thread(target=publish_late)
    thread.start()
    try:
        wait_until("5 late dead letters", lambda: len(late) >= 5)
        listed = dead_json(ns)
        listing_done.set()
        wait_until("a late dead letter after the listing", lambda: late_during_listing)
    finally:
        stop.set()
        thread.join()
    assert late_during_listing and late_during_listing[0] > 5  # messages did arrive while it listed
    published = head + late
    listed_ids = [m["messageId"] for m in listed["messages"]]
    assert len(listed_ids) >= len(head)
    assert published[: len(listed_ids)] == listed_ids
    assert published == ids(ns.drain(topo.dead_queue, timeout=30))


def test_second_reader_is_refused_while_one_holds_the_queue(ns: Namespace) -> None:
    """While one dead command holds the dead queue for longer than the wait, another says once
    that it waits, then is refused with one line (exit 2); the held messages are back afterwards."""
    make_dead_letters(ns, 1)
    dead_queue = ns.topology("catalog").dead_queue
    with DeadQueue(ns.url, dead_queue) as holder:
        holder.open()
        assert 1 == len(holder.read())
        done = ns.cli("dead", "list", "--consumer", "catalog")
        assert 2 == done.returncode
        waiting, refused = done.stderr.strip().splitlines()
        assert "in use by another reader" in waiting and "waiting up to 15s" in waiting
        assert "in use by another reader" in refused
    assert 1 == ns.count(dead_queue)


def test_a_reader_waits_for_a_short_hold_instead_of_failing(ns: Namespace) -> None:
    """dead list started while another reader (a console's read) holds the queue waits for it:
    once the holder lets go, the list succeeds with every dead letter (exit 0)."""
    from brokerkit import RunProcess

    event_ids = make_dead_letters(ns, 2)
    dead_queue = ns.topology("catalog").dead_queue
    with DeadQueue(ns.url, dead_queue) as holder:
        holder.open()
        assert 2 == len(holder.read())
        listing = RunProcess([sys.executable, "-m", "delivery_consumer", "dead", "list", "--consumer", "catalog",
                              "--json"], cwd=ns.workdir, env=ns.env())
        try:
            wait_until("dead list to say it waits", lambda: "waiting up to" in listing.output()[1], procs=[listing])
        except BaseException:
            listing.kill()
            raise
    out, err = listing.communicate(timeout=120)
    assert 0 == listing.returncode, err
    assert event_ids == [m["eventId"] for m in orjson.loads(out)["messages"]]


# -- requeue -----------------------------------------------------------------------


def test_requeue_sends_fresh_copies_resolves_rejections_and_applies_once(ns: Namespace) -> None:
    """requeue --code: copies go to the consumer's queue without x-attempts/x-error-*,
    keeping x-original-routing-key, with a fresh crash count; the dead queue empties,
    the rejections are resolved, and the next run applies each event once."""
    event_ids = make_dead_letters(ns, 5)
    topo = ns.topology("catalog")
    db = ns.db("catalog")
    conn = sqlite3.connect(db)
    with conn:  # as if the first one had killed the process twice (a poison message)
        conn.execute("UPDATE deliveries SET crashes = 2, last_outcome = 'in-flight' WHERE key = ?", (event_ids[0],))
    conn.close()
    done = requeue(ns, "--code", "invalid-envelope")
    assert 0 == done.returncode, done.stderr
    assert [(0, "requeued")] == read_rows(db, "deliveries", "crashes, last_outcome", where="key = ?",
                                                params=[event_ids[0]])
    assert 5 == done.stdout.count("requeued ")
    assert 0 == ns.count(topo.dead_queue)
    copies = ns.peek(topo.queue)
    assert event_ids == ids(copies)
    for props, _body in copies:
        headers = props.headers
        assert not {"x-attempts", "x-error-code", "x-error-reason", "x-failed-at", "x-death"} & set(headers)
        assert "material.published" == headers["x-original-routing-key"]
        assert 1 == headers["x-requeues"]
    assert [(5, 5)] == read_rows(db, "rejected", "count(*), count(resolved_at)")
    ran = ns.run_until_idle("catalog", idle=1)
    assert 0 == ran.returncode, ran.stderr
    assert sorted((e, "updated") for e in event_ids) == read_rows(db, "inbox", "event_id, result")
    assert 0 == ns.count(topo.queue)
    traced = ns.cli("trace", "--db", str(db), "--json", event_ids[0])
    assert 0 == traced.returncode, traced.stderr
    shown = orjson.loads(traced.stdout)
    assert ("applied", 2) == (shown["status"], shown["deliveries"]["deliveries"])
    assert [("invalid-envelope", True)] == [(r["code"], r["resolvedAt"] is not None) for r in shown["rejections"]]


def test_requeue_dry_run_and_unknown_event_id_change_nothing(ns: Namespace) -> None:
    """--dry-run reports what would be requeued and leaves both queues and the
    rejections alone; an eventId that is not in the dead queue is reported, exit 1."""
    event_ids = make_dead_letters(ns, 2)
    topo = ns.topology("catalog")
    dry = requeue(ns, "--all", "--dry-run")
    assert 0 == dry.returncode, dry.stderr
    assert 2 == dry.stdout.count("would-requeue")
    assert event_ids == ids(ns.peek(topo.dead_queue))
    assert 0 == ns.count(topo.queue)
    missing = requeue(ns, "--event-id", "00000000-0000-4000-8000-000000000000", "--event-id", event_ids[1])
    assert 1 == missing.returncode
    assert "not-found" in missing.stdout
    assert [event_ids[0]] == ids(ns.peek(topo.dead_queue))
    assert [(1,)] == read_rows(ns.db("catalog"), "rejected", "count(*)", where="resolved_at IS NULL")
    usage = requeue(ns, "--all", "--code", "x")
    assert 2 == usage.returncode
    assert "exactly one of" in usage.stderr


def test_requeue_killed_after_confirm_then_applied_copy_is_left_until_drop_applied(ns: Namespace) -> None:
    """SIGKILL between the confirm and the ack leaves the message in both queues; once the
    consumer applied it, requeue reports it already applied and leaves it (exit 1),
    --drop-applied removes it, and every event is applied exactly once."""
    event_ids = make_dead_letters(ns, 3)
    topo = ns.topology("catalog")
    db = ns.db("catalog")
    crashed = requeue(ns, "--all", env=ns.env(DELIVERY_CRASH_AT="requeue-after-confirm:2"))
    assert -signal.SIGKILL == crashed.returncode, crashed.stderr
    assert event_ids[1:] == ids(ns.peek(topo.dead_queue))
    assert event_ids[:2] == ids(ns.peek(topo.queue))
    ran = ns.run_until_idle("catalog", idle=1)
    assert 0 == ran.returncode, ran.stderr
    age_rejections(db)
    again = requeue(ns, "--all")
    assert 1 == again.returncode, again.stderr
    assert f"left           {event_ids[1]}" in again.stdout
    assert "receipt exists: updated" in again.stdout
    assert [event_ids[1]] == ids(ns.peek(topo.dead_queue))
    dropped = requeue(ns, "--all", "--drop-applied")
    assert 0 == dropped.returncode, dropped.stderr
    assert f"dropped        {event_ids[1]}" in dropped.stdout
    assert 0 == ns.count(topo.dead_queue)
    ran = ns.run_until_idle("catalog", idle=1)
    assert 0 == ran.returncode, ran.stderr
    assert sorted((e, "updated") for e in event_ids) == read_rows(db, "inbox", "event_id, result")
    # The first rejection was never resolved by the killed requeue (killed before that
    # step); a later requeue saw its copy gone from the dead queue and resolved it.
    assert [(0,)] == read_rows(db, "rejected", "count(*)", where="resolved_at IS NULL")


def reached(ns: Namespace, queue: str, target: int, proc: subprocess.Popen[str]) -> bool:
    """*queue* holds *target* messages, or *proc* has exited."""
    return proc.poll() is not None or ns.count(queue) >= target


def test_requeue_killed_at_random_moments_loses_nothing(ns: Namespace) -> None:
    """requeue --all killed at random moments, then run to completion: at every point
    each event is in the dead queue or the consumer's queue, and in the end every
    event is applied exactly once and the dead queue is empty."""
    seed = int(os.environ.get("DEAD_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    event_ids = make_dead_letters(ns, 100)
    topo = ns.topology("catalog")
    cmd = [sys.executable, "-m", "delivery_consumer", "dead", "requeue", "--consumer", "catalog",
           "--db", str(ns.db("catalog")), "--all"]
    for _ in range(3):
        # Killed at a random point of its progress: once it has sent a random number of
        # events home (or finished), wherever that finds it.
        target = ns.count(topo.queue) + rng.randint(1, 30)
        proc = subprocess.Popen(cmd, cwd=ns.workdir, env=ns.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        wait_until(f"{target} events requeued", functools.partial(reached, ns, topo.queue, target, proc))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        present = set(ids(ns.peek(topo.dead_queue))) | set(ids(ns.peek(topo.queue)))
        assert set(event_ids) <= present, f"seed {seed}: lost {set(event_ids) - present}"
    final = requeue(ns, "--all", "--drop-applied")
    assert 0 == final.returncode, f"seed {seed}: {final.stderr}"
    assert 0 == ns.count(topo.dead_queue)
    ran = ns.run_until_idle("catalog", idle=1)
    assert 0 == ran.returncode, ran.stderr
    applied = read_rows(ns.db("catalog"), "inbox", "event_id, result")
    assert sorted((e, "updated") for e in event_ids) == sorted(applied), f"seed {seed}"
    assert [(100,)] == read_rows(ns.db("catalog"), "catalog", "count(*)")


def test_requeue_leaves_a_conflict_and_sends_broker_dead_letters_home(ns: Namespace) -> None:
    """A dead letter whose eventId has a receipt with another body is left as a conflict;
    a broker (delivery-limit) dead letter is requeued with its routing key kept and
    without x-death."""
    topo = ns.topology("catalog", delivery_limit=1)
    declare(ns.url, [topo])
    applied = new_event()
    consumers.open_db(ns.db("catalog"), "catalog", create=True).close()
    reused = {**applied, "data": {**applied["data"], "title": "another title"}}
    poison = new_event(article_id="p")
    with Publisher(ns.url) as pub:
        pub.publish([OutMessage(topo.dead_queue, orjson.dumps(reused), message_id=applied["eventId"],
                                headers={"x-error-code": "event-id-reused"})])
    ns.publish([orjson.dumps(applied), orjson.dumps(poison)])
    conn, ch = ns.channel()
    try:
        method, _props, _body = ch.basic_get(topo.queue, auto_ack=False)  # `applied` stays for run
        for _ in range(2):
            method2, _p, _b = ch.basic_get(topo.queue, auto_ack=False)
            ch.basic_reject(method2.delivery_tag, requeue=True)
        ch.basic_reject(method.delivery_tag, requeue=True)
    finally:
        conn.close()
    ran = ns.run_until_idle("catalog", "--delivery-limit", "1", idle=1)
    assert 0 == ran.returncode, ran.stderr
    assert 2 == ns.count(topo.dead_queue)
    done = requeue(ns, "--all")
    assert 1 == done.returncode, done.stderr
    assert f"left           {applied['eventId']}  event-id-reused  eventId already applied with another body" in (
        done.stdout)
    (props, body), = ns.peek(topo.queue)
    assert orjson.loads(body) == poison
    assert "x-death" not in props.headers
    assert "material.published" == props.headers["x-original-routing-key"]


# -- purge -------------------------------------------------------------------------


def test_purge_asks_first_then_removes_and_resolves(ns: Namespace) -> None:
    """purge without --yes asks; 'n' removes nothing (exit 1). --yes removes the
    selected dead letters only and marks their rejections resolved."""
    event_ids = make_dead_letters(ns, 3)
    topo = ns.topology("catalog")
    args = ("dead", "purge", "--consumer", "catalog", "--db", str(ns.db("catalog")))
    declined = ns.cli(*args, "--event-id", event_ids[0], input=b"n\n")
    assert 1 == declined.returncode
    assert "Remove them for good?" in declined.stderr
    assert event_ids == ids(ns.peek(topo.dead_queue))
    done = ns.cli(*args, "--event-id", event_ids[0], "--event-id", event_ids[2], "--yes")
    assert 0 == done.returncode, done.stderr
    assert 2 == done.stdout.count("purged ")
    assert [event_ids[1]] == ids(ns.peek(topo.dead_queue))
    assert [(2,)] == read_rows(ns.db("catalog"), "rejected", "count(*)", where="resolved_at IS NOT NULL")
