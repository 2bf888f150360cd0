"""The dispatcher against the real broker: real processes, SIGKILL, a broker restart.

Each test writes a producer database in-process (``producer.produce``: the
material row and its event in one transaction), runs ``delivery-consumer
dispatch`` as a subprocess in its own broker namespace, and checks the queue,
the outbox and, where it matters, what ``run --consumer catalog`` makes of it.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from brokerkit import Namespace, RabbitNode, kill
from support import count_rows, read_rows, wait_until

from delivery_consumer import outbox
from delivery_consumer.outbox import demo_producer as producer
from delivery_consumer.outbox.dispatcher import LINK_PROBE_ROWS

CRASHED = -signal.SIGKILL


def make_events(db: Path, count: int, *, articles: int = 40, seed: int = 1) -> list[str]:
    """*count* events over *articles* materials (revisions, some withdrawals); their eventIds in order."""
    rng = random.Random(seed)
    conn = producer.open_db(db)
    ids = []
    try:
        for i in range(count):
            article = f"article-{rng.randrange(articles)}"
            known = conn.execute("SELECT 1 FROM material WHERE article_id = ?", (article,)).fetchone()
            withdraw = known is not None and rng.random() < 0.15
            done = producer.produce(conn, article, title=f"{article} #{i}", url=f"https://example.org/{article}/{i}",
                                    withdraw=withdraw)
            ids.append(done.envelope.event_id)
    finally:
        conn.close()
    return ids


#: The outbox rows the dispatcher has published (``count_rows(db, "outbox", PUBLISHED)``).
PUBLISHED = "published_at IS NOT NULL"


def dispatch(ns: Namespace, db: Path, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = ns.env(**({"DELIVERY_CRASH_AT": crash_at} if crash_at else {}))
    return ns.cli("dispatch", "--db", str(db), "--consumer", "catalog", *args, env=env, timeout=120)


def start_dispatch(ns: Namespace, db: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(db), "--consumer", "catalog", *args]
    return subprocess.Popen(cmd, cwd=ns.workdir, env=ns.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def queued_ids(ns: Namespace) -> Counter[str]:
    """message_id -> copies waiting in the catalog queue (left in place, but a peek is a
    delivery for a quorum queue: do not run the consumer afterwards)."""
    return Counter(props.message_id for props, _ in ns.peek(ns.topology("catalog").queue))


def consume(ns: Namespace, db: Path, ids: list[str]) -> Counter[str]:
    """run catalog until idle; check the catalog equals the producer's material table and every
    event has exactly one receipt; return the deliveries the consumer counted per eventId."""
    queued = ns.count(ns.topology("catalog").queue)
    done = ns.run_until_idle("catalog", idle=1.0)
    assert 0 == done.returncode, done.stderr[-2000:]
    inbox = ns.db("catalog")
    columns = "article_id, revision, title, url, published"
    ours, theirs = (read_rows(path, table, columns) for path, table in ((db, "material"), (inbox, "catalog")))
    assert ours == theirs
    assert sorted(ids) == [r[0] for r in read_rows(inbox, "inbox", "event_id")]
    # A receipt is one delivery; ``deliveries`` counts the keys delivered more
    # often (the runner may skip the row of a first delivery applied fresh).
    counted = dict(read_rows(inbox, "deliveries", "key, deliveries"))
    assert set(counted) <= set(ids)
    deliveries = Counter({i: int(counted.get(i, 1)) for i in ids})  # type: ignore[call-overload]
    assert queued == sum(deliveries.values())  # every copy was delivered; the extra ones were absorbed
    return deliveries


def test_crash_before_publishing_sends_nothing_and_loses_nothing(ns: Namespace) -> None:
    """SIGKILL after the claim, before publishing: nothing reaches the broker; after the lease every row goes once."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 300)
    crashed = dispatch(ns, db, "--batch", "100", "--lease", "1s", crash_at="dispatch-before-publish")
    assert CRASHED == crashed.returncode, crashed.stderr[-2000:]
    assert 0 == count_rows(db, "outbox", PUBLISHED)
    # A full batch, or the few rows of a probe when its first connect met a busy broker (an outage
    # proves the connection with a small batch first).
    [(leased,)] = read_rows(db, "outbox", "count(*)", where="lease_owner IS NOT NULL")
    assert leased == 100 or (leased <= 10 and "retrying in" in crashed.stderr), crashed.stderr[-2000:]
    assert 0 == ns.count(ns.topology("catalog").queue)
    done = dispatch(ns, db, "--batch", "100", "--lease", "1s", "--exit-when-idle", "1500ms", "--poll", "100ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    assert 300 == count_rows(db, "outbox", PUBLISHED)
    assert Counter(dict.fromkeys(ids, 1)) == queued_ids(ns)
    assert [(1,)] == read_rows(db, "outbox", "DISTINCT attempts")
    # the dead dispatcher's leases were taken back at once (its pid is gone), not after the lease
    assert [(leased,)] == read_rows(db, "outbox", "count(*)", where="last_error LIKE 'lease of % taken back: %'")


def test_crash_after_confirm_before_marking_gives_one_duplicate_absorbed_by_the_inbox(ns: Namespace) -> None:
    """SIGKILL between the confirms and the mark: what was sent goes twice and is applied once."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 300, articles=1000)
    crashed = dispatch(ns, db, "--batch", "100", "--lease", "1s", crash_at="dispatch-after-confirm")
    assert CRASHED == crashed.returncode, crashed.stderr[-2000:]
    assert 0 == count_rows(db, "outbox", PUBLISHED)
    at_crash = ns.count(ns.topology("catalog").queue)
    # The first confirmed batch is a full one, or, when the dispatcher's first connection met an
    # outage (a loaded machine), the probe of LINK_PROBE_ROWS it proves the new connection with.
    first = 100 if at_crash >= 100 else LINK_PROBE_ROWS
    assert first <= at_crash <= 200  # the first batch, and whatever of the second (in flight) got there
    done = dispatch(ns, db, "--batch", "100", "--lease", "1s", "--exit-when-idle", "1500ms", "--poll", "100ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    assert 300 == count_rows(db, "outbox", PUBLISHED)
    deliveries = consume(ns, db, ids)
    twice = {i for i, n in deliveries.items() if n == 2}
    assert {1, 2} >= set(deliveries.values())
    assert set(ids[:first]) <= twice  # the first batch, in creation order
    assert len(twice) >= at_crash


def test_crash_in_the_middle_of_marking_a_batch_leaves_none_of_it_marked(ns: Namespace) -> None:
    """SIGKILL halfway through marking the second batch: the first stays marked, the second is not half-marked."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 300, articles=1000)
    crashed = dispatch(ns, db, "--batch", "100", "--lease", "1s", crash_at="dispatch-mid-batch:2")
    assert CRASHED == crashed.returncode, crashed.stderr[-2000:]
    marked = {r[0] for r in read_rows(db, "outbox", "event_id", where="published_at IS NOT NULL")}
    assert set(ids[:100]) == marked
    at_crash = ns.count(ns.topology("catalog").queue)
    assert 200 <= at_crash <= 300
    done = dispatch(ns, db, "--batch", "100", "--lease", "1s", "--exit-when-idle", "1500ms", "--poll", "100ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    copies = queued_ids(ns)
    twice = {i for i, n in copies.items() if n == 2}
    assert {1, 2} >= set(copies.values())
    assert not twice & marked  # the marked batch is never sent again
    assert len(twice) >= at_crash - 100  # every copy of the unmarked batches goes again


def reached(db: Path, target: int, proc: subprocess.Popen[str]) -> bool:
    """*target* rows of *db* are published, or *proc* has exited."""
    return proc.poll() is not None or count_rows(db, "outbox", PUBLISHED) >= target


def test_sigkill_at_random_moments_loses_nothing(ns: Namespace) -> None:
    """Dispatchers SIGKILLed at random while publishing: every event reaches the catalog, applied once."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 2000, articles=500, seed=7)
    rng = random.Random(7)
    kills = 0
    for _ in range(3):
        before = count_rows(db, "outbox", PUBLISHED)
        proc = start_dispatch(ns, db, "--batch", "25", "--lease", "1s", "--poll", "100ms")
        # Killed at a random point of its progress: once it has published a random number of
        # rows more (or exited), wherever that finds it.
        target = before + rng.randint(1, 150)
        wait_until(f"{target} rows published", functools.partial(reached, db, target, proc))
        if proc.poll() is None:
            kills += 1
        kill(proc)
    assert kills >= 2, "the dispatcher finished before it could be killed"
    assert count_rows(db, "outbox", PUBLISHED) < len(ids)
    done = dispatch(ns, db, "--lease", "1s", "--exit-when-idle", "1500ms", "--poll", "100ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    assert len(ids) == count_rows(db, "outbox", PUBLISHED)
    deliveries = consume(ns, db, ids)
    assert sum(deliveries.values()) - len(ids) <= 3 * 2 * 25  # at most the batches each killed one had in flight


def test_two_dispatchers_on_one_database_publish_each_row_once(ns: Namespace) -> None:
    """Two dispatchers sharing the outbox split the rows by lease: every event is in the queue exactly once."""
    db = ns.workdir / "producer.db"
    ids = make_events(db, 2000, seed=3)
    procs = [start_dispatch(ns, db, "--batch", "10", "--exit-when-idle", "700ms", "--poll", "50ms") for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [0, 0] == [p.returncode for p in procs], [err[-1000:] for _, err in outputs]
    confirmed = [int(re.search(r"exiting: (\d+) published", err).group(1)) for _, err in outputs]  # type: ignore[union-attr]
    assert 2000 == sum(confirmed)
    assert Counter(dict.fromkeys(ids, 1)) == queued_ids(ns)
    assert [(1,)] == read_rows(db, "outbox", "DISTINCT attempts")


def test_an_unroutable_row_is_quarantined_and_its_article_goes_on(ns: Namespace) -> None:
    """A returned row is quarantined at once with its reason; its article's later rows follow it (and show says they
    went past it), others are published."""
    queue = f"{ns.prefix}.published-only"
    conn, ch = ns.channel()
    ch.exchange_declare(ns.exchange, exchange_type="topic", durable=True)
    ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
    ch.queue_bind(queue, ns.exchange, routing_key="material.published")  # withdrawals are unroutable
    conn.close()
    try:
        db = ns.workdir / "producer.db"
        pconn = producer.open_db(db)
        a1 = producer.produce(pconn, "a", title="A", url="u").envelope.event_id
        a2 = producer.produce(pconn, "a", withdraw=True).envelope.event_id
        a3 = producer.produce(pconn, "a", title="A again", url="u").envelope.event_id
        b1 = producer.produce(pconn, "b", title="B", url="u").envelope.event_id
        pconn.close()
        done = ns.cli("dispatch", "--db", str(db), "--batch", "1", "--retry-base", "30s", "--exit-when-idle", "500ms",
                      "--poll", "50ms")
        assert 1 == done.returncode, done.stderr[-2000:]  # rows left unpublished
        with contextlib.closing(outbox.connect(db, readonly=True)) as oconn:
            state = {r["eventId"]: r for r in outbox.list_rows(oconn)}
        assert (state[a1]["state"], state[b1]["state"]) == ("published", "published")
        assert ("quarantined", 1, "returned: unroutable: 312 NO_ROUTE") == (
            state[a2]["state"], state[a2]["attempts"], state[a2]["quarantineReason"])
        assert state[a2]["publishedAt"] is None
        assert "published" == state[a3]["state"]
        with contextlib.closing(outbox.connect(db, readonly=True)) as oconn:
            assert [a3] == outbox.show(oconn, a2)["passedBy"]
        assert [a1, b1, a3] == [props.message_id for props, _ in ns.drain(queue)]
    finally:
        conn, ch = ns.channel()
        ch.queue_delete(queue)
        conn.close()


def test_a_broker_restart_while_dispatching_is_waited_out(private_ns: Namespace, private_broker: RabbitNode) -> None:
    """The broker (a private node) restarts under a running dispatcher: it backs off without spinning, resumes,
    and loses nothing."""
    ns = private_ns
    db = ns.workdir / "producer.db"
    make_events(db, 1)
    proc = start_dispatch(ns, db, "--batch", "20", "--lease", "5s", "--poll", "50ms")
    stop = threading.Event()
    ids: list[str] = []

    def produce_steadily() -> None:
        conn = producer.open_db(db)
        try:
            while not stop.is_set():
                done = producer.produce(conn, f"article-{len(ids) % 30}", title=f"t{len(ids)}", url="u")
                ids.append(done.envelope.event_id)
                time.sleep(0.005)  # a trickle the dispatcher keeps up with: rows are always in flight
        finally:
            conn.close()

    writer = threading.Thread(target=produce_steadily)
    try:
        wait_until("the first row published", lambda: count_rows(db, "outbox", PUBLISHED), procs=[proc])
        writer.start()
        wait_until("rows of the writer published", lambda: count_rows(db, "outbox", PUBLISHED) > 1, procs=[proc])
        private_broker.restart(down_for=1.0)
        written = len(ids)  # the broker answers again: what is written from now on is after the restart
        wait_until("a row written after the restart published",
                   lambda: count_rows(db, "outbox", PUBLISHED) > written + 1, procs=[proc])
        stop.set()
        writer.join()
        wait_until("every row published", lambda: count_rows(db, "outbox", PUBLISHED) >= len(ids) + 1, procs=[proc])
        assert len(ids) + 1 == count_rows(db, "outbox", PUBLISHED)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        if proc.poll() is None:
            kill(proc)
    assert 0 == proc.returncode, err[-2000:]
    waits = [line for line in err.splitlines() if "retrying in" in line]
    assert waits, err[-2000:]
    assert len(waits) <= 3, err[-3000:]  # once per change of state, not per attempt
    assert "broker reachable again" in err, err[-3000:]
    copies = queued_ids(ns)
    assert set(ids) <= set(copies)


def test_end_to_end_catalog_equals_the_producers_table(ns: Namespace) -> None:
    """produce -> dispatch -> broker -> run catalog: the catalog is the material table, each event applied once."""
    db = ns.workdir / "producer.db"
    made = [ns.cli("produce", "--db", str(db), "--article", "cli-1", "--title", "Первый", "--url", "https://e/1"),
            ns.cli("produce", "--db", str(db), "--article", "cli-1", "--withdraw")]
    assert [0, 0] == [m.returncode for m in made], [m.stderr for m in made]
    ids = [m.stdout.split()[0] for m in made]
    ids += make_events(db, 400, articles=60, seed=11)
    done = dispatch(ns, db, "--exit-when-idle", "500ms", "--poll", "50ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    assert "402 published" in done.stderr
    assert Counter(dict.fromkeys(ids, 1)) == consume(ns, db, ids)
    assert [(0, "Первый")] == read_rows(ns.db("catalog"), "catalog", "published, title", where="article_id = 'cli-1'")


def test_stream_publisher_keeps_the_order_of_overlapping_batches(ns: Namespace) -> None:
    """Batches sent before the previous one is collected reach the queue in sending order, each result its own."""
    from delivery_consumer.amqp.publisher import StreamPublisher
    from delivery_consumer.model.deliveries import OutMessage

    def batch(tag: str, n: int, key: str = "material.published") -> list[OutMessage]:
        return [OutMessage(routing_key=key, body=b"{}", exchange=ns.exchange, message_id=f"{tag}{i}")
                for i in range(n)]

    with StreamPublisher(ns.url, topologies=[ns.topology("catalog")], window=50) as pub:
        pub.connect()
        first, second, third = batch("a", 120), batch("b", 3, key="nowhere"), batch("c", 80)
        tickets = [pub.send(first), pub.send(second), pub.send(third)]
        with pytest.raises(ValueError, match="order"):
            pub.collect(tickets[1])
        results = [pub.collect(t) for t in tickets]
    assert [{"confirmed"}, {"returned"}, {"confirmed"}] == [{r.status for r in rs} for rs in results]
    order = [props.message_id for props, _ in ns.drain(ns.topology("catalog").queue)]
    assert [m.message_id for m in first + third] == order


def test_dispatch_with_a_wrong_password_exits_2_with_one_line(ns: Namespace) -> None:
    """Bad credentials are fatal: one line on stderr, exit 2, the rows stay unpublished and unleased."""
    db = ns.workdir / "producer.db"
    make_events(db, 3)
    url = ns.url.replace("guest:guest@", "guest:wrong@")
    env = ns.env(DELIVERY_AMQP_URL=url)
    done = ns.cli("dispatch", "--db", str(db), "--exit-when-idle", "1s", env=env)
    assert 2 == done.returncode, done.stderr
    assert "authentication failed" in done.stderr
    assert "Traceback" not in done.stderr
    assert [(3, 0)] == read_rows(db, "outbox", "count(*), count(lease_owner)", where="published_at IS NULL")

