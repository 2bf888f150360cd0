"""Benchmark: ``delivery-consumer publish`` (pipelined confirms) against
publishing with one confirm round trip per message.

In one run, the same N valid envelopes (default 20,000) go to the same
quorum queue, persistent and mandatory, three ways:

* ``one confirm per message``: pika ``BlockingChannel`` in confirm mode,
  where ``basic_publish`` waits for each confirm (the naive safe publisher);
* ``Publisher (library)``: ``delivery_consumer.amqp.publisher.Publisher`` in-process,
  with a window of unconfirmed messages;
* ``delivery-consumer publish``: the whole command as a process (reading
  and validating the NDJSON file, start-up included).

Each figure is messages/s, best of ``--repeat``; ratios are against the
one-confirm-per-message publisher (goal: at least 5x).

    python bench/bench_publish.py [--messages 20000] [--repeat 3]
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pika

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_run import bench_topology, broker_parser, delete_queues, make_events

from delivery_consumer.amqp.admin import declare
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.amqp.topology import Topology
from delivery_consumer.model.deliveries import OutMessage


def one_confirm_each(url: str, topo: Topology, bodies: list[bytes]) -> float:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    started = time.perf_counter()
    for body in bodies:
        obj = orjson.loads(body)
        ch.basic_publish(topo.exchange, obj["type"], body,
                         pika.BasicProperties(delivery_mode=2, content_type="application/json",
                                              message_id=obj["eventId"]), mandatory=True)
    elapsed = time.perf_counter() - started
    conn.close()
    return len(bodies) / elapsed


def library(url: str, topo: Topology, bodies: list[bytes]) -> float:
    messages = []
    for body in bodies:
        obj = orjson.loads(body)
        messages.append(OutMessage(routing_key=obj["type"], body=body, exchange=topo.exchange,
                                   message_id=obj["eventId"]))
    with Publisher(url) as pub:
        pub.connect()
        started = time.perf_counter()
        results = pub.publish(messages)
        elapsed = time.perf_counter() - started
    assert all(r.ok for r in results), "some messages were not confirmed"
    return len(bodies) / elapsed


def command(url: str, topo: Topology, source: Path, n: int) -> float:
    started = time.perf_counter()
    proc = subprocess.run(["delivery-consumer", "publish", "--amqp-url", url, "--exchange", topo.exchange,
                           "--queue-prefix", topo.prefix, str(source)], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"publish failed: {proc.stderr[-1000:]}")
    return n / elapsed


def main() -> None:
    args = broker_parser(__doc__).parse_args()
    bodies = make_events(args.messages)
    topo = bench_topology("benchpub")
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "events.ndjson"
        source.write_bytes(b"".join(b + b"\n" for b in bodies))
        modes = {
            "one confirm per message": lambda: one_confirm_each(args.amqp_url, topo, bodies),
            "Publisher (library, pipelined)": lambda: library(args.amqp_url, topo, bodies),
            "delivery-consumer publish (process)": lambda: command(args.amqp_url, topo, source, len(bodies)),
        }
        try:
            for _ in range(args.repeat):
                for name, fn in modes.items():
                    delete_queues(args.amqp_url, topo)
                    declare(args.amqp_url, [topo])
                    rate = fn()
                    best[name] = max(best.get(name, 0.0), rate)
                    print(f"  {name:<38} {rate:>9.0f} msg/s", flush=True)
        finally:
            delete_queues(args.amqp_url, topo)
    base = best["one confirm per message"]
    print(f"\n{dt.date.today()} · {os.cpu_count()} cores · {args.messages} messages · quorum queue · "
          f"persistent, mandatory · best of {args.repeat}")
    print(f"{'mode':<38} {'msg/s':>9} {'x one-confirm':>14}")
    for name in modes:
        print(f"{name:<38} {best[name]:>9.0f} {best[name] / base:>14.1f}")


if __name__ == "__main__":
    main()
