"""Benchmark: end-to-end latency, from the producer's commit to the consumer's commit.

One producer writes one event per transaction through ``outbox.transaction``
(``producer.produce``: its own row and the event, ``BEGIN IMMEDIATE`` ...
``COMMIT`` with ``synchronous=FULL``) at a fixed rate, open loop (a late
event does not delay the next one); ``delivery-consumer dispatch`` and
``delivery-consumer run --consumer catalog`` run with their default options.
An event's latency is its receipt's ``received_at`` (stamped by the
consumer's transaction) minus its outbox row's ``created_at`` (stamped by the
producer's): both are millisecond stamps of the same clock, both taken just
before a commit's fsync. Printed: p50 / p99 / max per rate.

The limit beside it is the broker's own round trip at the same rate: a bare
pika loop publishing persistent messages (no confirms) to a quorum queue of
its own and a consumer in another process acking each one, latency = the
time the consumer received a message minus the time it was published.

The machine is shared: ``--repeat`` rounds, each rate measured for ours and
the limit seconds apart; the medians over rounds of p50 / p99 / max are
printed with the load average.

    python bench/bench_latency.py [--rates 200,1000] [--seconds 10] [--repeat 3]
    python bench/bench_latency.py --idle 10     # CPU time of an idle dispatch and run over 10 s
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from bench_run import bench_topology, broker_parser, delete_queues

from delivery_consumer.amqp.topology import Topology
from delivery_consumer.outbox import demo_producer as producer

#: The limit's consumer: prints one latency (ms) per message, then exits.
BARE_CONSUMER = textwrap.dedent(
    """
    import json, sys, time, pika
    url, queue, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    lat = []
    def on_message(ch, method, props, body):
        lat.append((time.time() - float(body)) * 1000)
        ch.basic_ack(method.delivery_tag)
        if len(lat) == n:
            print(json.dumps(lat)); sys.stdout.flush()
            ch.connection.close()
    def on_channel(ch):
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"},
                         callback=lambda _f: ch.basic_qos(prefetch_count=500, callback=lambda _g: (
                             ch.basic_consume(queue, on_message), print("READY", flush=True))))
    conn = pika.SelectConnection(pika.URLParameters(url),
                                 on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                                 on_close_callback=lambda c, r: c.ioloop.stop())
    conn.ioloop.start()
    """
)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def summary(latencies: list[float]) -> tuple[float, float, float]:
    return pct(latencies, 50), pct(latencies, 99), max(latencies)


def epoch_ms(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp() * 1000


def paced(rate: int, seconds: float, send: object) -> int:
    """Call *send(i)* *rate* times a second for *seconds*, open loop."""
    assert callable(send)
    n = int(rate * seconds)
    start = time.perf_counter()
    for i in range(n):
        wait = start + i / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        send(i)
    return n


def count(db: Path, table: str) -> int:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return 0
    try:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


def wait_for(done: object, timeout_s: float, what: str) -> None:
    assert callable(done)
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start(url: str, topo: Topology, work: Path) -> tuple[list[subprocess.Popen[bytes]], Path, Path]:
    """dispatch and run with their defaults (only the names are the bench's own)."""
    prod, cons = work / "producer.db", work / "catalog.db"
    producer.open_db(prod).close()
    names = ["--amqp-url", url, "--exchange", topo.exchange, "--queue-prefix", topo.prefix]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    run = subprocess.Popen(["delivery-consumer", "run", "--consumer", "catalog", "--db", str(cons), *names],
                           **quiet)  # type: ignore[call-overload]
    dispatch = subprocess.Popen(["delivery-consumer", "dispatch", "--db", str(prod), "-c", "catalog", *names],
                                **quiet)  # type: ignore[call-overload]
    return [run, dispatch], prod, cons


@contextlib.contextmanager
def pipeline(url: str, tmp: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], sqlite3.Connection, Path]]:
    """``dispatch`` and ``run`` under a fresh prefix, one event through: (processes, the producer's
    connection, the consumer's database); stopped and their queues deleted afterwards."""
    topo = bench_topology("lat")
    procs, prod, cons = start(url, topo, tmp)
    try:
        conn = producer.open_db(prod)
        try:
            # Warm up: both processes connected, the queue declared, one event through.
            producer.produce(conn, "warm-up", title="warm-up", url="https://example.org/w")
            wait_for(lambda: count(cons, "inbox") >= 1, 60, "the first event to arrive")
            yield procs, conn, cons
        finally:
            conn.close()
    finally:
        stop(*procs)
        delete_queues(url, topo)


def ours(url: str, rate: int, seconds: float) -> list[float]:
    """Latencies (ms) of one producer at *rate* through dispatch and run."""
    with tempfile.TemporaryDirectory() as tmp:
        with pipeline(url, Path(tmp)) as (_procs, conn, cons):
            first = conn.execute("SELECT max(seq) FROM outbox").fetchone()[0]

            def send(i: int) -> None:
                producer.produce(conn, f"article-{i % 1000}", title=f"title {i}",
                                 url=f"https://example.org/a/{i % 1000}")

            n = paced(rate, seconds, send)
            wait_for(lambda: count(cons, "inbox") >= n + 1, 120, f"{n} events to arrive")
            created = dict(conn.execute("SELECT event_id, created_at FROM outbox WHERE seq > ?", (first,)))
        c = sqlite3.connect(cons)
        try:
            received = dict(c.execute("SELECT event_id, received_at FROM inbox"))
        finally:
            c.close()
    return [epoch_ms(received[e]) - epoch_ms(at) for e, at in created.items()]


def broker_limit(url: str, rate: int, seconds: float) -> list[float]:
    """Latencies (ms) of a bare pika publish-to-consume loop at *rate*."""
    import pika

    queue = f"lat-limit-{uuid.uuid4().hex[:8]}"
    n = int(rate * seconds)
    consumer = subprocess.Popen([sys.executable, "-c", BARE_CONSUMER, url, queue, str(n)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert consumer.stdout is not None
        if consumer.stdout.readline().strip() != "READY":
            raise SystemExit("the limit's consumer did not start")
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        props = pika.BasicProperties(delivery_mode=2)
        paced(rate, seconds, lambda _i: ch.basic_publish("", queue, repr(time.time()).encode(), props))
        out, _ = consumer.communicate(timeout=120)
        ch.queue_delete(queue)
        conn.close()
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    return [float(x) for x in json.loads(out)]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of *pid* and its children (run forks its worker)."""
    total = cpu_s(pid)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        total += cpu_s(int(child))
    return total


def idle(url: str, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp, pipeline(url, Path(tmp)) as (procs, _conn, _cons):
        time.sleep(1)
        before = [tree_cpu_s(p.pid) for p in procs]
        time.sleep(seconds)
        after = [tree_cpu_s(p.pid) for p in procs]
    for name, b, a in zip(("run", "dispatch"), before, after, strict=True):
        used = a - b
        print(f"idle {name:<9} {1000 * used:7.0f} ms CPU in {seconds:g} s ({100 * used / seconds:.2f} % of a core)")


def main() -> None:
    parser = broker_parser(__doc__, messages=None)
    parser.add_argument("--rates", default="200,1000")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--idle", type=float, default=0.0, help="only measure idle CPU over this many seconds")
    args = parser.parse_args()
    if args.idle:
        idle(args.amqp_url, args.idle)
        return
    rates = [int(r) for r in args.rates.split(",")]
    figures: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    loads = []
    for round_ in range(args.repeat):
        for rate in rates:
            for name, fn in (("dispatch + run", ours), ("broker round trip", broker_limit)):
                loads.append(os.getloadavg()[0])
                p50, p99, top = summary(fn(args.amqp_url, rate, args.seconds))
                figures.setdefault((name, rate), []).append((p50, p99, top))
                print(f"  round {round_ + 1} {rate:>5}/s {name:<18} p50 {p50:6.1f} ms  p99 {p99:6.1f} ms  "
                      f"max {top:6.1f} ms  (load {loads[-1]:.1f})", flush=True)
    print(f"\n{dt.date.today()} · {os.cpu_count()} cores · {args.seconds:g} s per rate · defaults · "
          f"WAL + synchronous=FULL · median of {args.repeat} rounds · load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'rate':>7} {'path':<18} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99 / limit':>12}")
    for rate in rates:
        limit_p99 = statistics.median(f[1] for f in figures[("broker round trip", rate)])
        for name in ("dispatch + run", "broker round trip"):
            rows = figures[(name, rate)]
            p50, p99, top = (statistics.median(f[i] for f in rows) for i in range(3))
            print(f"{rate:>5}/s {name:<18} {p50:>8.1f} {p99:>8.1f} {top:>8.1f} {p99 / max(limit_p99, 0.1):>12.1f}")


if __name__ == "__main__":
    main()
