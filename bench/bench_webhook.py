"""Benchmark: what the fence costs the webhook consumer.

Notifications per second against a local endpoint that answers at once
(``tests/webhook_server.py`` in its own process, keep-alive HTTP/1.1), with
one ``Notifier`` (one pooled httpx client) and the same batches of events:

* **http only** -- the POSTs, nothing stored (the transport's limit here);
* **no fence** -- the same consumer without the fence: one transaction per
  batch that checks each receipt, makes the call and writes the receipt and
  the delivery count (the call inside the transaction: what the fence
  replaces, and the honest baseline: same client, same batch, same rows
  minus the fence's);
* **fence** -- ``fence.apply_fenced``: claim transaction (not synced, see
  fence.py), calls outside any transaction, completion transaction;
* **synced claim** -- the same with an ordinary (synced) claim transaction:
  what the unsynced claim saves, one fsync per batch.

Every event is a new key, so every event is a call. Each mode runs on a
fresh database (WAL, synchronous=FULL, as in production), the modes are
interleaved and the best of ``--repeat`` is kept. The ratio that matters is
fence / no fence (goal: at least 0.80).

    python bench/bench_webhook.py [--events 3000] [--batch 1 10 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from delivery_consumer.consumers import open_db
from delivery_consumer.consumers.webhook import Notifier, WebhookConfig
from delivery_consumer.inbox import ConsumerDB, InFlight, Transaction, fence, receipt_of
from delivery_consumer.model.contract import DeliveryMark, WorkHooks
from delivery_consumer.model.envelope import Envelope, from_mapping

SERVER = Path(__file__).resolve().parent.parent / "tests" / "webhook_server.py"


def make_events(n: int) -> list[Envelope]:
    return [
        from_mapping({
            "eventId": str(uuid.uuid4()),
            "type": "material.published",
            "articleId": f"article-{i}",
            "revision": 1,
            "occurredAt": "2026-11-30T10:00:00Z",
            "data": {"title": f"Доставка без потерь, выпуск {i}", "url": f"https://example.org/a/{i}"},
        })
        for i in range(n)
    ]


def batches(events: list[Envelope], size: int) -> list[list[Envelope]]:
    return [events[i:i + size] for i in range(0, len(events), size)]


def marks(batch: list[Envelope]) -> list[DeliveryMark]:
    return [DeliveryMark(e.event_id, redelivered=False, attempt=1) for e in batch]


def http_only(notifier: Notifier, events: list[Envelope], size: int, _db: ConsumerDB) -> None:
    for batch in batches(events, size):
        for env in batch:
            key = fence.fence_key(env.article_id, env.revision, notifier.name)
            result = notifier.call(fence.Call(key, notifier.payload(env), env))
            assert result.failure is None, result.failure


def write_receipt(tx: Transaction, env: Envelope, result: str) -> None:
    """The receipt of *env*, as a consumer without the fence writes it beside its call."""
    tx.conn.execute(
        "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at, partition_key)"
        " VALUES (?, ?, ?, ?, ?, ?)", (env.event_id, env.fingerprint, result, env.type, tx.now, env.article_id))


def no_fence(notifier: Notifier, events: list[Envelope], size: int, db: ConsumerDB) -> None:
    for batch in batches(events, size):
        with db.transaction() as tx:
            for env, mark in zip(batch, marks(batch), strict=True):
                if receipt_of(tx, env) is not None:
                    continue
                key = fence.fence_key(env.article_id, env.revision, notifier.name)
                result = notifier.call(fence.Call(key, notifier.payload(env), env))
                assert result.failure is None, result.failure
                write_receipt(tx, env, notifier.result)
                mark.record(tx, env.event_id, notifier.result)


def fenced(notifier: Notifier, events: list[Envelope], size: int, db: ConsumerDB) -> None:
    in_flight = InFlight(db)  # as run does: the batch, then each call, noted as under way
    for batch in batches(events, size):
        in_flight.mark([e.event_id for e in batch])
        outcomes = fence.apply_fenced(db, batch, marks(batch), notifier, WorkHooks(in_flight))
        assert all(o.result == notifier.result for o in outcomes), [o.status for o in outcomes][:3]


def synced_claim(notifier: Notifier, events: list[Envelope], size: int, db: ConsumerDB) -> None:
    names = vars(fence)
    unsynced = names["unsynced_transaction"]
    names["unsynced_transaction"] = lambda db: db.transaction()
    try:
        fenced(notifier, events, size, db)
    finally:
        names["unsynced_transaction"] = unsynced


Mode = Callable[[Notifier, list[Envelope], int, ConsumerDB], None]
MODES: list[tuple[str, Mode]] = [
    ("http only", http_only), ("no fence", no_fence), ("synced claim", synced_claim), ("fence", fenced),
]


def measure(mode: Mode, notifier: Notifier, n: int, size: int, workdir: Path) -> float:
    events = make_events(n)
    db = open_db(workdir / f"{uuid.uuid4().hex[:8]}.db", "webhook", create=True)
    try:
        started = time.perf_counter()
        mode(notifier, events, size, db)
        return n / (time.perf_counter() - started)
    finally:
        db.close()


def commit_latency_us(workdir: Path, n: int = 200) -> float:
    """Median time of a one-row WAL+FULL commit here and now (the fsync the fence adds per batch)."""
    conn = sqlite3.connect(workdir / "fsync.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    times = []
    for _ in range(n):
        started = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.execute("COMMIT")
        times.append(time.perf_counter() - started)
    conn.close()
    return sorted(times)[n // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, str(SERVER)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        notifier = Notifier(WebhookConfig(f"http://127.0.0.1:{port}/notify", True, 2.0, 2.0))
        with tempfile.TemporaryDirectory(prefix="bench-webhook-") as tmp:
            measure(fenced, notifier, 200, 100, Path(tmp))  # warm up: connections, imports, page cache
            print(f"# {dt.date.today()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}, "
                  f"{args.events} notifications per run, best of {args.repeat}; load average "
                  f"{os.getloadavg()[0]:.1f}, median commit (fsync) {commit_latency_us(Path(tmp)):.0f} us")
            print(f"{'batch':>5}  {'http only':>10}  {'no fence':>10}  {'synced claim':>12}  {'fence':>10}"
                  "  fence/no fence  synced/no fence  fence/http")
            for size in args.batch:
                best = dict.fromkeys((name for name, _ in MODES), 0.0)
                for _ in range(args.repeat):
                    for name, mode in MODES:
                        best[name] = max(best[name], measure(mode, notifier, args.events, size, Path(tmp)))
                print(f"{size:>5}  {best['http only']:>8.0f}/s  {best['no fence']:>8.0f}/s  "
                      f"{best['synced claim']:>10.0f}/s  {best['fence']:>8.0f}/s"
                      f"  {best['fence'] / best['no fence']:>14.2f}  {best['synced claim'] / best['no fence']:>15.2f}"
                      f"  {best['fence'] / best['http only']:>10.2f}")
        notifier.close()
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
