"""Benchmark: ``delivery-consumer run`` against a bare pika consumer.

In one run, on the same broker, the same quorum-queue type and the same
prefetch, 20,000 messages each (seeded before the consumer starts):

* bare pika consumers that only ack -- per message, and ``multiple=True``
  every ``--batch`` messages (the transport's limit here);
* ``run`` in batch mode (``--batch``, one transaction per batch);
* ``run`` with one commit per delivery (``--batch 1``).

Each figure is measured from the first delivery to the last ack, inside the
consumer process (``run`` prints it in its exit line), best of ``--repeat``.
The ratio is against the best bare consumer. Durability is the production
one: WAL with synchronous=FULL.

    python bench/bench_run.py [--messages 20000] [--prefetch 200] [--batch 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import orjson

from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.amqp.topology import DEFAULT_URL, Topology
from delivery_consumer.model.deliveries import OutMessage
from delivery_consumer.model.event_ids import new_event_id

BARE = textwrap.dedent(
    """
    import sys, time, pika
    url, queue, n, prefetch, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    state = {"n": 0, "t0": 0.0}
    def on_message(ch, method, props, body):
        state["n"] += 1
        if state["n"] == 1:
            state["t0"] = time.perf_counter()
        if every == 1:
            ch.basic_ack(method.delivery_tag)
        elif state["n"] % every == 0 or state["n"] == n:
            ch.basic_ack(method.delivery_tag, multiple=True)
        if state["n"] == n:
            print(f"RATE {n / (time.perf_counter() - state['t0']):.1f}")
            ch.connection.close()
    def on_channel(ch):
        ch.basic_qos(prefetch_count=prefetch, callback=lambda _f: ch.basic_consume(queue, on_message))
    conn = pika.SelectConnection(pika.URLParameters(url),
                                 on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                                 on_close_callback=lambda c, r: c.ioloop.stop())
    conn.ioloop.start()
    """
)

#: The least work the whole job needs: the bare consumer above, plus the raw
#: SQL loop's apply (bench/raw_limit.py: same tables, same durability) of each
#: batch in one transaction, committed before its ``multiple`` ack. No
#: validation, no rejections, no poison notes, no pipe. With ``threaded`` the
#: batches are applied by a second thread (sqlite3 lets go of the GIL while
#: SQLite works and syncs), so pika keeps reading meanwhile; else the I/O loop
#: applies them itself.
BARE_SQL = textwrap.dedent(
    """
    import queue, sys, threading, time, pika
    sys.path.insert(0, sys.argv[7])
    import raw_limit
    url, queue_name, n, prefetch, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    threaded = sys.argv[8] == "threaded"
    state = {"n": 0, "t0": 0.0, "lines": []}
    batches = queue.Queue()

    def apply_then_ack(db, ch, lines, tag, last):
        raw_limit.apply_lines(db, lines)
        def ack():
            ch.basic_ack(tag, multiple=True)
            if last:
                print(f"RATE {n / (time.perf_counter() - state['t0']):.1f}")
                ch.connection.close()
        return ack

    def worker(ch):
        db = raw_limit.connect(sys.argv[6])
        while (item := batches.get()) is not None:
            ch.connection.ioloop.add_callback_threadsafe(apply_then_ack(db, ch, *item))
        db.close()

    inline_db = None if threaded else raw_limit.connect(sys.argv[6])
    def on_message(ch, method, props, body):
        state["n"] += 1
        if state["n"] == 1:
            state["t0"] = time.perf_counter()
        state["lines"].append(body)
        if state["n"] % every == 0 or state["n"] == n:
            item = (state["lines"], method.delivery_tag, state["n"] == n)
            state["lines"] = []
            if threaded:
                batches.put(item)
            else:
                apply_then_ack(inline_db, ch, *item)()
    def on_channel(ch):
        if threaded:
            threading.Thread(target=worker, args=(ch,), daemon=True).start()
        ch.basic_qos(prefetch_count=prefetch, callback=lambda _f: ch.basic_consume(queue_name, on_message))
    conn = pika.SelectConnection(pika.URLParameters(url),
                                 on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                                 on_close_callback=lambda c, r: c.ioloop.stop())
    conn.ioloop.start()
    batches.put(None)
    """
)

RUN_RATE = re.compile(r"first delivery to last ack [0-9.]+s, [0-9.]+s busy \(([0-9]+)/s\)")


def make_events(n: int, ids: str = "v4") -> list[bytes]:
    """Realistic bodies: several thousand articles, growing revisions; random
    (``v4``) or time-ordered (``v7``, as the toolkit's producers make) eventIds."""
    new_id = {"v4": lambda: str(uuid.uuid4()), "v7": new_event_id}[ids]
    bodies = []
    articles = max(1, n // 4)
    for i in range(n):
        article = i % articles
        bodies.append(orjson.dumps({
            "eventId": new_id(),
            "type": "material.published" if i % 7 else "material.withdrawn",
            "articleId": f"article-{article}",
            "revision": i // articles + 1,
            "occurredAt": "2026-11-29T10:00:00Z",
            "data": {"title": f"Доставка без потерь, выпуск {i}", "url": f"https://example.org/a/{article}"},
        }))
    return bodies


def seed(url: str, topo: Topology, bodies: list[bytes]) -> None:
    with Publisher(url, topologies=[topo], window=2000) as pub:
        results = pub.publish([
            OutMessage(routing_key=orjson.loads(b)["type"], body=b, exchange=topo.exchange,
                       message_id=orjson.loads(b)["eventId"]) for b in bodies
        ])
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"seeding failed: {len(bad)} messages not confirmed ({bad[0].reason})")


def delete_queues(url: str, topo: Topology) -> None:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    for queue, _args in topo.queues():
        ch.queue_delete(queue)
    ch.exchange_delete(topo.exchange)
    conn.close()


def bare(url: str, topo: Topology, n: int, prefetch: int, every: int) -> float:
    out = subprocess.run([sys.executable, "-c", BARE, url, topo.queue, str(n), str(prefetch), str(every)],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return float(out.split("RATE ")[1])


def bare_sql(url: str, topo: Topology, n: int, prefetch: int, every: int, workdir: Path, *,
             threaded: bool) -> float:
    """The bare consumer that also applies each batch with raw SQL before acking it."""
    db = workdir / f"bare-{uuid.uuid4().hex[:8]}.db"
    out = subprocess.run([sys.executable, "-c", BARE_SQL, url, topo.queue, str(n), str(prefetch), str(every),
                          str(db), str(Path(__file__).resolve().parent), "threaded" if threaded else "inline"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return float(out.split("RATE ")[1])


def ours(url: str, topo: Topology, prefetch: int, batch: int, workdir: Path) -> float:
    db = workdir / f"bench-{uuid.uuid4().hex[:8]}.db"
    proc = subprocess.run(
        ["delivery-consumer", "run", "--consumer", "catalog", "--db", str(db), "--amqp-url", url,
         "--exchange", topo.exchange, "--queue-prefix", topo.prefix, "--prefetch", str(prefetch),
         "--batch", str(batch), "--exit-when-idle", "1", "--log-level", "info"],
        capture_output=True, text=True, timeout=900,
    )
    match = RUN_RATE.search(proc.stderr)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return float(match.group(1))


def broker_parser(doc: str | None, *, messages: int | None = 20_000) -> argparse.ArgumentParser:
    """The options every benchmark against the broker takes: ``--messages``
    (None: it takes none), ``--repeat`` and ``--amqp-url``; it adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if messages is not None:
        parser.add_argument("--messages", type=int, default=messages)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--amqp-url", default=os.environ.get("DELIVERY_AMQP_URL", DEFAULT_URL))
    return parser


def bench_topology(stem: str = "bench", consumer: str = "catalog") -> Topology:
    """*consumer*'s topology for the material events under names of its own
    (``<stem>`` and six random hex digits): its own exchange and queues."""
    prefix = f"{stem}{uuid.uuid4().hex[:6]}"
    return Topology(consumer=consumer, binding_keys=("material.*",), exchange=f"{prefix}.events", prefix=prefix)


def main() -> None:
    parser = broker_parser(__doc__)
    parser.add_argument("--prefetch", type=int, default=500)
    parser.add_argument("--batch", type=int, default=250)
    args = parser.parse_args()
    bodies = make_events(args.messages)
    topo = bench_topology()
    modes = [
        ("bare pika, ack per message", lambda w: bare(args.amqp_url, topo, args.messages, args.prefetch, 1)),
        (f"bare pika, multiple ack every {args.batch}",
         lambda w: bare(args.amqp_url, topo, args.messages, args.prefetch, args.batch)),
        (f"run --batch {args.batch}", lambda w: ours(args.amqp_url, topo, args.prefetch, args.batch, w)),
        ("run --batch 1", lambda w: ours(args.amqp_url, topo, args.prefetch, 1, w)),
    ]
    best: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeat):
                for name, fn in modes:
                    delete_queues(args.amqp_url, topo)
                    seed(args.amqp_url, topo, bodies)
                    rate = fn(Path(tmp))
                    best[name] = max(best.get(name, 0.0), rate)
                    print(f"  {name:<40} {rate:>9.0f} msg/s", flush=True)
    finally:
        delete_queues(args.amqp_url, topo)
    limit = max(best[modes[0][0]], best[modes[1][0]])
    print(f"\n{dt.date.today()} · {os.cpu_count()} cores · {args.messages} messages · prefetch {args.prefetch} · "
          f"quorum queue · WAL + synchronous=FULL · best of {args.repeat}")
    print(f"{'mode':<40} {'msg/s':>9} {'ratio to bare limit':>20}")
    for name, _ in modes:
        print(f"{name:<40} {best[name]:>9.0f} {best[name] / limit:>20.2f}")


if __name__ == "__main__":
    main()
