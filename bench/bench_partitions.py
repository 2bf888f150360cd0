"""Benchmark: a partitioned consumer's total throughput against one unpartitioned ``run``.

In one run, on the same broker, 20,000 catalog events over 5,000 articles
are seeded into the queues before the consumers start, then consumed by

* one unpartitioned ``run`` (the reference),
* 1, 2 and 4 partitions, one ``run`` process each.

Each figure is events / (time the last receipt was committed - time the
first process logged that it consumes), on one clock, median of
``--repeat``; the ratio is against the unpartitioned run. Also measured: the
publisher's rate through the slot route (topic exchange -> headers exchange
with 256 slot bindings -> partition queues) against a plain topic binding
to one queue, the routing cost a partitioned consumer adds to the broker.

Each ``run`` is two processes (connection and worker), so 4 partitions are
8 busy processes: the figures depend on the cores. Say what else ran
beside any figure you quote.

    python bench/bench_partitions.py [--messages 20000] [--repeat 3]
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson
from bench_run import bench_topology, broker_parser, delete_queues, make_events

from delivery_consumer.amqp.partitions import partition_topologies, route, slot_headers, slots_exchange, unrouted_name
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.amqp.topology import Topology
from delivery_consumer.model.deliveries import OutMessage


def seed(url: str, base: Topology, bodies: list[bytes], partitions: int | None) -> float:
    """Publish *bodies* (routed by slot when *partitions*); returns the publish rate."""
    topologies = [base] if partitions is None else partition_topologies(base, partitions)
    routes = [] if partitions is None else [route(base, partitions)]
    messages = []
    for b in bodies:
        obj = orjson.loads(b)
        messages.append(OutMessage(routing_key=obj["type"], body=b, exchange=base.exchange, message_id=obj["eventId"],
                                   headers=slot_headers(obj["articleId"])))
    with Publisher(url, topologies=topologies, routes=routes, window=2000) as pub:
        pub.connect()
        started = time.perf_counter()
        results = pub.publish(messages)
        seconds = time.perf_counter() - started
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"seeding failed: {len(bad)} messages not confirmed ({bad[0].reason})")
    return len(bodies) / seconds


def delete_all(url: str, base: Topology, partitions: int) -> None:
    import pika

    for topo in partition_topologies(base, partitions):
        delete_queues(url, topo)
    delete_queues(url, base)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_delete(unrouted_name(base))
    ch.exchange_delete(slots_exchange(base))
    ch.exchange_delete(unrouted_name(base))
    conn.close()


def receipts(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
            try:
                total += conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
            finally:
                conn.close()
        except sqlite3.OperationalError:
            pass
    return total


def consume(url: str, base: Topology, n: int, partitions: int | None, workdir: Path) -> float:
    """Start the runs on seeded queues; events/s from the first 'consuming' to the last receipt."""
    tag = uuid.uuid4().hex[:8]
    common = ["--amqp-url", url, "--exchange", base.exchange, "--queue-prefix", base.prefix, "--log-level", "info"]
    if partitions is None:
        dbs = [workdir / f"{tag}.db"]
        cmds = [["run", "--consumer", "catalog", "--db", str(dbs[0]), *common]]
    else:
        dbs = [workdir / tag / f"p{k}.db" for k in range(partitions)]
        cmds = [["run", "--consumer", "catalog", "--partition", str(k), "--partitions", str(partitions),
                 "--db", str(dbs[k]), *common] for k in range(partitions)]
    started: list[float] = []
    procs = [subprocess.Popen([sys.executable, "-m", "delivery_consumer", *cmd], stderr=subprocess.PIPE, text=True)
             for cmd in cmds]

    def watch(proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "consuming " in line and len(started) < len(procs):
                started.append(time.monotonic())

    threads = [threading.Thread(target=watch, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 600
    while receipts(dbs) < n:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("a run failed or did not finish")
        time.sleep(0.02)
    finished = time.monotonic()
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(60)
    return n / (finished - min(started))


def main() -> None:
    args = broker_parser(__doc__).parse_args()
    bodies = make_events(args.messages)
    base = bench_topology()
    modes: list[tuple[str, int | None]] = [("unpartitioned run", None), ("1 partition", 1), ("2 partitions", 2),
                                           ("4 partitions", 4)]
    rates: dict[str, list[float]] = {name: [] for name, _ in modes}
    publish: dict[str, list[float]] = {"topic binding to one queue": [], "slot route (4 partitions)": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeat):
                for name, partitions in modes:  # interleaved: each repetition sees the same load
                    delete_all(args.amqp_url, base, 4)
                    pub_rate = seed(args.amqp_url, base, bodies, partitions)
                    if partitions is None:
                        publish["topic binding to one queue"].append(pub_rate)
                    elif partitions == 4:
                        publish["slot route (4 partitions)"].append(pub_rate)
                    rate = consume(args.amqp_url, base, args.messages, partitions, Path(tmp))
                    rates[name].append(rate)
                    print(f"  {name:<24} {rate:>9.0f} events/s   (published at {pub_rate:.0f}/s)", flush=True)
    finally:
        delete_all(args.amqp_url, base, 4)
    reference = statistics.median(rates[modes[0][0]])
    print(f"\n{dt.date.today()} · {os.cpu_count()} cores · {args.messages} events · median of {args.repeat} · "
          "WAL + synchronous=FULL · quorum queues")
    print(f"{'consumer':<28} {'events/s':>9} {'ratio to unpartitioned':>23} {'min .. max':>16}")
    for name, _ in modes:
        median = statistics.median(rates[name])
        spread = f"{min(rates[name]):.0f} .. {max(rates[name]):.0f}"
        print(f"{name:<28} {median:>9.0f} {median / reference:>23.2f} {spread:>16}")
    plain = statistics.median(publish["topic binding to one queue"])
    print(f"\n{'publisher, confirmed':<28} {'msgs/s':>9} {'ratio to plain binding':>23}")
    for name, values in publish.items():
        print(f"{name:<28} {statistics.median(values):>9.0f} {statistics.median(values) / plain:>23.2f}")


if __name__ == "__main__":
    main()
