"""A multi-GB database: the integrity check at start is bounded for real, nothing is acked
before the whole file was checked, a damaged big file acks nothing, and a standby that watched
the file takes over without checking it again. Built fast on /dev/shm (a ballast of blobs);
start and takeover times are measured by bench/bench_bigfile.py, never asserted here."""

from __future__ import annotations

import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from brokerkit import kill
from partitionkit import Cluster, make_events
from support import count_rows, wait_until

from delivery_consumer import consumers
from delivery_consumer.amqp.partitions import Identity, partition_of

pytestmark = pytest.mark.broker

PARTITIONS = 2
BALLAST_MB = 2500


def build_big(path: Path, megabytes: int = BALLAST_MB, partition: Identity | None = None) -> None:
    """Partition *partition*'s catalog database at *path*, grown by *megabytes* of blobs (a table
    of its own: every page is read by the check, as receipts would be)."""
    consumers.open_db(path, "catalog", create=True, partition=partition).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("CREATE TABLE ballast (b BLOB NOT NULL)")
    conn.execute("BEGIN")
    conn.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
                 " INSERT INTO ballast (b) SELECT zeroblob(1048576) FROM n", (megabytes,))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


@pytest.fixture
def big_partition(cluster: Cluster) -> Iterator[Path]:
    """Partition 0's database, multi-GB, on /dev/shm (its directory a symlink from the state
    directory); removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shutil.disk_usage(shm).free < (BALLAST_MB + 500) << 20:
        pytest.skip("needs /dev/shm with room for a multi-GB database")
    home = shm / f"delivery-big-{uuid.uuid4().hex[:8]}"
    (home / "p0").mkdir(parents=True)
    cluster.db(0).parent.parent.mkdir(parents=True, exist_ok=True)
    cluster.db(0).parent.symlink_to(home / "p0")
    try:
        build_big(cluster.db(0), partition=Identity(0, PARTITIONS))
        yield cluster.db(0)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _mine(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if partition_of(str(e["articleId"]), PARTITIONS) == 0]


def test_a_big_file_starts_at_once_and_acks_only_after_its_whole_check(cluster: Cluster, big_partition: Path) -> None:
    """The check at start stops at its bound (0.1s) on a 2.5 GB file: run consumes at once, checks
    the whole file in the background and acks nothing before it passed; then every event of the
    partition is applied once. A standby started beside it checks the file while it waits, so
    after kill -9 of the active's main PID it takes over and acks without a check of its own."""
    active = cluster.start(0, "--integrity-check-limit", "100ms")
    err = active.wait_for_log("checking the whole file in the background")
    assert "consuming " in err or active.wait_for_log("consuming ")
    events = make_events(400, 80)
    cluster.publish(events)
    mine = _mine(events)
    wait_until("the active to apply its partition", lambda: count_rows(big_partition, "inbox") == len(mine), 180,
               [active])
    # receipts commit while the check runs; the check's verdict comes when it ends
    active.wait_for_log("integrity check passed", timeout=180)
    err = active.wait_for_log(" acked: ")
    assert err.index("integrity check passed") < err.index(" acked: "), err  # no ack before the check passed
    standby = cluster.start(0, "--integrity-check-limit", "100ms")
    standby.wait_for_log("checked whole in", timeout=180)
    assert "sound" in standby.output()[1]
    kill(active, main_only=True, within=10)
    standby.wait_for_log("taking over")
    more = make_events(400, 80, seed=11)
    for e in more:
        e["revision"] = int(e["revision"]) + 1000  # newer than the first ones
    cluster.publish(more)
    wait_until("the standby to apply its partition", lambda: count_rows(big_partition, "inbox") ==
               len(mine) + len(_mine(more)), 180, [standby])
    said = standby.output()[1]
    assert "first ack waits" not in said and "checking the whole file" not in said, said


def test_a_damaged_big_file_acks_nothing(cluster: Cluster, big_partition: Path) -> None:
    """A page of garbage in the receipts' index of a 2.5 GB file: the bounded check does not reach
    it, run consumes, but the background check finds it before any ack: exit 2, one line naming
    the damage and inbox recover; every event is still in the queue."""
    conn = sqlite3.connect(big_partition)
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'ballast'").fetchone()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.close()
    with open(big_partition, "r+b") as f:  # the ballast's last pages: far from the start of the check
        f.seek((pages - 10) * size)
        f.write(bytes(range(256)) * (size // 256) * 10)
    assert root < pages - 10
    events = make_events(200, 40)
    cluster.publish(events)
    active = cluster.start(0, "--integrity-check-limit", "100ms")
    active.communicate(timeout=180)
    err = active.output()[1]
    assert active.returncode == 2, err[-3000:]
    assert " acked: " not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "is damaged" in last and "inbox recover" in last, err[-3000:]
    queue = cluster.ns.topology("catalog", partition=0, partition_count=PARTITIONS).queue
    assert cluster.ns.count(queue) == len(_mine(events))
