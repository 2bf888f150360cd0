"""A queue that does not answer holds a delivery, never ends the run, and never passes for an empty
one: on the real broker, with the dead queue deleted under a running ``run`` (its copies come back
312 NO_ROUTE), and a ``--exit-when-idle`` worker whose queue's messages do not reach it."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import orjson
import pika
import pytest
from brokerkit import Namespace
from support import count_rows, new_event, read_rows, wait_until
from tcpproxy import Proxy

from delivery_consumer.service.memory_link import MemoryLink, MemoryQueues
from delivery_consumer.service.settings import RunConfig
from delivery_consumer.service.worker import Worker


def test_a_rejected_delivery_waits_unacked_for_its_dead_queue_while_the_rest_is_applied(ns: Namespace) -> None:
    """The dead queue is gone while a malformed event and 20 healthy ones arrive: the healthy ones
    are applied and acked, the malformed one is held (nothing in rejected, the run goes on, exit
    nowhere); once the dead queue is back it lands there exactly once with its reason, recorded
    in rejected with one attempt, and the main queue is empty."""
    topo = ns.topology("catalog")
    ns.publish([orjson.dumps(new_event(article_id="first"))], declare=["catalog"])
    proc = ns.start_run("catalog", "--batch", "5")
    db = ns.db("catalog")
    wait_until("the first event applied", lambda: count_rows(db, "inbox") == 1, procs=[proc])

    conn, ch = ns.channel()
    ch.queue_delete(topo.dead_queue)
    conn.close()
    healthy = [new_event(article_id=f"a-{i}") for i in range(20)]
    ns.publish([orjson.dumps(healthy[0]), b"{not json", *(orjson.dumps(e) for e in healthy[1:])])
    wait_until("the healthy events applied", lambda: count_rows(db, "inbox") == 21, procs=[proc])
    proc.wait_for_log("held unacked")
    assert "malformed-json" not in {r[0] for r in read_rows(db, "rejected", "code")}
    assert 0 == ns.count(topo.queue)  # nothing ready: the held one is unacked, the rest acked
    assert proc.poll() is None

    conn, ch = ns.channel()
    ch.queue_declare(topo.dead_queue, durable=True, arguments=topo.dead_arguments())
    conn.close()
    proc.wait_for_log("held deliveries released")
    wait_until("the rejection recorded", lambda: count_rows(db, "rejected") == 1, procs=[proc])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert 0 == proc.returncode, err
    assert "channel closed" not in err and "giving up channel" not in err

    letters = ns.drain(topo.dead_queue)
    assert [b"{not json"] == [body for _props, body in letters]
    (props, _body), = letters
    assert props.headers["x-error-code"] == "malformed-json" and props.headers["x-attempts"] == 1
    assert [("malformed-json", 1)] == read_rows(db, "rejected", "code, attempts")
    assert 0 == ns.count(topo.queue)


def test_exit_when_idle_does_not_exit_while_its_queue_holds_messages_it_cannot_get(
        ns: Namespace, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run idle for --exit-when-idle whose queue on the broker still has ready messages that do not
    reach it (here: the worker's deliveries come from memory, the broker's queue is never consumed)
    does not end: it says why and looks again; once the queue is empty it exits."""
    topo = ns.topology("catalog")
    ns.publish([orjson.dumps(new_event(article_id="stuck"))], declare=["catalog"])
    config = RunConfig(consumer="catalog", url=ns.url, db_path=tmp_path / "catalog.db", exchange=ns.exchange,
                       prefix=ns.prefix, exit_when_idle_s=0.3)
    worker = Worker(config)
    assert worker.open(), worker.error
    worker.io = MemoryLink(MemoryQueues(worker.topology), worker)
    worker.io.pump(0)  # the first channel
    with caplog.at_level(logging.WARNING, logger="delivery_consumer"):
        worker.start()
        wait_until("the run to say why it does not exit",
                   lambda: "still holds 1 ready messages that do not reach this run" in caplog.text)
        assert worker.is_alive()
        ns.drain(topo.queue)
        worker.join(30)
    assert not worker.is_alive() and worker.error is None


def test_a_reconnect_declares_only_what_is_missing(ns: Namespace) -> None:
    """After its first start a run's reconnect only looks at its queues: one deleted meanwhile is
    declared again (the dead queue; the exchange, with the queue's bindings), one that exists with
    other arguments (a retry tier replaced by hand) is left alone -- a full declare would have
    failed on it with 406 and ended the run."""
    topo = ns.topology("catalog")
    ns.publish([orjson.dumps(new_event(article_id="first"))], declare=["catalog"])
    proxy = Proxy(ns.url)
    try:
        proc = ns.start_run("catalog", env=ns.env(DELIVERY_AMQP_URL=proxy.url))
        db = ns.db("catalog")
        wait_until("the first event applied", lambda: count_rows(db, "inbox") == 1, procs=[proc])
        conn, ch = ns.channel()
        ch.queue_delete(topo.dead_queue)
        tier = topo.retry_queue(0)
        ch.queue_delete(tier)
        ch.queue_declare(tier, durable=True, arguments={"x-queue-type": "quorum"})  # other arguments
        ch.exchange_delete(ns.exchange)  # and with it the queue's bindings
        conn.close()
        proxy("reset")
        proc.wait_for_log(f"declared again what was missing on the broker: {ns.exchange}, {topo.dead_queue}")
        ns.publish([orjson.dumps(new_event(article_id="second"))])
        wait_until("the second event applied", lambda: count_rows(db, "inbox") == 2, procs=[proc])
        assert is_declared_as(ns, topo.dead_queue, topo.dead_arguments())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert 0 == proc.returncode, err
        assert "precondition" not in err.lower()
    finally:
        proxy.close()


def is_declared_as(ns: Namespace, queue: str, args: dict[str, object]) -> bool:
    conn, ch = ns.channel()
    try:
        ch.queue_declare(queue, durable=True, arguments=args)
        return True
    except pika.exceptions.ChannelClosedByBroker:
        return False
    finally:
        if conn.is_open:
            conn.close()


def test_a_nacked_copy_is_sent_again_on_a_new_channel_and_released(ns: Namespace) -> None:
    """The dead queue refuses every message (full, reject-publish) when a malformed event arrives: its copy is
    nacked, the delivery held, the copy channel replaced by a new one of the same connection (a channel can
    stay refused after a failover); once the dead queue takes messages the held copy lands there once, with no
    reconnect and no channel error."""
    topo = ns.topology("catalog")
    ns.publish([orjson.dumps(new_event(article_id="first"))], declare=["catalog"])
    proc = ns.start_run("catalog", "--batch", "5")
    db = ns.db("catalog")
    wait_until("the first event applied", lambda: count_rows(db, "inbox") == 1, procs=[proc])

    conn, ch = ns.channel()
    ch.queue_delete(topo.dead_queue)
    ch.queue_declare(topo.dead_queue, durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    conn.close()
    ns.publish([b"{not json", orjson.dumps(new_event(article_id="second"))])
    wait_until("the healthy event applied", lambda: count_rows(db, "inbox") == 2, procs=[proc])
    proc.wait_for_log("the copies go on a new channel")
    proc.wait_for_log("held unacked")

    conn, ch = ns.channel()
    ch.queue_delete(topo.dead_queue)
    ch.queue_declare(topo.dead_queue, durable=True, arguments=topo.dead_arguments())
    conn.close()
    proc.wait_for_log("held deliveries released")
    wait_until("the rejection recorded", lambda: count_rows(db, "rejected") == 1, procs=[proc])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert 0 == proc.returncode, err
    assert "channel closed" not in err and "giving up channel" not in err and "reachable again" not in err
    assert [b"{not json"] == [body for _props, body in ns.drain(topo.dead_queue)]
    assert 0 == ns.count(topo.queue)
