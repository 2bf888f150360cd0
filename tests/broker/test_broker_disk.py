"""A full disk is the environment's fault, never the messages': ``run`` with its
database on a real 3 MiB tmpfs and a backlog that does not fit holds its
deliveries, spends no attempt, dead-letters nothing, and applies every event
exactly once when space returns -- or exits 75 after --store-outage-limit."""

from __future__ import annotations

import fcntl
import os
import re
import struct
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


def _fill(disk: Path) -> Path:
    """Take every byte left on *disk* (a file written until ENOSPC)."""
    filler = disk / "rest"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 512, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    return filler


def test_a_disk_full_at_start_is_waited_out_and_every_event_applies_once(ns: Namespace, small_disk: Path) -> None:
    """The database exists, the disk is full before run starts (its WAL and -shm cannot be made):
    run logs once that the database is unusable at start and consumes nothing; once space returns
    it applies every event exactly once and exits 0 -- never exit 2; past the outage limit, 75."""
    db = small_disk / "audit.db"
    assert ns.cli("init", "--consumer", "audit", "--db", str(db)).returncode == 0
    events = [new_event(article_id=f"a-{i}") for i in range(300)]
    ns.publish([orjson.dumps(e) for e in events], declare=["audit"])
    filler = _fill(small_disk)
    stays = ns.start_run("audit", "--db", str(db), "--store-outage-limit", "2s")
    _, err = stays.communicate(timeout=60)
    assert stays.returncode == 75, err
    assert "database unusable at start" in err and "Traceback" not in err
    proc = ns.start_run("audit", "--db", str(db), "--exit-when-idle", "3")
    proc.wait_for_log("database unusable at start")
    assert ns.count(ns.topology("audit").queue) == len(events)
    filler.unlink()
    (small_disk / "filler").unlink()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert len(events) == len(read_rows(db, "inbox", "DISTINCT event_id")) == count_rows(db, "audit")
    assert 0 == ns.count(ns.topology("audit").queue) + queues_besides_main(ns)


class FailingDisk:
    """A real ext4 filesystem on a loop device that a test can make fail as a whole:
    :meth:`fail` shuts it down (every read and write then returns EIO, as a dying disk or a
    lost SAN path does), :meth:`remount` mounts it again (lazily unmounting the failed one)."""

    def __init__(self, image: Path, mount: Path) -> None:
        self.image, self.mount = image, mount

    def fail(self) -> None:
        fd = os.open(self.mount, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_DEFAULT))
        finally:
            os.close(fd)

    def remount(self) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], check=True)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mount)], check=True)


EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
# Flush what was written, then shut down. Not NOLOGFLUSH (2): that shutdown races with an fdatasync
# under way, which can return 0 for a write that is then not on the disk (a plain write+fdatasync
# loop lost its last synced write in 7 of 100 shutdowns, LOGFLUSH (1) in 3 of 100, this one in 0 of
# 100), so no program could keep an acknowledged commit through it; a real disk's EIO fails the fsync.
EXT4_GOING_FLAGS_DEFAULT = 0


@pytest.fixture
def failing_disk(tmp_path: Path) -> Iterator[FailingDisk]:
    """A 64 MiB ext4 on a loop device (root, and a kernel with loop and ext4); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a loop-mounted ext4 needs root (CI runs as root)")
    image, mount = tmp_path / "disk.img", tmp_path / "ext4"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    mounted = made.returncode == 0 and subprocess.run(
        ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True).returncode == 0
    if not mounted:
        pytest.skip(f"cannot make and mount an ext4 on a loop device here: {made.stderr.strip()}")
    try:
        yield FailingDisk(image, mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_disk_that_fails_with_eio_mid_stream_is_waited_out_and_every_event_applies_once(
        ns: Namespace, failing_disk: FailingDisk) -> None:
    """The filesystem under a running run fails as a whole (EIO, then "database disk image is
    malformed" on the same connection): run holds its deliveries, logs the outage once, and after
    the disk is mounted again opens the database anew and goes on -- never exit 2; every event is
    applied exactly once, nothing dead-lettered or retried, the queue empty."""
    events = [new_event(article_id=f"a-{i}") for i in range(3000)]
    ns.publish([orjson.dumps(e) for e in events], declare=["audit"])
    db = failing_disk.mount / "audit.db"
    proc = ns.start_run("audit", "--db", str(db), "--batch", "5", "--prefetch", "50", "--exit-when-idle", "3",
                        "--retry-delays", "100ms")
    wait_until("a first batch acked", lambda: " acked: " in proc.output()[1], 60, [proc])
    failing_disk.fail()
    proc.wait_for_log("closed after an I/O error")
    assert proc.poll() is None
    failing_disk.remount()
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"run did not finish after the disk came back:\n{proc.output()[1][-4000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    assert "opened again after the disk failed" in err and "Traceback" not in err
    applied = {row[0] for row in read_rows(db, "inbox", "DISTINCT event_id")}
    missing = [e["eventId"] for e in events if e["eventId"] not in applied]
    told = [line for line in err.splitlines()
            if "WARNING" in line or "ERROR" in line or any(m in line for m in missing[:1])]
    assert (len(events), 0) == (len(applied), len(missing)), "\n".join(told)
    assert len(events) == count_rows(db, "audit")
    assert 0 == ns.count(ns.topology("audit").queue) + queues_besides_main(ns)
    assert 0 == count_rows(db, "rejected")
