"""Benchmark: the dispatcher on PostgreSQL against the least work, and against the dispatcher on SQLite.

In one run, on the same broker and the same quorum queue (deleted and declared again before every
measurement), the same events, batch 1000 with two batches in flight:

* **minimal loop** -- the least work a correct PostgreSQL outbox relay does: per batch, one transaction
  that claims ``FOR UPDATE SKIP LOCKED`` and leases, a pipelined publish (the next batch sent while the one
  before waits for its confirms), one UPDATE that marks the confirmed rows;
* **dispatch (PostgreSQL)** -- ``outbox.Dispatcher`` on ``outbox.open_db("postgresql://...")``: the same
  rounds plus what the real one does (per-key order, leases of dead owners, routing-key checks, quarantine
  bookkeeping, headers);
* **dispatch (SQLite)** -- the same dispatcher on a SQLite file (WAL, synchronous=FULL).

Each figure drains a fresh outbox of the same events. Best of ``--repeat`` interleaved rounds and the
*paired* ratio (median over rounds of the ratio of figures measured seconds apart): the goal is
PostgreSQL dispatch >= 0.7 of the minimal loop.

    python bench/bench_pg_dispatch.py [--messages 20000] [--repeat 3] [--pg postgresql://postgres@127.0.0.1/postgres]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import psycopg

from delivery_consumer import outbox
from delivery_consumer.amqp.publisher import OutMessage, StreamPublisher
from delivery_consumer.amqp.topology import DEFAULT_URL, Topology
from delivery_consumer.store.sqlite import now_iso

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dispatch import dispatched, make_outbox, measure
from bench_run import make_events

BATCH = 1000
DEPTH = 2


def database(admin_url: str, name: str) -> str:
    base = admin_url.rsplit("/", 1)[0]
    return f"{base}/{name}"


def make_pg_outbox(url: str, bodies: list[bytes]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        outbox.install(conn)
        conn.execute("TRUNCATE outbox, outbox_owners")
        with conn.transaction():
            for body in bodies:
                outbox.enqueue(conn, body)
        conn.execute("VACUUM ANALYZE outbox")


def minimal(amqp_url: str, exchange: str, url: str) -> float:
    """Claim with SKIP LOCKED, publish pipelined, mark: nothing else."""
    owner = "minimal"
    with psycopg.connect(url, autocommit=True) as conn, \
            StreamPublisher(amqp_url, window=min(1000, BATCH), timeout_s=30) as pub:
        pub.connect()

        def claim() -> list[tuple[Any, ...]]:
            with conn.transaction():
                rows = conn.execute(
                    "SELECT seq, event_id, routing_key, body FROM outbox WHERE status = 'pending'"
                    " AND lease_owner IS NULL ORDER BY seq LIMIT %s FOR UPDATE SKIP LOCKED", (BATCH,)).fetchall()
                if rows:
                    conn.execute("UPDATE outbox SET lease_owner = %s, lease_until = %s WHERE seq = ANY(%s)",
                                 (owner, now_iso(time.time() + 60), [r[0] for r in rows]))
            return rows

        inflight: deque[tuple[list[tuple[Any, ...]], Any]] = deque()
        started = time.perf_counter()
        while True:
            while len(inflight) < DEPTH:
                rows = claim()
                if not rows:
                    break
                inflight.append((rows, pub.send([
                    OutMessage(routing_key=r[2], body=bytes(r[3]), exchange=exchange, message_id=r[1])
                    for r in rows])))
            if not inflight:
                break
            rows, ticket = inflight.popleft()
            results = pub.collect(ticket)
            conn.execute("UPDATE outbox SET status = 'published', published_at = %s, lease_owner = NULL,"
                         " lease_until = NULL WHERE seq = ANY(%s)",
                         (now_iso(), [r[0] for r, res in zip(rows, results, strict=True) if res.ok]))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--amqp-url", default=DEFAULT_URL)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="an admin URL: the benchmark creates and drops a database of its own")
    args = parser.parse_args()
    n = args.messages
    prefix = f"bench-pg-{secrets.token_hex(3)}"
    topo = Topology(consumer="catalog", exchange=f"{prefix}.events", prefix=prefix)
    bodies = make_events(n)
    name = f"bench_pg_{secrets.token_hex(4)}"
    with psycopg.connect(args.pg, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = database(args.pg, name)
    figures: dict[str, list[float]] = {"minimal loop": [], "dispatch (PostgreSQL)": [], "dispatch (SQLite)": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(1, args.repeat + 1):
                def fresh_pg() -> None:
                    make_pg_outbox(url, bodies)

                fresh_pg()
                figures["minimal loop"].append(measure(args.amqp_url, topo, n, "minimal loop",
                                                       lambda: minimal(args.amqp_url, topo.exchange, url)))
                fresh_pg()
                figures["dispatch (PostgreSQL)"].append(measure(
                    args.amqp_url, topo, n, "dispatch (PostgreSQL)",
                    lambda: dispatched(args.amqp_url, topo.exchange, url, BATCH, DEPTH)))
                db = Path(tmp) / f"producer-{round_}.db"
                make_outbox(db, bodies)
                figures["dispatch (SQLite)"].append(measure(
                    args.amqp_url, topo, n, "dispatch (SQLite)",
                    lambda db=db: dispatched(args.amqp_url, topo.exchange, db, BATCH, DEPTH)))  # type: ignore[misc]
                print(f"round {round_}: " + ", ".join(f"{k} {n / v[-1]:,.0f}/s" for k, v in figures.items()),
                      flush=True)
    finally:
        with psycopg.connect(args.pg, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        from bench_run import delete_queues

        delete_queues(args.amqp_url, topo)
    base = figures["minimal loop"]
    print(f"\n{n} events, batch {BATCH}, depth {DEPTH}, best of {args.repeat} rounds; ratio: paired median")
    print(f"{'':24} {'events/s':>10} {'/ minimal loop':>15}")
    for key, values in figures.items():
        paired = statistics.median(b / v for b, v in zip(base, values, strict=True))
        print(f"{key:24} {n / min(values):>10,.0f} {paired:>15.2f}")
    pg, lite = figures["dispatch (PostgreSQL)"], figures["dispatch (SQLite)"]
    print(f"dispatch PostgreSQL / SQLite (paired median): "
          f"{statistics.median(s / p for p, s in zip(pg, lite, strict=True)):.2f}")


if __name__ == "__main__":
    main()
