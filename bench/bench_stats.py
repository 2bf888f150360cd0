"""Status, ``inbox stats`` and the console's chart at 10k and at 5M receipts.

    python bench/bench_stats.py [--small 10000] [--large 5000000] [--days 30] [--repeat 15] [--keep DIR]

Builds two catalog databases (opened with ``ConsumerDB.open``, so the schema
and its migrations are the real ones) whose receipts are spread evenly over
the last ``--days`` days, written with raw SQL in time order, the counters
then counted once from them (what the migration's backfill does) but for
the newest 2,000, left uncounted as a live writer leaves the receipts of its
last second; a few hundred rejections in each. Then times, on a read-only connection as the
commands and the console open it:

* ``status``: what ``status`` reads from a consumer database
  (receipts in the last minute and hour, the newest, unresolved rejections);
* ``inbox stats``: receipts per result overall, in the last hour and day,
  the oldest and newest, rejections by code;
* ``console page``: what the console's front page reads from a consumer
  database: the status reads and the outcomes per minute over its 3-hour
  window, the minute cache warmed once (as the console does at start), so
  a page reads only the unsettled minutes;
* for the record, not held to the goal: the chart alone (warm), and the
  chart with an empty cache (the whole window read). They are bounded by the
  minutes read times the results, not by the receipts, but a sparse small
  inbox has fewer of those (tens of microseconds apart when warm).

Each figure is the median of ``--repeat`` calls; the ratio is large / small
(goal <= 2.0: the reads do not grow with the inbox). ``--keep DIR`` keeps the
databases there and reuses them on the next run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from delivery_consumer.console import chart
from delivery_consumer.consumers import open_db
from delivery_consumer.inbox import ConsumerDB, counters
from delivery_consumer.inbox import reports as queries
from delivery_consumer.ops import system_view as system

GOAL = 2.0
#: Receipts written since the writer's last catch-up (inbox/counters.py): every read adds them from the inbox.
TAIL = 2000
WINDOW_S = 3 * 3600


def build(path: Path, receipts: int, days: float, now: float) -> None:
    """*receipts* receipts evenly over the last *days* days up to *now*, in time order."""
    span = days * 86400
    with open_db(path, "catalog", create=True) as db:
        conn = db.conn
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("BEGIN IMMEDIATE")
        # 90% updated, the rest stale, same-state and a plugin's own result: a few results, as in service.
        insert = (
            "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at, partition_key)"
            " WITH RECURSIVE i(n) AS (SELECT ? UNION ALL SELECT n + 1 FROM i WHERE n < ?)"
            " SELECT printf('%032x', n), 'ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff',"
            " CASE WHEN n % 20 < 18 THEN 'updated' WHEN n % 20 = 18 THEN 'stale' ELSE"
            " CASE WHEN n % 40 = 19 THEN 'same-state' ELSE 'created' END END,"
            " 'material.published', strftime('%Y-%m-%dT%H:%M:%fZ', ? + n * ?, 'unixepoch'), 'article-' || (n % 1000)"
            " FROM i")
        counted = receipts - TAIL
        conn.execute(insert, (0, counted - 1, now - span, span / receipts))
        conn.executemany(
            "INSERT INTO rejected (code, reason, event_id, rejected_at, resolved_at) VALUES (?, 'bench', ?, "
            " strftime('%Y-%m-%dT%H:%M:%fZ', ?, 'unixepoch'), ?)",
            [("revision-conflict", f"r{i}", now - i * 600, None if i % 3 else "2026-01-01T00:00:00.000Z")
             for i in range(300)])
        counters.rebuild(conn)
        # the newest receipts not counted yet, as a live writer leaves them between two catch-ups
        conn.execute(insert, (counted, receipts - 1, now - span, span / receipts))
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def reads(now: float) -> dict[str, Callable[[ConsumerDB], object]]:
    warm: dict[str, chart.MinuteCache] = {}

    def page_chart(db: ConsumerDB) -> object:
        # the console's cache, warmed once as the console does at start: a page reads the unsettled minutes
        cache = warm.setdefault(str(db.path), chart.MinuteCache())
        return cache.minutes(db, WINDOW_S, now)

    return {
        "status": lambda db: system._consumer_db_status(db, now),
        "inbox stats": lambda db: queries.inbox_stats(db, now=now),
        "console page": lambda db: (system._consumer_db_status(db, now), page_chart(db)),
        "chart alone (warm)": page_chart,
        "chart (cold)": lambda db: chart.MinuteCache().minutes(db, WINDOW_S, now),
    }


#: Not held to the goal, printed for the record: the chart's reads are bounded by the minutes read
#: times the results, not by the receipts, but a sparse small inbox has fewer of those.
INFORMATIVE = {"chart alone (warm)", "chart (cold)"}


def timed(path: Path, read: Callable[[ConsumerDB], object], repeat: int) -> float:
    """Median seconds of *read* on a read-only connection (opened outside the timing)."""
    runs = []
    with open_db(path, "catalog", readonly=True) as db:
        read(db)  # the first call pays for reading the pages from disk
        for _ in range(repeat):
            started = time.perf_counter()
            read(db)
            runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=5_000_000)
    parser.add_argument("--days", type=float, default=30)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--keep", type=Path, default=None, help="keep (and reuse) the databases in this directory")
    args = parser.parse_args()
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        paths = {}
        for n in (args.small, args.large):
            paths[n] = where / f"stats-{n}-{args.days:g}d.db"
            if not paths[n].exists():
                started = time.monotonic()
                build(paths[n], n, args.days, now)
                print(f"built {n:,} receipts over {args.days:g} days in {time.monotonic() - started:.0f} s")
            else:
                # a kept database: its receipts end when it was built; the windows are read from then
                with open_db(paths[n], "catalog", readonly=True) as db:
                    newest = queries.inbox_stats(db)["newestReceivedAt"]
                from datetime import datetime
                now = min(now, datetime.fromisoformat(newest).timestamp()) if newest else now
        print(f"| read | {args.small:,} receipts | {args.large:,} receipts | ratio | goal |")
        print("|---|---:|---:|---:|---:|")
        worst = 0.0
        for name, read in reads(now).items():
            small, large = timed(paths[args.small], read, args.repeat), timed(paths[args.large], read, args.repeat)
            goal = "-" if name in INFORMATIVE else f"<= {GOAL}"
            if name not in INFORMATIVE:
                worst = max(worst, large / small)
            print(f"| {name} | {small * 1000:.2f} ms | {large * 1000:.2f} ms | **{large / small:.2f}** | {goal} |")
        print(f"worst ratio {worst:.2f} (goal <= {GOAL}): {'met' if worst <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
