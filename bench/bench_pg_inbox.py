"""Benchmark: a consumer's inbox on PostgreSQL, ``run``'s store path against the least work.

The same parsed events (the catalog consumer's, keys repeating), the same fresh database each time:

* **run's store path** -- what ``run``'s worker does with a batch, minus the broker: the in-flight note
  (its own transaction, ``synchronous_commit = off``), then ``apply_batch`` (the eventId locks, the
  receipts read, the catalog's ``apply_many``, the receipts written, the note cleared, COMMIT) on
  ``PgInboxDB``, the effect speaking through ``PgConnection`` (``?`` parameters translated);
* **minimal loop** -- the least a correct consumer does with psycopg: per batch one transaction with the
  same effect's two statements (the batch's stored rows read, the upsert by ``executemany``) and the
  receipts' INSERT by ``executemany``, COMMIT.

Rounds alternate the two; the ratio of each round is taken from figures measured seconds apart, and the
median of the rounds is printed beside the goal (run >= 0.7 of the minimal loop). ``--profile`` prints
where run's path spends its time (cProfile, one extra round).

    python bench/bench_pg_inbox.py [--events 20000] [--batch 250] [--repeat 5] [--pg postgresql://...]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from delivery_consumer.consumers import catalog
from delivery_consumer.inbox import InFlight, apply_batch
from delivery_consumer.inbox.pg import PgInboxDB
from delivery_consumer.model.envelope import Envelope, from_mapping
from delivery_consumer.store.sqlite import now_iso

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import new_event

GOAL = 0.7

MINIMAL_SCHEMA = """
CREATE TABLE inbox (event_id text PRIMARY KEY, seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    fingerprint text NOT NULL, result text NOT NULL, event_type text NOT NULL, received_at text NOT NULL,
    partition_key text, meta text, origin text);
CREATE TABLE catalog (article_id text PRIMARY KEY, revision bigint NOT NULL, title text NOT NULL,
    url text NOT NULL, published bigint NOT NULL, event_id text NOT NULL, occurred_at text NOT NULL);
"""
SELECT = ("SELECT article_id, revision, title, url, published FROM catalog WHERE article_id = ANY(%s)")
UPSERT = ("INSERT INTO catalog (article_id, revision, title, url, published, event_id, occurred_at)"
          " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (article_id) DO UPDATE SET"
          " revision = excluded.revision, title = excluded.title, url = excluded.url,"
          " published = excluded.published, event_id = excluded.event_id, occurred_at = excluded.occurred_at"
          " WHERE excluded.revision > catalog.revision")
RECEIPT = ("INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at, partition_key)"
           " VALUES (%s, %s, %s, %s, %s, %s)")


def make_events(n: int, keys: int) -> list[Envelope]:
    return [from_mapping(new_event(article_id=f"article-{i % keys}", revision=i // keys + 1,
                                   title=f"Title {i}", url=f"https://example.org/{i}")) for i in range(n)]


def fresh_database(admin: str) -> str:
    name = f"bench_inbox_{secrets.token_hex(4)}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = admin.rpartition("/")
    return f"{base}/{name}"


def drop_database(admin: str, url: str) -> None:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def run_path(url: str, events: list[Envelope], batch: int) -> float:
    """Events per second through run's store path."""
    with PgInboxDB.open(url, catalog.SPEC, create=True) as db:
        notes = InFlight(db, owner="bench:1:-")
        keys = [[f"k{i}" for i in range(j, min(j + batch, len(events)))] for j in range(0, len(events), batch)]

        def clear(tx: object, _outcomes: object) -> None:
            notes.clear(tx)  # type: ignore[arg-type]

        started = time.perf_counter()
        for n, i in enumerate(range(0, len(events), batch)):
            notes.mark(keys[n])
            apply_batch(db, events[i:i + batch], record_rejections=False, before_commit=clear)
        return len(events) / (time.perf_counter() - started)


def minimal_loop(url: str, events: list[Envelope], batch: int) -> float:
    """Events per second through the least work: one transaction per batch, effect + receipts."""
    with psycopg.connect(url, autocommit=True, prepare_threshold=1) as conn:
        conn.execute(MINIMAL_SCHEMA)
        cur = conn.cursor()
        started = time.perf_counter()
        for i in range(0, len(events), batch):
            chunk = events[i:i + batch]
            now = now_iso()
            with conn.transaction():
                stored = {row[0]: row[1] for row in cur.execute(SELECT, (list({e.key for e in chunk}),))}
                writes: dict[str, tuple[object, ...]] = {}
                results = []
                for e in chunk:
                    current = stored.get(e.key)
                    if current is None or e.revision > current:
                        stored[e.key] = e.revision
                        writes[e.key] = (e.key, e.revision, e.data["title"], e.data["url"],
                                         int(e.type == "material.published"), e.event_id, e.occurred_at)
                        results.append("updated")
                    else:
                        results.append("stale")
                cur.executemany(UPSERT, list(writes.values()))
                cur.executemany(RECEIPT, [(e.event_id, e.fingerprint, r, e.type, now, e.key)
                                          for e, r in zip(chunk, results, strict=True)])
        return len(events) / (time.perf_counter() - started)


def measure(admin: str, what: Callable[[str, list[Envelope], int], float], events: list[Envelope],
            batch: int) -> float:
    url = fresh_database(admin)
    try:
        return what(url, events, batch)
    finally:
        drop_database(admin, url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--batch", type=int, default=250)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--pg", default=os.environ.get("DELIVERY_POSTGRES_URL",
                                                       "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = parser.parse_args()
    events = make_events(args.events, args.keys)
    with psycopg.connect(args.pg) as conn:
        version = conn.execute("SHOW server_version").fetchone()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, PostgreSQL "
          f"{version[0] if version else '?'}, psycopg {psycopg.__version__}, {args.events} events over {args.keys}"
          f" keys, batch {args.batch}, load average {os.getloadavg()[0]:.1f}")
    ours, least, ratios = [], [], []
    for round_ in range(args.repeat):
        pair = [(run_path, ours), (minimal_loop, least)]
        if round_ % 2:
            pair.reverse()
        got = {}
        for what, into in pair:
            got[what] = measure(args.pg, what, events, args.batch)
            into.append(got[what])
        ratios.append(got[run_path] / got[minimal_loop])
        print(f"  round {round_ + 1}: run's path {got[run_path]:,.0f} ev/s, minimal loop {got[minimal_loop]:,.0f}"
              f" ev/s, ratio {ratios[-1]:.2f}")
    print(f"| run's store path on PostgreSQL, batch {args.batch} | {statistics.median(ours):,.0f}/s | minimal loop "
          f"{statistics.median(least):,.0f}/s | **{statistics.median(ratios):.2f}** (paired median) | >= {GOAL} |")
    if args.profile:
        profile = cProfile.Profile()
        url = fresh_database(args.pg)
        try:
            profile.runcall(run_path, url, events, args.batch)
        finally:
            drop_database(args.pg, url)
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
