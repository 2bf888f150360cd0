"""The producer side under faults, with the real broker and real processes:
bad rows among good ones, requeue after the fix, order per article seen from
the consumer's receipts while a row is retried, and a dispatcher SIGKILLed
mid-batch whose leases another dispatcher takes back at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, freeze_session, kill
from outboxkit import envelope
from support import count_rows, read_rows, wait_until
from test_outbox_broker import PUBLISHED, make_events, queued_ids, start_dispatch

from delivery_consumer import outbox
from delivery_consumer.store.sqlite import now_iso

pytestmark = pytest.mark.broker


@contextlib.contextmanager
def extra_queue(ns: Namespace, name: str, key: str, **arguments: Any) -> Iterator[str]:
    """A queue of this test's own, bound to the namespace's exchange; deleted afterwards."""
    queue = f"{ns.prefix}.{name}"
    conn, ch = ns.channel()
    ch.exchange_declare(ns.exchange, exchange_type="topic", durable=True)
    ch.queue_declare(queue, durable=True, arguments=arguments or None)
    ch.queue_bind(queue, ns.exchange, routing_key=key)
    conn.close()
    try:
        yield queue
    finally:
        conn, ch = ns.channel()
        ch.queue_delete(queue)
        conn.close()


def rows(db: Path, state: str = "all") -> dict[str, dict[str, Any]]:
    with contextlib.closing(outbox.connect(db, readonly=True)) as conn:
        return {r["eventId"]: r for r in outbox.list_rows(conn, state=state, limit=0)}


def test_bad_rows_among_good_ones_are_quarantined_and_a_requeue_after_the_fix_publishes_once(ns: Namespace) -> None:
    """An unroutable row and a row with a 300-byte key among 100 good rows: every good row is published once, both
    bad ones are quarantined with their reason, dispatch exits 1 on its own saying so; after binding the key,
    requeue publishes that row exactly once, and after dropping the other, dispatch exits 0."""
    db = ns.workdir / "producer.db"
    good = make_events(db, 50, articles=20)
    conn = outbox.connect(db)
    with outbox.transaction(conn):
        unroutable = envelope("article-1", 99)
        outbox.enqueue(conn, unroutable, routing_key="nowhere.x")
        too_long = envelope("article-2", 99)  # written as older code did, without the key check
        conn.execute("INSERT INTO outbox (event_id, routing_key, ordering_key, body, fingerprint, created_at)"
                     " VALUES (?, ?, 'article-2', ?, 'f', ?)",
                     (too_long["eventId"], "x" * 300, orjson.dumps(too_long), now_iso()))
    conn.close()
    good += make_events(db, 50, articles=20, seed=2)
    first = ns.cli("dispatch", "--db", str(db), "--consumer", "catalog", "--batch", "20", "--exit-when-idle", "1s",
                   "--poll", "50ms")
    assert 1 == first.returncode, first.stderr[-2000:]
    assert "2 rows left: 2 quarantined" in first.stderr
    assert "Traceback" not in first.stderr
    assert Counter(dict.fromkeys(good, 1)) == queued_ids(ns)
    quarantined = rows(db, "quarantined")
    assert {unroutable["eventId"], too_long["eventId"]} == set(quarantined)
    assert "returned: unroutable: 312 NO_ROUTE" == quarantined[unroutable["eventId"]]["quarantineReason"]
    assert quarantined[too_long["eventId"]]["quarantineReason"].startswith("invalid: routing key is 300 bytes")
    listed = ns.cli("outbox", "list", "--db", str(db), "--state", "quarantined")
    assert "quarantined at " in listed.stdout and "returned: unroutable: 312 NO_ROUTE" in listed.stdout

    with extra_queue(ns, "nowhere", "nowhere.x") as fixed:
        requeued = ns.cli("outbox", "requeue", "--db", str(db), unroutable["eventId"])
        assert 0 == requeued.returncode, requeued.stderr
        dropped = ns.cli("outbox", "drop", "--db", str(db), too_long["eventId"], "--reason", "key too long")
        assert 0 == dropped.returncode, dropped.stderr
        second = ns.cli("dispatch", "--db", str(db), "--consumer", "catalog", "--exit-when-idle", "1s",
                        "--poll", "50ms")
        assert 0 == second.returncode, second.stderr[-2000:]
        assert [unroutable["eventId"]] == [props.message_id for props, _ in ns.drain(fixed)]
    assert Counter(dict.fromkeys(good, 1)) == queued_ids(ns)
    final = rows(db)
    assert "published" == final[unroutable["eventId"]]["state"]
    assert ("dropped", "key too long") == (final[too_long["eventId"]]["state"],
                                           final[too_long["eventId"]]["dropReason"])


def test_later_rows_of_an_article_reach_the_consumer_only_after_the_row_in_retry(ns: Namespace) -> None:
    """a1 is nacked (its queue refuses everything) and retried; rows the producer writes meanwhile: the catalog
    receives the other article's but nothing later of article a, which outbox list shows held behind a1; once the
    queue accepts a1, a2 and a3 follow, received after a1 was published."""
    db = ns.workdir / "producer.db"
    conn = outbox.connect(db)
    a1, a2, b1, a3, b2 = (envelope("a", 1), envelope("a", 2), envelope("b", 1), envelope("a", 3), envelope("b", 2))
    with outbox.transaction(conn):
        outbox.enqueue(conn, a1, routing_key="slow.a")
        outbox.enqueue(conn, b1)
    inbox = ns.db("catalog")

    def receipts() -> dict[str, str]:
        try:  # the consumer creates its database when it starts: until then, no receipt
            return dict(read_rows(inbox, "inbox", "event_id, received_at"))
        except sqlite3.OperationalError:
            return {}

    def attempts(env: dict[str, Any]) -> int:
        return int(read_rows(db, "outbox", "attempts", where="event_id = ?", params=(env["eventId"],))[0][0])

    with extra_queue(ns, "slow", "slow.a", **{"x-max-length": 0, "x-overflow": "reject-publish"}):
        consumer = ns.start_run("catalog")
        dispatcher = start_dispatch(ns, db, "--retry-base", "100ms", "--retry-cap", "300ms", "--max-attempts",
                                    "1000", "--poll", "50ms")
        try:
            wait_until("a1 nacked once", lambda: attempts(a1) >= 1)
            with outbox.transaction(conn):  # the producer goes on writing while a1 is in retry
                for env in (a2, a3, b2):
                    outbox.enqueue(conn, env)
            conn.close()
            wait_until("b1 and b2 received, a1 tried 3 times",
                     lambda: {b1["eventId"], b2["eventId"]} <= set(receipts()) and attempts(a1) >= 3)
            assert not {a2["eventId"], a3["eventId"]} & set(receipts())
            waiting = rows(db, "pending")
            assert f"held behind {a1['eventId']}" == waiting[a2["eventId"]]["detail"]
            assert "nacked" in waiting[a1["eventId"]]["lastError"]
            amqp, ch = ns.channel()
            ch.queue_delete(f"{ns.prefix}.slow")  # the fix: a queue that accepts it
            ch.queue_declare(f"{ns.prefix}.slow", durable=True)
            ch.queue_bind(f"{ns.prefix}.slow", ns.exchange, routing_key="slow.a")
            amqp.close()
            wait_until("a3 received", lambda: a3["eventId"] in receipts())
        finally:
            kill(dispatcher)  # type: ignore[arg-type]
            kill(consumer)
            conn.close()
        a1_published = str(read_rows(db, "outbox", "published_at", where="event_id = ?", params=(a1["eventId"],))[0][0])
        got = receipts()
        assert a1_published <= got[a2["eventId"]] and a1_published <= got[a3["eventId"]]


def test_a_dispatcher_killed_mid_batch_has_its_leases_taken_back_at_once(ns: Namespace) -> None:
    """SIGKILL of the dispatcher's main PID while it holds leases of 10 minutes: a second dispatcher on this host
    takes them back at once (the pid is gone) and publishes everything, far within the lease."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 3000, articles=1000, seed=5)

    def leased() -> int:
        return count_rows(db, "outbox", "status = 'pending' AND lease_owner IS NOT NULL")

    first = start_dispatch(ns, db, "--batch", "100", "--lease", "10m", "--poll", "50ms")
    try:
        wait_until("the first dispatcher publishing", lambda: (count_rows(db, "outbox", PUBLISHED) > 0 and leased() > 0)
                 or first.poll() is not None)
        os.kill(first.pid, signal.SIGKILL)  # the main PID alone, as an operator's kill -9
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            kill(first)  # type: ignore[arg-type]
        first.communicate()
    held = leased()
    assert held > 0 and count_rows(db, "outbox", PUBLISHED) < len(ids), "the kill did not land mid-batch"
    # Far within the lease: the command's own timeout (2 minutes) is a fifth of it. What says the
    # leases were taken back because the pid is gone, not because they expired, is each row's error.
    second = ns.cli("dispatch", "--db", str(db), "--consumer", "catalog", "--lease", "10m", "--exit-when-idle", "1s",
                    "--poll", "50ms", timeout=120)
    assert 0 == second.returncode, second.stderr[-2000:]
    assert len(ids) == count_rows(db, "outbox", PUBLISHED)
    taken = read_rows(db, "outbox", "count(*)", where="last_error LIKE 'lease of % taken back: its process %'")
    assert [(held,)] == taken
    copies = queued_ids(ns)
    assert set(ids) == set(copies)
    assert sum(copies.values()) - len(ids) <= 2 * 100  # at most the batches in flight went twice
    assert [] == read_rows(db, "outbox_owners")



def test_stream_publisher_fails_an_unencodable_message_alone(ns: Namespace) -> None:
    """Messages pika cannot encode (a 300-byte routing key, a 300-byte message_id, a lone surrogate) come back
    'unencodable' alone; the messages around them are confirmed, in order, on the same channel, exactly once."""
    from delivery_consumer.amqp.publisher import StreamPublisher
    from delivery_consumer.model.deliveries import OutMessage

    def message(tag: str, key: str = "material.published", mid: str | None = None) -> OutMessage:
        return OutMessage(routing_key=key, body=b"{}", exchange=ns.exchange, message_id=mid or tag)

    batch = [message("a0"), message("bad-key", key="k" * 300), message("a1"), message("bad-id", mid="m" * 300),
             message("bad-utf8", key="material.\ud800"), message("a2")]
    with StreamPublisher(ns.url, topologies=[ns.topology("catalog")], window=2) as pub:
        pub.connect()
        first = pub.collect(pub.send(batch))
        second = pub.collect(pub.send([message("a3")]))
    assert ["confirmed", "unencodable", "confirmed", "unencodable", "unencodable", "confirmed"] == [
        r.status for r in first]
    assert "ShortStringTooLong" in first[1].reason
    assert ["confirmed"] == [r.status for r in second]
    assert ["a0", "a1", "a2", "a3"] == [props.message_id for props, _ in ns.drain(ns.topology("catalog").queue)]


def test_stream_publisher_renews_its_channel_on_the_same_connection(ns: Namespace) -> None:
    """renew_channel() closes the channel and publishes on a new one of the same connection: the messages after
    it are confirmed (delivery tags counted afresh), in order, exactly once, with no reconnect."""
    from delivery_consumer.amqp.publisher import StreamPublisher
    from delivery_consumer.model.deliveries import OutMessage

    def message(tag: str) -> OutMessage:
        return OutMessage(routing_key="material.published", body=b"{}", exchange=ns.exchange, message_id=tag)

    with StreamPublisher(ns.url, topologies=[ns.topology("catalog")], window=2) as pub:
        pub.connect()
        first = pub.collect(pub.send([message("a0"), message("a1"), message("a2")]))
        conn, channel = pub._conn, pub._channel
        pub.renew_channel()
        assert pub._conn is conn and pub._channel is not channel and not channel.is_open
        second = pub.collect(pub.send([message("a3"), message("a4"), message("a5")]))
        pub.renew_channel()
        third = pub.publish([message("a6")])
    assert ["confirmed"] * 7 == [r.status for r in first + second + third]
    assert [f"a{i}" for i in range(7)] == [props.message_id for props, _ in ns.drain(ns.topology("catalog").queue)]


def test_two_dispatchers_one_killed_the_other_takes_its_leases_and_finishes(ns: Namespace) -> None:
    """Two dispatchers share the outbox with 10-minute leases; one is SIGKILLed (main PID) while it holds rows: the
    survivor takes exactly those leases back and publishes every row, with no copy lost."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 1500, articles=500, seed=9)
    victim = start_dispatch(ns, db, "--batch", "50", "--lease", "10m", "--poll", "50ms")
    survivor = start_dispatch(ns, db, "--batch", "50", "--lease", "10m", "--poll", "50ms", "--exit-when-idle", "3s")

    def held_by_victim() -> list[tuple[object, ...]]:
        return read_rows(db, "outbox o JOIN outbox_owners w ON w.owner = o.lease_owner", "o.seq",
                         where="w.pid = ? AND o.status = 'pending'", params=(victim.pid,))

    try:
        wait_until("the victim registered",
                 lambda: bool(read_rows(db, "outbox_owners", "1", where="pid = ?", params=(victim.pid,))))
        def frozen_holding_rows() -> list[tuple[object, ...]]:
            """Freeze the victim (SIGSTOP); the rows it holds, or thaw it and try again."""
            assert count_rows(db, "outbox", PUBLISHED) < len(ids), \
                "everything was published before the victim held a row"
            freeze_session(victim.pid)  # stopped for sure: a mark cannot land after the read below
            held = held_by_victim()
            if not held:
                os.kill(victim.pid, signal.SIGCONT)
            return held

        held = wait_until("the victim frozen while it holds rows", frozen_holding_rows, interval=0.01)
        os.kill(victim.pid, signal.SIGKILL)  # killed there
        victim.wait(timeout=30)
        _, err = survivor.communicate(timeout=240)
    finally:
        for proc in (victim, survivor):
            if proc.poll() is None:
                kill(proc)  # type: ignore[arg-type]
    assert 0 == survivor.returncode, err[-2000:]
    assert len(ids) == count_rows(db, "outbox", PUBLISHED), "the survivor left rows behind"
    assert set(ids) == set(queued_ids(ns))
    taken = read_rows(db, "outbox", "seq", where="last_error LIKE 'lease of % taken back: its process %'")
    assert sorted(held) == sorted(taken)
