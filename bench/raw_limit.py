"""The least work the catalog job needs: a minimal raw SQL loop, same durability.

This is the limit ``replay`` is measured against (``bench_hotpath.py``). It is
NOT the store's schema nor the store's statements: it is what any program that
applies these events exactly once must do, and nothing more.

* tables ``inbox(event_id PK, fingerprint, result, received_at)`` and
  ``catalog(article_id PK, revision, title, url, published)``, no other index;
* WAL, ``synchronous=FULL`` (every commit synced), ``BEGIN IMMEDIATE … COMMIT``
  per batch; the page cache and the checkpoint interval are the store's
  (settings, not work: the same memory budget, the same WAL size);
* per event: ``orjson.loads``, the SHA-256 of the canonical bytes
  (``orjson.dumps(obj, option=OPT_SORT_KEYS)``), ``SELECT`` the receipt,
  ``SELECT`` the article's revision, upsert, ``INSERT`` the receipt.

No validation, no rejection bookkeeping, no output. It expects valid events
(the benchmark's stream is). ``--prefill N [--ids v4|v7]`` instead writes N
receipts into the database and exits (for the growth curve). ``--key F
--published T`` reads events of another type of the same shape (the key in
field F, T the published type; ``bench/_declared.py``).

    python bench/raw_limit.py --batch 100 --db X.db FILE.ndjson
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
import time

import orjson

SORT = orjson.OPT_SORT_KEYS
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS inbox (event_id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL,"
    " result TEXT NOT NULL, received_at TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS catalog (article_id TEXT PRIMARY KEY, revision INTEGER NOT NULL,"
    " title TEXT NOT NULL, url TEXT NOT NULL, published INTEGER NOT NULL)",
)
RECEIPT = "SELECT fingerprint FROM inbox WHERE event_id = ?"
ARTICLE = "SELECT revision, title, url, published FROM catalog WHERE article_id = ?"
UPSERT = (
    "INSERT INTO catalog (article_id, revision, title, url, published) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (article_id) DO UPDATE SET revision = excluded.revision, title = excluded.title,"
    " url = excluded.url, published = excluded.published"
)
INSERT = "INSERT INTO inbox (event_id, fingerprint, result, received_at) VALUES (?, ?, ?, ?)"


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA cache_size = -65536")
    conn.execute("PRAGMA wal_autocheckpoint = 10000")
    for statement in SCHEMA:
        conn.execute(statement)
    return conn


def stamp() -> str:
    when = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when % 1 * 1000):03d}Z"


KEY, PUBLISHED = "articleId", "material.published"


def apply_lines(conn: sqlite3.Connection, lines: list[bytes]) -> None:
    """Apply *lines* (one event each) in one ``BEGIN IMMEDIATE … COMMIT``."""
    execute = conn.execute
    execute("BEGIN IMMEDIATE")
    now = stamp()
    for line in lines:
        obj = orjson.loads(line)
        fp = hashlib.sha256(orjson.dumps(obj, option=SORT)).hexdigest()
        event_id = obj["eventId"]
        stored = execute(RECEIPT, (event_id,)).fetchone()
        if stored is not None:
            if stored[0] != fp:
                raise SystemExit("event-id-reused: the benchmark stream has none")
            continue
        data, revision, article = obj["data"], obj["revision"], obj[KEY]
        published = int(obj["type"] == PUBLISHED)
        row = execute(ARTICLE, (article,)).fetchone()
        if row is None or revision > row[0]:
            execute(UPSERT, (article, revision, data["title"], data["url"], published))
            result = "updated"
        elif revision < row[0]:
            result = "stale"
        elif (row[1], row[2], row[3]) == (data["title"], data["url"], published):
            result = "same-state"
        else:
            raise SystemExit("revision-conflict: the benchmark stream has none")
        execute(INSERT, (event_id, fp, result, now))
    execute("COMMIT")


def replay(conn: sqlite3.Connection, source: str, batch: int) -> None:
    pending: list[bytes] = []
    with open(source, "rb") as lines:
        for line in lines:
            pending.append(line)
            if len(pending) == batch:
                apply_lines(conn, pending)
                pending = []
    if pending:
        apply_lines(conn, pending)


def prefill(conn: sqlite3.Connection, count: int, ids: str, chunk: int = 100_000) -> None:
    """*count* receipts made before the benchmark's stream: random (``v4``)
    or time-ordered (``v7``) eventIds, in the order they were received."""
    import _stream

    event_id = _stream.past_ids(ids, *_stream.past_span(count))
    fp = "0" * 64
    done = 0
    while done < count:
        n = min(chunk, count - done)
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT, ((event_id(done + i), fp, "updated", "2026-01-01T00:00:00.000Z")
                                  for i in range(n)))
        conn.execute("COMMIT")
        done += n


def main() -> None:
    global KEY, PUBLISHED
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--db", required=True)
    parser.add_argument("--prefill", type=int, default=0, help="write N receipts and exit")
    parser.add_argument("--ids", default="v4", choices=("v4", "v7"), help="the prefilled receipts' eventIds")
    parser.add_argument("--key", default=KEY, help="the field holding the key")
    parser.add_argument("--published", default=PUBLISHED, help="the type that publishes")
    parser.add_argument("source", nargs="?")
    args = parser.parse_args()
    KEY, PUBLISHED = args.key, args.published
    conn = connect(args.db)
    if args.prefill:
        prefill(conn, args.prefill, args.ids)
    elif args.source:
        replay(conn, args.source, args.batch)
    conn.close()


if __name__ == "__main__":
    main()
