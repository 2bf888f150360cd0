"""``run`` and ``publish`` against the real RabbitMQ broker."""

from __future__ import annotations

from pathlib import Path

from brokerkit import Namespace
from support import read_rows

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_events"


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
    for table, columns in (
        ("catalog", "*"),
        ("inbox", "event_id, fingerprint, result, event_type"),
        ("rejected", "code, event_id, fingerprint"),
    ):
        assert read_rows(replay_db, table, columns) == read_rows(broker_db, table, columns), table
    dead = ns.drain(ns.topology("catalog").dead_queue)
    codes = sorted(props.headers["x-error-code"] for props, _ in dead)
    assert ["event-id-reused", "revision-conflict"] == codes


def test_a_new_database_is_announced_once(ns: Namespace) -> None:
    """run on a --db that does not exist creates it and says so in one warning naming the path (a first
    start, or a typo in --db); the next start on the same database says nothing of the kind."""
    first = ns.run_until_idle("catalog", idle=0.5)
    assert first.returncode == 0, first.stderr
    announced = [line for line in first.stderr.splitlines() if "no database was there" in line]
    assert 1 == len(announced) and str(ns.db("catalog").resolve()) in announced[0], first.stderr
    again = ns.run_until_idle("catalog", idle=0.5)
    assert again.returncode == 0, again.stderr
    assert "no database was there" not in again.stderr
