"""The console's status page on a consumer database with a million receipts.

    python bench/bench_console.py [--receipts 1000000] [--window 3h] [--repeat 5]

Builds a catalog database whose receipts are spread evenly over the chart's
window (the worst case: every receipt is drawn), plus a few thousand
rejections, and a deployment file naming it (the broker's queues under a
fresh prefix, so the page also asks the broker, as it does in production).
Then it serves the console in this process and times ``GET /`` over HTTP:

* cold: a new console each time (the minute cache empty: the whole window is read);
* warm: the same console again (settled minutes come from memory);

beside the least work the page needs (the limit):

* for cold, the bare chart query: one ``GROUP BY minute, result`` over the
  window's receipts, through the ``received_at`` index;
* for warm, the status queries alone: receipts in the last minute and hour,
  the newest receipt, unresolved rejections (what ``status`` reads).

Each figure is the median of ``--repeat`` runs, ours and the limit
alternating; every run is printed. The machine may be shared: read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from delivery_consumer import durations
from delivery_consumer.config import parse_file
from delivery_consumer.console import Console, make_server
from delivery_consumer.consumers import open_db
from delivery_consumer.sqlite import now_iso


def build(path: Path, receipts: int, window_s: float) -> None:
    now = time.time()
    step = window_s / receipts
    results = ["updated"] * 18 + ["duplicate:updated", "stale"]
    with open_db(path, "catalog", create=True) as db:
        db.conn.execute("BEGIN IMMEDIATE")
        db.conn.executemany(
            "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)",
            ((f"{i:032x}", "f" * 64, results[i % 20], "material.published", now_iso(now - window_s + i * step))
             for i in range(receipts)))
        db.conn.executemany(
            "INSERT INTO rejected (code, reason, event_id, rejected_at, resolved_at) VALUES (?, ?, ?, ?, ?)",
            (("revision-conflict", "bench", f"r{i}", now_iso(now - window_s + i * 3), now_iso(now))
             for i in range(receipts // 500)))
        db.conn.execute("COMMIT")


def get(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as answer:
        assert answer.status == 200
        answer.read()
    return time.perf_counter() - started


def chart_floor(path: Path, window_s: float) -> float:
    started = time.perf_counter()
    with open_db(path, "catalog", readonly=True) as db:
        db.conn.execute("SELECT substr(received_at, 1, 16), result, count(*) FROM inbox WHERE received_at >= ?"
                        " GROUP BY 1, 2", (now_iso(time.time() - window_s),)).fetchall()
    return time.perf_counter() - started


def status_floor(path: Path) -> float:
    now = time.time()
    started = time.perf_counter()
    with open_db(path, "catalog", readonly=True) as db:
        db.conn.execute("SELECT count(*) FILTER (WHERE received_at >= ?), count(*) FROM inbox WHERE received_at >= ?",
                        (now_iso(now - 60), now_iso(now - 3600))).fetchall()
        db.conn.execute("SELECT max(received_at) FROM inbox").fetchall()
        db.conn.execute("SELECT code, count(*) FROM rejected WHERE resolved_at IS NULL GROUP BY code").fetchall()
    return time.perf_counter() - started


def serve(console: Console) -> tuple[str, object]:
    server = make_server(console, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{console.address}/", server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receipts", type=int, default=1_000_000)
    parser.add_argument("--window", type=durations.parse, default="3h", help="The chart's window (e.g. 90m, 12h).")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-console-") as tmp:
        directory = Path(tmp)
        db = directory / "state" / "catalog" / "inbox.db"
        started = time.perf_counter()
        build(db, args.receipts, args.window)
        print(f"built {args.receipts:,} receipts over {durations.format(args.window)} "
              f"in {time.perf_counter() - started:.1f}s ({db.stat().st_size / 1e6:.0f} MB)")
        config = directory / "delivery.toml"
        config.write_text(f'queue_prefix = "bench-{uuid.uuid4().hex[:8]}"\n[consumers.catalog]\n'
                          'db = "state/catalog/inbox.db"\n')
        dep = parse_file(config)
        warm = Console(dep, window_s=args.window)
        warm_url, warm_server = serve(warm)
        get(warm_url)  # fills the warm console's cache, and the OS page cache
        runs: dict[str, list[float]] = {"cold": [], "chart floor": [], "warm": [], "status floor": []}
        for _ in range(args.repeat):
            cold = Console(dep, window_s=args.window)
            url, server = serve(cold)
            runs["cold"].append(get(url))
            server.shutdown()  # type: ignore[attr-defined]
            runs["chart floor"].append(chart_floor(db, args.window))
            runs["warm"].append(get(warm_url))
            runs["status floor"].append(status_floor(db))
        warm_server.shutdown()  # type: ignore[attr-defined]
    for name, values in runs.items():
        print(f"{name:>12}: " + " ".join(f"{v * 1000:.0f}" for v in values) + " ms")
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(f"\n{'page':>6} {'ours ms':>9} {'limit ms':>9} {'ratio':>6}")
    for ours, limit in (("cold", "chart floor"), ("warm", "status floor")):
        print(f"{ours:>6} {median[ours] * 1000:9.0f} {median[limit] * 1000:9.0f} {median[ours] / median[limit]:6.2f}")


if __name__ == "__main__":
    main()
