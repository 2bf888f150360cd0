"""Operator mistakes on the database of a running writer: deleted, replaced, a second
run, a standby, a damaged file; real processes, the real broker, kill -9 of a main PID.

What must hold: nothing is acknowledged (or reported, or published) from a file
that is no longer the database; the events not acknowledged stay in the queue;
one writer per database; a damaged file is refused before anything is written.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace, RunProcess, freeze_session, kill
from partitionkit import Cluster, make_events
from support import count_rows, wait_until

from delivery_consumer.amqp.partitions import partition_of
from delivery_consumer.outbox import demo_producer as producer

pytestmark = pytest.mark.broker

EVENTS = 6000


def _publish(ns: Namespace, n: int) -> list[dict[str, object]]:
    events = make_events(n, n // 5)
    ns.publish([orjson.dumps(e) for e in events], declare=["catalog"])
    return events


def _files(db: Path) -> list[Path]:
    return [db, Path(f"{db}-wal"), Path(f"{db}-shm")]


def _frozen_snapshot(proc: RunProcess, db: Path, snap: Path) -> int:
    """Stop every process of the run, copy its database as it is (what was committed
    before the mistake), and return the number of receipts in it."""
    freeze_session(proc.pid)
    snap.mkdir()
    for f in _files(db)[:2]:
        if f.exists():
            shutil.copy(f, snap / f.name.replace(db.name, "inbox.db"))
    return count_rows(snap / "inbox.db", "inbox")


def _mid_stream(ns: Namespace, proc: RunProcess) -> None:
    wait_until("a first batch acked", lambda: " acked: " in proc.output()[1], 60, [proc])


def _stopped_with_one_line(proc: RunProcess, words: str) -> str:
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"run did not stop after the mistake:\n{proc.output()[1][-3000:]}") from None
    err = proc.output()[1]
    assert proc.returncode == 2, err[-3000:]
    said = [line for line in err.splitlines() if words in line]
    assert len(said) == 1 and said[0].startswith("delivery-consumer: "), err[-3000:]
    return err


def _check_nothing_acked_after(ns: Namespace, before: int) -> None:
    queue = ns.topology("catalog").queue
    left = ns.count(queue)
    acked = EVENTS - left
    assert acked <= before, f"{acked} acked, but only {before} were committed before the mistake"
    assert left >= EVENTS - before  # every event the lost file held after the mistake is still in the queue


def _mistake_mid_stream(ns: Namespace, mistake: Callable[[Path], None], said: str) -> None:
    """Publish, start run, freeze it mid-stream and count what it committed, make *mistake* on its
    database file, let it go on: it stops with exit 2 and one line containing *said*, nothing acked
    beyond what was committed before the mistake, the rest still queued."""
    _publish(ns, EVENTS)
    db = ns.db("catalog")
    proc = ns.start_run("catalog", "--batch", "5", "--prefetch", "50")
    _mid_stream(ns, proc)
    before = _frozen_snapshot(proc, db, ns.workdir / "snap")
    assert before < EVENTS, "the stream was over before the mistake: nothing tested"
    mistake(db)
    os.killpg(proc.pid, signal.SIGCONT)
    _stopped_with_one_line(proc, said)
    _check_nothing_acked_after(ns, before)


def test_deleting_the_database_under_run_stops_it_and_nothing_is_acked_after(ns: Namespace) -> None:
    """rm of the database (and its -wal, -shm) under a running run: it stops with exit 2 and one
    line; no delivery is acked beyond what was committed before the deletion; the rest stays queued."""

    def delete(db: Path) -> None:
        for f in _files(db):
            f.unlink(missing_ok=True)

    _mistake_mid_stream(ns, delete, "was deleted while in use")


def test_replacing_the_database_under_run_stops_it_and_nothing_is_acked_after(ns: Namespace) -> None:
    """mv of another database over the running run's file: it stops with exit 2 and one line;
    nothing acked beyond what was committed before; the rest stays queued."""
    other = ns.workdir / "other.db"
    assert ns.cli("init", "--consumer", "catalog", "--db", str(other)).returncode == 0
    _mistake_mid_stream(ns, lambda db: os.replace(other, db), "was replaced while in use")


def test_a_second_run_of_one_database_is_refused_in_one_line(ns: Namespace) -> None:
    """A second run (no partitions) of a database a run holds exits 2 at once with one
    line naming the holder's pid; it consumes nothing."""
    _publish(ns, 10)
    first = ns.start_run("catalog", "--batch", "1")
    first.wait_for_log("consuming ")
    second = ns.run_until_idle("catalog", idle=1.0, timeout=60)
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"in use by pid {first.pid} (run)" in lines[0], second.stderr
    wait_until("the first run to apply all", lambda: count_rows(ns.db("catalog"), "inbox") == 10, 60, [first])
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
    assert first.returncode == 0


PARTITIONS = 2


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_standby_waits_for_the_database_and_takes_over_after_kill_9(cluster: Cluster) -> None:
    """A second run of one partition waits for its database ("standby: waiting for <db> held by
    pid N", once). On the active's port it serves nothing (the port is the active's, which says
    delivery_active 1); on a port of its own it is scraped while it waits: delivery_active 0,
    delivery_connected 0, and SIGTERM stops it (exit 0). After kill -9 of the active's main PID
    the same-port standby takes over, binds the port (delivery_active 1) and applies every event
    of the partition."""
    port, own = _free_port(), _free_port()
    series = '{consumer="catalog",partition="0"}'
    active = cluster.start(0, "--metrics-port", str(port))
    standby = cluster.start(0, "--metrics-port", str(port))
    err = standby.wait_for_log("metrics port busy: serving metrics once this run takes over")
    assert f"standby: waiting for state/catalog/p0/inbox.db held by pid {active.pid} (run)" in err, err
    assert standby.poll() is None and "consuming " not in err, err
    assert f"delivery_active{series} 1.0" in _scrape(port)
    other = cluster.start(0, "--metrics-port", str(own))
    text = wait_until("the waiting standby's own metrics", lambda: _scrape(own), 30, [other], ignoring=(OSError,))
    assert f"delivery_active{series} 0.0" in text and f"delivery_connected{series} 0.0" in text, text
    other.send_signal(signal.SIGTERM)
    other.communicate(timeout=60)
    assert other.returncode == 0, other.output()[1]
    kill(active, main_only=True, within=10)
    standby.wait_for_log("taking over")
    events = make_events(400, 80)
    cluster.publish(events)
    mine = [e for e in events if partition_of(str(e["articleId"]), PARTITIONS) == 0]
    wait_until("the standby to apply partition 0", lambda: count_rows(cluster.db(0), "inbox") == len(mine), 120,
               [standby])
    wait_until("the standby's metrics", lambda: f"delivery_active{series} 1.0" in _scrape(port), 30, [standby],
               ignoring=(OSError,))
    assert standby.output()[1].count("standby: waiting") == 1


def test_a_damaged_database_is_refused_at_open_with_how_to_recover(ns: Namespace) -> None:
    """A file whose inbox index has a page of garbage fails integrity_check; run refuses it
    at open (exit 2, one line naming inbox recover and a backup) and acks nothing."""
    source = ns.workdir / "events.ndjson"
    source.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in make_events(3000, 300)))
    db = ns.db("catalog")
    db.parent.mkdir(parents=True)
    assert ns.cli("replay", "--consumer", "catalog", "--db", str(db), "--batch", "500", str(source)).returncode == 0
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = 'sqlite_autoindex_inbox_1'").fetchone()
    conn.close()
    with open(db, "r+b") as f:  # a page of garbage in the eventId index
        f.seek((root - 1) * page_size)
        f.write(bytes(range(256)) * (page_size // 256))
    conn = sqlite3.connect(db)
    try:
        damaged = conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok"
    except sqlite3.DatabaseError:
        damaged = True
    conn.close()
    assert damaged
    _publish(ns, 10)
    done = ns.run_until_idle("catalog", idle=1.0, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is damaged" in lines[0] and "inbox recover" in lines[0] and "backup" in lines[0], \
        done.stderr
    assert ns.count(ns.topology("catalog").queue) == 10


def test_replay_stops_when_its_database_is_deleted_and_reports_nothing_after(ns: Namespace) -> None:
    """replay of stdin: once the database file is deleted, the next event's commit stops it
    (exit 2, one line) and no event given after the deletion is reported."""
    db = ns.workdir / "replay.db"
    events = make_events(20, 5)
    proc = subprocess.Popen([sys.executable, "-m", "delivery_consumer", "replay", "--consumer", "catalog", "--db",
                             str(db), "-"], cwd=ns.workdir, env=ns.env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    for e in events[:10]:
        proc.stdin.write(orjson.dumps(e).decode() + "\n")
    proc.stdin.flush()
    seen = [proc.stdout.readline() for _ in range(10)]
    assert all(events[i]["eventId"] in seen[i] for i in range(10)), seen
    for f in _files(db):
        f.unlink(missing_ok=True)
    for e in events[10:]:
        proc.stdin.write(orjson.dumps(e).decode() + "\n")
    proc.stdin.close()
    assert proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(60)
    assert proc.returncode == 2, err
    assert not any(str(e["eventId"]) in out for e in events[10:]), out
    assert len([line for line in err.splitlines() if "was deleted while in use" in line]) == 1, err


def test_dispatch_stops_when_its_database_is_deleted(ns: Namespace) -> None:
    """dispatch notices that the producer's database was deleted (exit 2, one line) and
    publishes nothing from the lost file."""
    db = ns.workdir / "producer.db"
    conn = producer.open_db(db)
    for i in range(20):
        producer.produce(conn, f"article-{i}", title=f"t{i}", url=f"https://example.org/{i}")
    conn.close()
    proc = subprocess.Popen([sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(db), "--consumer",
                             "catalog", "--poll", "100ms"], cwd=ns.workdir, env=ns.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until("every row published", lambda: count_rows(db, "outbox", "published_at IS NOT NULL") == 20, 60,
                   [proc])
        for f in _files(db):
            f.unlink(missing_ok=True)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 2, err
    assert len([line for line in err.splitlines() if "was deleted while in use" in line]) == 1, err
    assert ns.count(ns.topology("catalog").queue) == 20


def test_a_backup_copied_over_the_live_file_stops_run_and_nothing_is_acked_after(ns: Namespace) -> None:
    """cp of a backup (taken before the run started) over the running run's file -- same inode,
    other content: run stops with exit 2 and one line saying the content was replaced; nothing is
    acked beyond what was committed before; the rest stays queued."""
    db = ns.db("catalog")
    assert ns.cli("init", "--consumer", "catalog", "--db", str(db)).returncode == 0
    backup = ns.workdir / "backup.db"
    shutil.copyfile(db, backup)
    _mistake_mid_stream(ns, lambda live: shutil.copyfile(backup, live), "content was replaced while in use")
