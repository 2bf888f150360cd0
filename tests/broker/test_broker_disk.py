"""A full disk is the environment's fault, never the messages': ``run`` with its
database on a real 3 MiB tmpfs and a backlog that does not fit holds its
deliveries, spends no attempt, dead-letters nothing, and applies every event
exactly once when space returns -- or exits 75 after --store-outage-limit."""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace, RunProcess
from support import count_rows, new_event, read_rows, wait_until
from webhook_server import free_port

pytestmark = pytest.mark.broker

EVENTS = 1000  # about 1.1 MB of WAL: more than the disk has left, less than all of it


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs, two thirds of it taken by a filler file; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        (mount / "filler").write_bytes(b"\0" * (2 * 1024 * 1024))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def start_on_full_disk(ns: Namespace, disk: Path, *args: str) -> tuple[RunProcess, Path]:
    events = [new_event(article_id=f"a-{i}") for i in range(EVENTS)]
    ns.publish([orjson.dumps(e) for e in events], declare=["audit"])
    db = disk / "audit.db"
    proc = ns.start_run("audit", "--db", str(db), "--retry-delays", "100ms", "--max-attempts", "2", *args)
    proc.wait_for_log("database unusable")
    return proc, db


def queues_besides_main(ns: Namespace) -> int:
    topo = ns.topology("audit", retry_delays_ms=(100,))
    return ns.count(topo.dead_queue) + ns.count(topo.retry_queue(0))


def test_a_full_disk_holds_the_backlog_and_every_event_applies_once_when_space_returns(
        ns: Namespace, small_disk: Path) -> None:
    """Disk full: no dead letter, no retry copy, metric delivery_store_healthy 0;
    after the filler is deleted every event is applied exactly once, by itself."""
    port = free_port()
    proc, db = start_on_full_disk(ns, small_disk, "--metrics-port", str(port), "--exit-when-idle", "3")
    assert 0 <= count_rows(db, "inbox") < EVENTS
    # The worker's figures reach /metrics within about a second (docs/run.md, "Metrics").
    wait_until("delivery_store_healthy 0 on /metrics", lambda: re.search(
        r'delivery_store_healthy\{consumer="audit"\} 0\.0',
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()), procs=[proc])
    assert 0 == queues_besides_main(ns)
    assert 0 == count_rows(db, "rejected")

    (small_disk / "filler").unlink()
    _, err = proc.communicate(timeout=120)
    assert 0 == proc.returncode, err
    assert 1 == err.count("database unusable"), err  # said once per change of state, not per try
    assert "database usable again" in err
    assert EVENTS == len(read_rows(db, "inbox", "DISTINCT event_id")) == count_rows(db, "inbox")
    assert EVENTS == count_rows(db, "audit")
    assert 0 == queues_besides_main(ns) + ns.count(ns.topology("audit").queue)
    assert 0 == count_rows(db, "rejected")
    assert 0 == count_rows(db, "deliveries", "attempts > 1 OR crashes > 0")


def test_a_disk_that_stays_full_stops_run_after_the_outage_limit(ns: Namespace, small_disk: Path) -> None:
    """Disk full for longer than --store-outage-limit: exit 75 (EX_TEMPFAIL, not the 2 of
    a configuration error) with one line saying so; nothing dead-lettered, every
    unapplied event still in the queue."""
    proc, db = start_on_full_disk(ns, small_disk, "--store-outage-limit", "2s")
    _, err = proc.communicate(timeout=60)
    assert 75 == proc.returncode, err
    assert "unusable for" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert 0 == queues_besides_main(ns)
    assert EVENTS - count_rows(db, "inbox") == ns.count(ns.topology("audit").queue)
