"""Latency with the real broker: a producer's commit reaches the consumer's
database without waiting for the dispatcher's poll or run's batch wait, and
run exports each event's age since the producer stamped it."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from pathlib import Path

import orjson
from brokerkit import Namespace
from support import count_rows, new_event, wait_until
from test_broker_metrics import free_port, scrape
from test_outbox_broker import start_dispatch

from delivery_consumer.amqp.publisher import StreamPublisher
from delivery_consumer.model.deliveries import OutMessage
from delivery_consumer.outbox import demo_producer as producer


def arrived(inbox: Path, n: int) -> Callable[[], bool]:
    return lambda: count_rows(inbox, "inbox") == n


def test_lone_events_arrive_without_waiting_for_a_poll_or_a_batch(ns: Namespace, tmp_path: Path) -> None:
    """With dispatch --poll 1h and run --batch-wait 60s, events written one at a time, each after the one
    before has arrived, all reach the catalog: the commit woke the dispatcher, run applied each alone; each
    one's age since the producer's stamp is on /metrics."""
    db = tmp_path / "producer.db"
    conn = producer.open_db(db)
    port = free_port()
    run = ns.start_run("catalog", "--batch-wait", "60s", "--metrics-port", str(port))
    dispatch = None
    try:
        producer.produce(conn, "article-0", title="first", url="https://example.org/0")
        dispatch = start_dispatch(ns, db, "--poll", "1h")
        inbox = ns.db("catalog")
        wait_until("the first event in the catalog", lambda: inbox.exists() and count_rows(inbox, "inbox") == 1,
                   procs=[run], timeout=120)
        for i in range(1, 6):
            producer.produce(conn, f"article-{i}", title=f"event {i}", url=f"https://example.org/{i}")
            wait_until(f"event {i} in the catalog", arrived(inbox, i + 1), procs=[run], timeout=120)
        wait_until("every row marked", lambda: count_rows(db, "outbox", "published_at IS NOT NULL") == 6)

        def aged() -> dict[str, float] | None:
            m = scrape(port)
            return m if m.get('delivery_event_age_seconds_count{consumer="catalog",stamp="produced"}') == 6 else None

        m = wait_until("six ages on /metrics", aged, procs=[run], ignoring=(OSError,))
        assert 'delivery_event_age_seconds_count{consumer="catalog",stamp="occurred"}' not in m
        assert m['delivery_event_age_seconds_sum{consumer="catalog",stamp="produced"}'] < 6 * 3600
    finally:
        conn.close()
        if dispatch is not None:
            dispatch.send_signal(signal.SIGTERM)
            _, err = dispatch.communicate(timeout=60)
            assert 0 == dispatch.returncode, err
        run.terminate()
        run.communicate(timeout=60)
    assert 0 == run.returncode


def test_the_publisher_returns_from_a_wait_when_woken(ns: Namespace) -> None:
    """idle(1 hour, fd) returns once fd is readable, with the connection still usable; wait(ticket, fd)
    returns when woken or settled, and collect then gives every confirm (nothing is lost by waking)."""
    topo = ns.topology("catalog")
    reader, writer = socket.socketpair()
    with StreamPublisher(ns.url, topologies=[topo]) as pub:
        pub.connect()
        writer.send(b"!")
        pub.idle(3600, reader.fileno())  # returns at once: the fd is readable
        ticket = pub.send([OutMessage(routing_key="material.published", body=orjson.dumps(new_event()),
                                      exchange=topo.exchange, message_id=f"m{i}") for i in range(50)])
        pub.wait(ticket, reader.fileno())  # woken (or settled first)
        assert ["confirmed"] * 50 == [r.status for r in pub.collect(ticket)]
        reader.recv(8)
        later = pub.send([OutMessage(routing_key="material.published", body=orjson.dumps(new_event()),
                                     exchange=topo.exchange, message_id="last")])
        assert pub.wait(later, reader.fileno()), "nothing woke it: it returns when the batch is settled"
        assert ["confirmed"] == [r.status for r in pub.collect(later)]
    reader.close()
    writer.close()
