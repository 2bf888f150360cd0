"""``run`` and ``publish`` against the real RabbitMQ broker."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from brokerkit import Namespace

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_events"


def rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_samples_through_broker_match_replay(ns: Namespace) -> None:
    """Publishing the lesson's samples and running catalog gives the same state as replay."""
    declared = ns.cli("topology", "declare", "--consumer", "catalog")
    assert declared.returncode == 0, declared.stderr
    published = ns.cli("publish", str(SAMPLES))
    assert published.returncode == 0, published.stderr
    done = ns.run_until_idle("catalog")
    assert done.returncode == 0, done.stderr
    replay_db = ns.workdir / "replay.db"
    replayed = ns.cli("replay", "--consumer", "catalog", "--db", str(replay_db), str(SAMPLES))
    assert replayed.returncode == 1, replayed.stderr  # the samples include two rejections
    broker_db = ns.db("catalog")
    for sql in (
        "SELECT * FROM catalog ORDER BY article_id",
        "SELECT event_id, fingerprint, result, event_type FROM inbox ORDER BY event_id",
        "SELECT code, event_id, fingerprint FROM rejected ORDER BY code, event_id",
    ):
        assert rows(replay_db, sql) == rows(broker_db, sql), sql
    dead = ns.drain(ns.topology("catalog").dead_queue)
    codes = sorted(props.headers["x-error-code"] for props, _ in dead)
    assert ["event-id-reused", "revision-conflict"] == codes
