"""Several processes write one consumer database at the same time.

Four processes start together on a database that does not exist yet (so
creation races too) and replay overlapping sets of events, in different
orders and batch sizes: three through the ``delivery-consumer`` console
script, one through the library (``apply_event`` in ``python -c``). None may
fail with "database is locked": writers wait for each other (BEGIN IMMEDIATE
and busy_timeout). Each eventId gets exactly one receipt, and exactly one
process saw its first result while every other delivery of it was answered
``duplicate:<that result>``.
"""

from __future__ import annotations

import random
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import PUBLISHED, WITHDRAWN, console_script, json_lines, ndjson, read_rows, subprocess_env

PROCESSES = 4
ARTICLES = 40
REVISIONS = 6

LIBRARY_REPLAY = """
import sys, orjson
from delivery_consumer import consumers
from delivery_consumer.model.envelope import parse
from delivery_consumer.inbox import ConsumerDB, apply_event
db_path, consumer, source = sys.argv[1:4]
with consumers.open_db(db_path, consumer, create=True) as db, open(source, "rb") as lines:
    for line in lines:
        env = parse(line.rstrip(b"\\n"))
        print(orjson.dumps({"eventId": env.event_id, "result": apply_event(db, env)}).decode(), flush=True)
"""


def make_events(rnd: random.Random) -> list[dict[str, Any]]:
    """REVISIONS events for each of ARTICLES articles, some withdrawn."""
    return [
        {
            "eventId": str(uuid.UUID(int=rnd.getrandbits(128), version=4)),
            "type": WITHDRAWN if rnd.random() < 0.2 else PUBLISHED,
            "articleId": f"article-{a}",
            "revision": r,
            "occurredAt": f"2026-11-29T10:{r:02d}:00Z",
            "data": {"title": f"Материал {a}, редакция {r}", "url": f"https://example.org/a/{a}"},
        }
        for a in range(ARTICLES)
        for r in range(1, REVISIONS + 1)
    ]


def split_overlapping(events: list[dict[str, Any]], rnd: random.Random) -> list[list[dict[str, Any]]]:
    """Each event goes to two of the processes; each process shuffles its share and redelivers a few."""
    shares: list[list[dict[str, Any]]] = [[] for _ in range(PROCESSES)]
    for event in events:
        for p in rnd.sample(range(PROCESSES), 2):
            shares[p].append(event)
    for share in shares:
        share.extend(rnd.sample(share, 5))
        rnd.shuffle(share)
    return shares


@pytest.mark.parametrize("consumer", ["catalog", "audit"])
def test_four_processes_replay_into_one_database(tmp_path: Path, consumer: str) -> None:
    """4 concurrent writers: no 'database is locked', the right final state, one receipt per eventId."""
    rnd = random.Random(20261129)
    events = make_events(rnd)
    shares = split_overlapping(events, rnd)
    db = tmp_path / "state" / consumer / "inbox.db"
    sources = []
    for i, share in enumerate(shares):
        sources.append(tmp_path / f"share-{i}.ndjson")
        sources[-1].write_bytes(ndjson(share))
    commands = [
        [console_script(), "replay", "--consumer", consumer, "--db", str(db), "--json", "--batch", str(batch),
         str(source)]
        for batch, source in zip((1, 10, 50), sources[:3], strict=False)
    ]
    commands.append([sys.executable, "-c", LIBRARY_REPLAY, str(db), consumer, str(sources[3])])

    children = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())
        for cmd in commands
    ]
    finished = [(child.wait(timeout=120), *child.communicate()) for child in children]

    for code, _, stderr in finished:
        assert 0 == code, stderr.decode()
        assert b"locked" not in stderr and b"Traceback" not in stderr
    reports = [json_lines(stdout.decode()) for _, stdout, _ in finished]
    assert [len(share) for share in shares] == [len(report) for report in reports]

    receipts = dict(read_rows(db, "inbox", "event_id, result"))
    assert sorted(e["eventId"] for e in events) == sorted(receipts)
    answers: dict[str, list[str]] = defaultdict(list)
    for report in reports:
        for line in report:
            answers[line["eventId"]].append(line["result"])
    for event_id, results in answers.items():
        first = receipts[event_id]
        assert sorted([first] + [f"duplicate:{first}"] * (len(results) - 1)) == sorted(results)

    if consumer == "catalog":
        top = {e["articleId"]: e for e in events if e["revision"] == REVISIONS}
        expected = sorted(
            (a, REVISIONS, e["data"]["title"], e["data"]["url"], int(e["type"] == PUBLISHED)) for a, e in top.items()
        )
        assert expected == read_rows(db, "catalog", "article_id, revision, title, url, published")
    else:
        assert sorted(orjson.dumps(e, option=orjson.OPT_SORT_KEYS).decode() for e in events) == [
            row[0] for row in read_rows(db, "audit", "envelope")
        ]
    assert [] == read_rows(db, "rejected")
