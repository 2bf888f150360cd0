"""``publish`` has a confirm deadline: when the broker never confirms (a proxy that drops the confirms, as a
queue without quorum would keep them) it says within ``--confirm-timeout`` how many were confirmed, nacked
and unconfirmed, and exits 1; a full ``reject-publish`` queue's nacks are counted as nacks."""

from __future__ import annotations

import contextlib

import orjson
import pika
import pika.exceptions
import pytest
from brokerkit import Namespace
from support import new_event
from tcpproxy import Proxy

from delivery_consumer.cli.publish import summary_line

pytestmark = pytest.mark.broker


def write_events(ns: Namespace, n: int) -> str:
    src = ns.workdir / "events.ndjson"
    src.write_bytes(b"".join(orjson.dumps(new_event(article_id=f"a-{i % 20}", revision=i // 20 + 1)) + b"\n"
                             for i in range(n)))
    return str(src)


def test_confirms_that_never_come_end_at_the_deadline_with_the_counts(ns: Namespace) -> None:
    """The broker stores the messages but its confirms never reach publish: after --confirm-timeout (not the
    minutes of its timeouts and attempts) one line counts 0 confirmed, 0 nacked, 200 unconfirmed and says
    that publishing them again is safe; every message is named unconfirmed with the deadline as reason; exit 1."""
    src = write_events(ns, 200)
    proxy = Proxy(ns.url)
    try:
        proxy("noconfirm")
        done = ns.cli("publish", "--consumer", "catalog", "--confirm-timeout", "2s", "--json", src,
                      env=ns.env(DELIVERY_AMQP_URL=proxy.url), timeout=60)
    finally:
        proxy.close()
    assert 1 == done.returncode, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"200 published to {ns.exchange}: 0 confirmed, 0 nacked, 200 unconfirmed; no confirm for 200 within" \
           " --confirm-timeout 2s" in last, last
    assert "publishing them again is safe" in last
    lines = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert {"unconfirmed"} == {x["published"] for x in lines} and 200 == len(lines)
    assert "no answer within the deadline" in lines[0]["reason"]
    assert 200 == ns.count(ns.topology("catalog").queue)  # stored all the same: unconfirmed is not lost


def test_a_full_reject_publish_queue_is_counted_nacked(ns: Namespace) -> None:
    """A quorum queue with reject-publish, full: every message is nacked at once, counted nacked (not
    unconfirmed, not lost) in one line, each named; exit 1; nothing more is in the queue."""
    queue = f"{ns.prefix}.small"
    conn, ch = ns.channel()
    ch.exchange_declare(ns.exchange, exchange_type="topic", durable=True)
    ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum", "x-max-length": 5,
                                                     "x-overflow": "reject-publish"})
    ch.queue_bind(queue, ns.exchange, routing_key="material.published")
    ch.confirm_delivery()
    with contextlib.suppress(pika.exceptions.NackError):
        for _ in range(20):
            ch.basic_publish("", queue, b"filler", pika.BasicProperties(delivery_mode=2))
    full = ns.count(queue)
    conn.close()
    try:
        done = ns.cli("publish", "--confirm-timeout", "30s", "--json", write_events(ns, 50), timeout=60)
        assert 1 == done.returncode, done.stderr[-2000:]
        lines = [orjson.loads(line) for line in done.stdout.splitlines()]
        assert {"nacked"} == {x["published"] for x in lines} and 50 == len(lines)
        last = done.stderr.strip().splitlines()[-1]
        assert f"50 published to {ns.exchange}: 0 confirmed, 50 nacked, 0 unconfirmed" == last
        assert full == ns.count(queue)
    finally:
        conn, ch = ns.channel()
        ch.queue_delete(queue)
        conn.close()


def test_the_summary_line_always_counts_confirmed_nacked_and_unconfirmed() -> None:
    """The last line names the three counts even when zero, the others only when there are some."""
    from collections import Counter

    assert "3 published to x: 3 confirmed, 0 nacked, 0 unconfirmed" == summary_line(3, "x", Counter(confirmed=3))
    assert "2 published to x: 1 confirmed, 0 nacked, 1 unconfirmed, 1 invalid" == summary_line(
        2, "x", Counter(confirmed=1, unconfirmed=1, invalid=1))
    assert "0 published to x: nothing to publish" == summary_line(0, "x", Counter())
