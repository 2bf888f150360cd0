"""Two processes reach one webhook database (the writer lock bypassed: both call the
library directly) and race through the same stream, against the local endpoint; on
SQLite (one file) and on PostgreSQL (one schema, where several runs share the inbox).

What must hold: one call per key, never an older revision of an article notified
after a newer one (the last notification of each article is its latest revision),
and receipts that agree with the fence rows.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import read_rows, subprocess_env
from webhook_server import WebhookServer

from delivery_consumer import consumers

ARTICLES = 40
REVISIONS = 12

LIBRARY_FENCE = """
import sys
from delivery_consumer import consumers
from delivery_consumer.consumers.webhook import Notifier, WebhookConfig
from delivery_consumer.model.contract import DeliveryMark
from delivery_consumer.model.envelope import parse
from delivery_consumer.inbox import fence
from delivery_consumer.inbox.pg import PgInboxDB, is_url
db_path, url, source, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(source, "rb") as f:
    envs = [parse(line) for line in f.read().splitlines()]
notifier = Notifier(WebhookConfig(url, True, 2.0, 5.0))
opened = PgInboxDB.open(db_path, consumers.get("webhook")) if is_url(db_path) else consumers.open_db(db_path, "webhook")
with opened as db:
    for start in range(0, len(envs), batch):
        part = envs[start:start + batch]
        marks = [DeliveryMark(e.event_id, redelivered=False, attempt=1) for e in part]
        fence.apply_fenced(db, part, marks, notifier)
notifier.close()
"""


def _events() -> list[dict[str, Any]]:
    out = []
    for r in range(1, REVISIONS + 1):
        for a in range(ARTICLES):
            out.append({
                "eventId": str(uuid.uuid4()), "type": "material.published", "articleId": f"article-{a}",
                "revision": r, "occurredAt": "2026-12-01T10:00:00Z",
                "data": {"title": f"a{a} r{r}", "url": f"https://example.org/a/{a}"},
            })
    return out


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_processes_on_one_webhook_database_call_each_key_once(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """Two processes apply the same stream (batches of 3 and 5) to one webhook database:
    every key is called once, no article's revision is notified after a newer one, each
    article's last notification is its latest revision, and every receipt agrees with its fence row."""
    if backend == "sqlite":
        db: str | Path = tmp_path / "webhook.db"
        consumers.open_db(db, "webhook", create=True).close()

        def table(name: str, columns: str) -> list[tuple[Any, ...]]:
            return read_rows(Path(db), name, columns)
    else:
        from delivery_consumer.inbox.pg import PgInboxDB

        db = str(request.getfixturevalue("pg_url"))
        PgInboxDB.open(db, consumers.get("webhook"), create=True).close()

        def table(name: str, columns: str) -> list[tuple[Any, ...]]:
            import psycopg

            with psycopg.connect(str(db)) as conn:
                return [tuple(r) for r in conn.execute(f"SELECT {columns} FROM dc_webhook.{name}").fetchall()]
    events = _events()
    source = tmp_path / "events.ndjson"
    source.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    with WebhookServer(delay_s=0.002) as server:
        procs = [subprocess.Popen([sys.executable, "-c", LIBRARY_FENCE, str(db), server.url, str(source), str(batch)],
                                  env=subprocess_env(), stderr=subprocess.PIPE, text=True) for batch in (3, 5)]
        errors = [p.communicate(timeout=300)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errors
        calls = server.calls()
        requests = list(server.requests)
    twice = {key: n for key, n in calls.items() if n > 1}
    assert not twice, f"{len(twice)} keys called more than once, e.g. {list(twice.items())[:3]}"
    notified: dict[str, list[int]] = defaultdict(list)
    for request in requests:
        notified[str(request.body["articleId"])].append(int(request.body["revision"]))
    for article, revisions in notified.items():
        assert revisions == sorted(revisions), (article, revisions)
        assert revisions[-1] == REVISIONS, (article, revisions)
    fences = {row[0]: row for row in table("fence", "event_id, state, provider_id, entity_key, revision")}
    done = {(row[3], row[4]) for row in fences.values() if row[1] == "done"}
    revision_of = {str(e["eventId"]): (str(e["articleId"]), int(e["revision"])) for e in events}
    receipts = dict(table("inbox", "event_id, result"))
    assert len(receipts) == len(events)
    for event_id, result in receipts.items():
        row = fences.get(event_id)
        if result == "notified":
            assert row is not None and row[1] == "done" and row[2], (event_id, result, row)
        elif result == "stale":
            assert row is None or row[1] == "stale", (event_id, result, row)
        else:
            assert result == "already-notified" and revision_of[event_id] in done, (event_id, result, row)
    assert len(done) == sum(1 for n in calls.values() if n)
