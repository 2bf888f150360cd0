"""The store's practical limit: the same SQL as ``delivery-consumer replay``, nothing else.

Used by ``bench_replay.py`` as the baseline. It does what any consumer of this
store must do and no more:

* open the database with the same pragmas (WAL, ``synchronous=FULL``,
  ``busy_timeout``) and create the same tables (their SQL, read by the
  benchmark from a database the store made, is passed in ``--schema``);
* read the NDJSON lines, decode each with ``orjson.loads`` (it needs the
  field values) and compute the fingerprint it writes in the receipt
  (SHA-256 of ``orjson.dumps(obj, option=OPT_SORT_KEYS)``);
* per batch ``BEGIN IMMEDIATE``, the receipts of the batch read in one
  ``SELECT`` (one per event at batch 1), ... ``COMMIT``; per event
  ``SAVEPOINT``, the consumer's statements, the inbox ``INSERT``,
  ``RELEASE`` -- the statements and the order the store issues.

It skips what the real command adds: the size check, schema validation,
Python objects per event, error handling and the per-event output. It imports
nothing but the standard library and orjson, so its start-up is the
interpreter's own. It expects valid events (the benchmark's stream is).

    python bench/baseline_loop.py --consumer catalog --batch 100 --db X.db --schema S.sql FILE.ndjson
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import orjson

SORT = orjson.OPT_SORT_KEYS
PUBLISHED = "material.published"

INBOX_SELECT = "SELECT fingerprint, result FROM inbox WHERE event_id = ?"
INBOX_PREFETCH = "SELECT event_id, fingerprint FROM inbox WHERE event_id IN (SELECT value FROM json_each(?))"
INBOX_INSERT = (
    "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)"
)
CATALOG_SELECT = "SELECT revision, title, url, published FROM catalog WHERE article_id = ?"
CATALOG_UPSERT = """
INSERT INTO catalog (article_id, revision, title, url, published, event_id, occurred_at)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (article_id) DO UPDATE SET
    revision = excluded.revision, title = excluded.title, url = excluded.url,
    published = excluded.published, event_id = excluded.event_id,
    occurred_at = excluded.occurred_at
WHERE excluded.revision > catalog.revision
"""
AUDIT_INSERT = """
INSERT INTO audit (event_id, event_type, article_id, revision, occurred_at, fingerprint, envelope)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (event_id) DO NOTHING
"""
AUDIT_SELECT = "SELECT fingerprint FROM audit WHERE event_id = ?"


def catalog(conn: sqlite3.Connection, obj: dict[str, Any], canonical: bytes, fp: str) -> str:
    data = obj["data"]
    published = obj["type"] == PUBLISHED
    if conn.execute(
        CATALOG_UPSERT,
        (obj["articleId"], obj["revision"], data["title"], data["url"], int(published),
         obj["eventId"], obj["occurredAt"]),
    ).rowcount:
        return "updated"
    row = conn.execute(CATALOG_SELECT, (obj["articleId"],)).fetchone()
    if obj["revision"] < row[0]:
        return "stale"
    if (row[1], row[2], row[3]) == (data["title"], data["url"], int(published)):
        return "same-state"
    raise ValueError("revision-conflict: the benchmark stream has none")


def audit(conn: sqlite3.Connection, obj: dict[str, Any], canonical: bytes, fp: str) -> str:
    cur = conn.execute(
        AUDIT_INSERT,
        (obj["eventId"], obj["type"], obj["articleId"], obj["revision"], obj["occurredAt"], fp,
         canonical.decode()),
    )
    if cur.rowcount != 1:
        (stored,) = conn.execute(AUDIT_SELECT, (obj["eventId"],)).fetchone()
        if stored != fp:
            raise ValueError("event-id-reused: the benchmark stream has none")
    return "recorded"


EFFECTS: dict[str, Callable[[sqlite3.Connection, dict[str, Any], bytes, str], str]] = {
    "catalog": catalog,
    "audit": audit,
}


_last_second: tuple[int, str] = (-1, "")


def now_iso() -> str:
    """The receipt time, formatted as the store does (once per second)."""
    global _last_second
    when = time.time()
    if int(when) != _last_second[0]:
        _last_second = (int(when), time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)))
    return _last_second[1] + f".{int(when % 1 * 1000):03d}Z"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--consumer", choices=sorted(EFFECTS), required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--db", required=True)
    parser.add_argument("--schema", required=True, help="file with the store's CREATE statements")
    parser.add_argument("source")
    args = parser.parse_args()
    effect = EFFECTS[args.consumer]

    conn = sqlite3.connect(args.db, isolation_level=None, timeout=5.0)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA wal_autocheckpoint = 10000")  # as the store's writable connections
    conn.execute("PRAGMA cache_size = -65536")
    with open(args.schema, encoding="utf-8") as handle:
        statements = [s for s in handle.read().split(";\n") if s.strip()]
    conn.execute("BEGIN IMMEDIATE")
    for statement in statements:
        conn.execute(statement)
    conn.execute("COMMIT")

    execute = conn.execute

    def flush(batch: list[bytes]) -> None:
        execute("BEGIN IMMEDIATE")
        received_at = now_iso()
        objs = [orjson.loads(line) for line in batch]
        known: dict[str, str] | None = None
        if len(objs) > 1:  # the store reads a batch's receipts in one statement
            ids = orjson.dumps([obj["eventId"] for obj in objs]).decode()
            known = dict(execute(INBOX_PREFETCH, (ids,)).fetchall())
        for obj in objs:
            canonical = orjson.dumps(obj, option=SORT)
            fp = hashlib.sha256(canonical).hexdigest()
            event_id = obj["eventId"]
            execute("SAVEPOINT event")
            stored = known.get(event_id) if known is not None else (
                (execute(INBOX_SELECT, (event_id,)).fetchone() or (None,))[0])
            if stored is None:
                result = effect(conn, obj, canonical, fp)
                execute(INBOX_INSERT, (event_id, fp, result, obj["type"], received_at))
                if known is not None:
                    known[event_id] = fp
            elif stored != fp:
                raise ValueError("event-id-reused: the benchmark stream has none")
            execute("RELEASE event")
        execute("COMMIT")

    pending: list[bytes] = []
    with open(args.source, "rb") as lines:
        for line in lines:
            pending.append(line)
            if len(pending) == args.batch:
                flush(pending)
                pending = []
    if pending:
        flush(pending)
    conn.close()


if __name__ == "__main__":
    main()
