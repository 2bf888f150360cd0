"""Two layouts of the receipt index, in raw SQL, as the inbox grows (not the store's code).

    python bench/inbox_layouts.py [--receipts 5000000] [--generation 50000] [--open-fill 0.5] [--repeat 3]

Replays the same 50k events at 100 per commit, with the store's pragmas, into
an empty database and into one already holding ``--receipts`` receipts, and
prints full ÷ empty for each layout: ``inbox(event_id PRIMARY KEY, …)`` as
the store has it, and generations (an index on ``(gen, event_id)``, full
generations sealed during the run behind a Bloom filter). docs/hot-path.md
explains both. Databases are prefilled once, copied and synced before each
run, so each run starts with its file at rest.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from sqlite3 import Connection, connect

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _stream

SORT = orjson.OPT_SORT_KEYS
FILTER_BITS = 1 << 27  # 16 MiB
HASHES = 7
UPSERT = (
    "INSERT INTO catalog VALUES (?, ?, ?, ?, ?) ON CONFLICT (article_id) DO UPDATE SET revision = excluded.revision,"
    " title = excluded.title, url = excluded.url, published = excluded.published"
)


def _open(path: Path, layout: str) -> Connection:
    conn = connect(path, isolation_level=None)
    for pragma in ("journal_mode = WAL", "synchronous = FULL", "cache_size = -65536", "wal_autocheckpoint = 10000"):
        conn.execute(f"PRAGMA {pragma}")
    if layout == "key":
        conn.execute("CREATE TABLE IF NOT EXISTS inbox (event_id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL,"
                     " result TEXT NOT NULL, received_at TEXT NOT NULL)")
    else:
        conn.execute("CREATE TABLE IF NOT EXISTS inbox (gen INTEGER NOT NULL, event_id TEXT NOT NULL,"
                     " fingerprint TEXT NOT NULL, result TEXT NOT NULL, received_at TEXT NOT NULL)")
        conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS inbox_event ON inbox (gen, event_id)")
        conn.execute("CREATE TABLE IF NOT EXISTS generations (gen INTEGER PRIMARY KEY, sealed INTEGER NOT NULL)")
        conn.execute("CREATE TABLE IF NOT EXISTS sealed_filter (id INTEGER PRIMARY KEY, bits BLOB NOT NULL)")
    conn.execute("CREATE TABLE IF NOT EXISTS catalog (article_id TEXT PRIMARY KEY, revision INTEGER NOT NULL,"
                 " title TEXT NOT NULL, url TEXT NOT NULL, published INTEGER NOT NULL)")
    return conn


def _positions(event_id: str) -> list[int]:
    h = int.from_bytes(hashlib.blake2b(event_id.encode(), digest_size=24).digest(), "little")
    return [(h >> (27 * i)) & (FILTER_BITS - 1) for i in range(HASHES)]


def _may_hold(bits: bytearray, event_id: str) -> bool:
    """Whether the filter may hold *event_id*; stops at the first clear bit."""
    h = int.from_bytes(hashlib.blake2b(event_id.encode(), digest_size=24).digest(), "little")
    for _ in range(HASHES):
        p = h & (FILTER_BITS - 1)
        if not bits[p >> 3] >> (p & 7) & 1:
            return False
        h >>= 27
    return True


def _add(bits: bytearray, event_id: str) -> None:
    for p in _positions(event_id):
        bits[p >> 3] |= 1 << (p & 7)


def _seal(conn: Connection, bits: bytearray, gen: int) -> None:
    """Seal generation *gen*: its eventIds into the filter, the filter
    persisted, the next generation opened; one transaction."""
    conn.execute("BEGIN IMMEDIATE")
    for (event_id,) in conn.execute("SELECT event_id FROM inbox WHERE gen = ?", (gen,)):
        _add(bits, event_id)
    conn.execute("INSERT OR REPLACE INTO generations VALUES (?, 1)", (gen,))
    conn.execute("INSERT INTO generations VALUES (?, 0)", (gen + 1,))
    conn.execute("INSERT OR REPLACE INTO sealed_filter VALUES (1, ?)", (bytes(bits),))
    conn.execute("COMMIT")


def prefill(path: Path, layout: str, count: int, generation: int, open_fill: float) -> None:
    """*count* random receipts; for generations, all sealed, and *open_fill*
    of a generation already in the open one."""
    conn = _open(path, layout)
    conn.execute("PRAGMA synchronous = OFF")
    bits = bytearray(FILTER_BITS // 8)
    sealed = count // generation
    conn.execute("BEGIN")
    for i in range(count + (int(generation * open_fill) if layout == "gen" else 0)):
        event_id = str(uuid.UUID(bytes=os.urandom(16), version=4))
        if layout == "key":
            conn.execute("INSERT INTO inbox VALUES (?, ?, 'updated', '2026')", (event_id, "0" * 64))
            continue
        gen = min(i // generation, sealed)
        conn.execute("INSERT INTO inbox VALUES (?, ?, ?, 'updated', '2026')", (gen, event_id, "0" * 64))
        if gen < sealed:
            _add(bits, event_id)
    if layout == "gen":
        conn.executemany("INSERT INTO generations VALUES (?, ?)", [(g, int(g < sealed)) for g in range(sealed + 1)])
        conn.execute("INSERT INTO sealed_filter VALUES (1, ?)", (bytes(bits),))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    os.sync()


def replay(path: Path, layout: str, lines: list[bytes], check_filter: bool, generation: int) -> float:
    """Events per second: the filter's load, the seals and the close's checkpoint included."""
    started = time.perf_counter()
    conn = _open(path, layout)
    ex = conn.execute
    bits = bytearray()
    open_gen = open_count = 0
    any_sealed = False
    if layout == "gen":
        row = ex("SELECT bits FROM sealed_filter").fetchone()
        bits = bytearray(row[0]) if row else bytearray(FILTER_BITS // 8)
        open_gen = ex("SELECT coalesce(max(gen), 0) FROM generations").fetchone()[0]
        open_count = ex("SELECT count(*) FROM inbox WHERE gen = ?", (open_gen,)).fetchone()[0]
        any_sealed = check_filter and row is not None
    now = "2026-12-01T00:00:00.000Z"
    for start in range(0, len(lines), 100):
        ex("BEGIN IMMEDIATE")
        for line in lines[start:start + 100]:
            obj = orjson.loads(line)
            fp = hashlib.sha256(orjson.dumps(obj, option=SORT)).hexdigest()
            event_id = obj["eventId"]
            if layout == "key":
                stored = ex("SELECT fingerprint FROM inbox WHERE event_id = ?", (event_id,)).fetchone()
            else:
                stored = ex("SELECT fingerprint FROM inbox WHERE gen = ? AND event_id = ?",
                            (open_gen, event_id)).fetchone()
                if stored is None and any_sealed and _may_hold(bits, event_id):
                    stored = ex("SELECT fingerprint FROM inbox WHERE gen IN (SELECT gen FROM generations"
                                " WHERE sealed) AND event_id = ?", (event_id,)).fetchone()
            if stored is not None:
                continue
            data, revision, article = obj["data"], obj["revision"], obj["articleId"]
            current = ex("SELECT revision FROM catalog WHERE article_id = ?", (article,)).fetchone()
            if current is None or revision > current[0]:
                ex(UPSERT, (article, revision, data["title"], data["url"], int(obj["type"] == "material.published")))
            if layout == "key":
                ex("INSERT INTO inbox VALUES (?, ?, 'updated', ?)", (event_id, fp, now))
            else:
                ex("INSERT INTO inbox VALUES (?, ?, ?, 'updated', ?)", (open_gen, event_id, fp, now))
                open_count += 1
        ex("COMMIT")
        if layout == "gen" and open_count >= generation:
            _seal(conn, bits, open_gen)
            open_gen, open_count, any_sealed = open_gen + 1, 0, check_filter
    conn.close()
    return len(lines) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--receipts", type=int, default=5_000_000)
    parser.add_argument("--generation", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--open-fill", type=float, default=0.5,
                        help="how full the open generation is when the run starts (0-1)")
    args = parser.parse_args()
    lines = _stream.ndjson(_stream.envelopes(50_000, seed=43)).splitlines()
    tmp = Path(tempfile.mkdtemp(prefix="dc-layouts-"))
    try:
        work = tmp / "run.db"
        variants = (("eventId key", "key", True), ("generations", "gen", True),
                    ("generations, no filter check", "gen", False))
        for layout in ("key", "gen"):
            started = time.perf_counter()
            prefill(tmp / f"full-{layout}.db", layout, args.receipts, args.generation, args.open_fill)
            took = time.perf_counter() - started
            extra = int(args.generation * args.open_fill) if layout == "gen" else 0
            shown = f" ({args.receipts % args.generation + extra:,} in the open generation)" if layout == "gen" else ""
            print(f"prefilled {layout}: {args.receipts + extra:,} receipts{shown} in {took:.0f} s", flush=True)
        for name, layout, check in variants:
            runs: dict[str, list[float]] = {"empty": [], "full": []}
            for i in range(args.repeat):
                for side in ("empty", "full") if i % 2 == 0 else ("full", "empty"):
                    for suffix in ("", "-wal", "-shm"):
                        Path(f"{work}{suffix}").unlink(missing_ok=True)
                    if side == "full":
                        shutil.copyfile(tmp / f"full-{layout}.db", work)
                    os.sync()
                    runs[side].append(replay(work, layout, lines, check, args.generation))
            empty, full = statistics.median(runs["empty"]), statistics.median(runs["full"])
            print(f"{name:30} empty {' '.join(f'{x:,.0f}' for x in runs['empty'])} | {args.receipts / 1e6:g}M "
                  f"{' '.join(f'{x:,.0f}' for x in runs['full'])} ev/s  ->  {full / empty:.2f} of empty", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
