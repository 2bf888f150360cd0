"""Benchmark: how long the outbox takes to drain once a nack storm ends.

A quorum queue of the benchmark's own (``x-max-length``, ``x-overflow:
reject-publish``) is filled until the broker nacks, so every row the
dispatcher sends is nacked; ``--rows`` rows over ``--keys`` keys wait in a
SQLite outbox. ``delivery-consumer dispatch`` runs (from ``--tree``: this
checkout by default, or another one to compare releases) through ``--storm``
seconds of nacks; then the queue is purged and the time until every row is
published is measured: the drain time after recovery. Printed with the
outages the dispatcher counted and its log's outage lines.

    python bench/bench_nack_storm.py [--rows 2000] [--keys 100] [--storm 30] [--tree /path/to/checkout]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pika
import pika.exceptions

from delivery_consumer import outbox
from delivery_consumer.amqp.topology import DEFAULT_URL
from delivery_consumer.model.envelope import from_mapping
from delivery_consumer.model.event_ids import new_event_id

ROUTING_KEY = "storm.x"


def fill(url: str, exchange: str, queue: str, capacity: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare(exchange, exchange_type="topic", durable=True)
    ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum", "x-max-length": capacity,
                                                     "x-overflow": "reject-publish"})
    ch.queue_bind(queue, exchange, routing_key=ROUTING_KEY)
    ch.confirm_delivery()
    with contextlib.suppress(pika.exceptions.NackError):
        for _ in range(capacity + 100):
            ch.basic_publish("", queue, b"filler", pika.BasicProperties(delivery_mode=2))
    conn.close()


def purge(url: str, queue: str, *, delete: bool = False) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    if delete:
        ch.queue_delete(queue)
    else:
        ch.queue_purge(queue)
    conn.close()


def write_rows(db: Path, rows: int, keys: int) -> None:
    conn = outbox.connect(db)
    revision: dict[str, int] = {}
    with outbox.transaction(conn):
        for i in range(rows):
            key = f"article-{i % keys}"
            revision[key] = revision.get(key, 0) + 1
            env = from_mapping({"eventId": new_event_id(), "type": "material.published", "articleId": key,
                                "revision": revision[key], "occurredAt": "2026-12-06T10:00:00Z",
                                "data": {"title": key, "url": f"https://example.org/{key}"}})
            outbox.enqueue(conn, env, routing_key=ROUTING_KEY)
    conn.close()


def published(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").fetchone()[0])


def attempted(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM outbox WHERE attempts > 0").fetchone()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--amqp-url", default=os.environ.get("DELIVERY_AMQP_URL", DEFAULT_URL))
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--storm", type=float, default=30.0, help="seconds of nacks before the queue is purged")
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout whose dispatcher runs")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    exchange, queue = f"{prefix}.events", f"{prefix}.storm"
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "producer.db"
        write_rows(db, args.rows, args.keys)
        fill(args.amqp_url, exchange, queue, args.rows + 100)
        env = {**os.environ, "PYTHONPATH": str(args.tree), "DELIVERY_AMQP_URL": args.amqp_url,
               "DELIVERY_EXCHANGE": exchange}
        log = Path(tmp) / "dispatch.log"
        with log.open("w") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(db),
                                     "--poll", "100ms"], env=env, stderr=sink, cwd=tmp, start_new_session=True)
        try:
            while attempted(db) == 0:
                time.sleep(0.05)
            time.sleep(args.storm)
            purge(args.amqp_url, queue)
            started = time.monotonic()
            deadline = started + args.timeout
            while published(db) < args.rows and time.monotonic() < deadline:
                time.sleep(0.05)
            drained = time.monotonic() - started
            done = published(db)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            purge(args.amqp_url, queue, delete=True)
            with contextlib.suppress(Exception):
                conn = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
                conn.channel().exchange_delete(exchange)
                conn.close()
        text = log.read_text()
    outages = re.search(r"; (\d+) broker outages?;", text)
    warnings = [line for line in text.splitlines() if "WARNING" in line or "warning" in line.lower()]
    print(f"tree {args.tree}: {args.rows} rows over {args.keys} keys, {args.storm:g}s of nacks")
    print(f"  drain after recovery: {drained:.2f}s ({done}/{args.rows} published)")
    print(f"  outages counted: {outages.group(1) if outages else '?'}; warning lines in the log: {len(warnings)}")


if __name__ == "__main__":
    main()
