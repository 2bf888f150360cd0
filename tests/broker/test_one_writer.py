"""One database, one writer, whatever the path; restores that cannot lose acknowledged events.

Real runs on the shared broker, each with its ledger: a second run through a symlink, a hard
link, or after the lock note was deleted is refused naming the holder, and the first applies
every event exactly once; a backup copied over the live file stops run before any ack; an older
backup restored while stopped, or a deleted database, is refused at start until the loss is
accepted (after a replay from the source, nothing is lost); an empty file is never adopted.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace
from partitionkit import make_events, model
from support import count_rows, read_rows, wait_until

pytestmark = pytest.mark.broker


def _publish(ns: Namespace, events: list[dict[str, object]]) -> None:
    ns.publish([orjson.dumps(e) for e in events], declare=["catalog"])


def _catalog(db: Path) -> dict[str, tuple[int, str, int]]:
    return {a: (r, t, p) for a, r, t, p in read_rows(db, "catalog", "article_id, revision, title, published")}


def _one_line(stderr: str, words: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("delivery-consumer: "), stderr
    return lines[0]


def test_second_runs_through_a_symlink_a_hard_link_or_a_deleted_lock_are_refused_and_nothing_is_lost(
        ns: Namespace) -> None:
    """While a run works through 3,000 events: the lock note is deleted, then a run through a symlink
    to the file, one through a symlinked directory, one on the file itself and one through a hard link
    are each refused (exit 2, one line naming the holder's pid or the two names); the first run applies
    every event exactly once (one receipt each, the catalog equals the model) and the queue is empty."""
    events = make_events(3000, 300)
    _publish(ns, events)
    db = ns.db("catalog")
    first = ns.start_run("catalog", "--batch", "5", "--prefetch", "50")
    wait_until("a first batch acked", lambda: " acked: " in first.output()[1], 60, [first])
    Path(f"{db}.lock").unlink()
    (ns.workdir / "link.db").symlink_to(db)
    (ns.workdir / "linked").symlink_to(db.parent)
    for path in (ns.workdir / "link.db", ns.workdir / "linked" / "inbox.db", db):
        second = ns.start_run("catalog", "--exit-when-idle", "1", env=None) if path == db else None
        if second is None:
            done = ns.cli("run", "--consumer", "catalog", "--db", str(path), "--exit-when-idle", "1", timeout=60)
            code, err = done.returncode, done.stderr
        else:
            err = second.communicate(timeout=60)[1]
            code = second.returncode
        assert code == 2, err
        _one_line(err, f"in use by pid {first.pid} (run)")
    os.link(db, ns.workdir / "hard.db")
    done = ns.cli("run", "--consumer", "catalog", "--db", str(ns.workdir / "hard.db"), "--exit-when-idle", "1",
                  timeout=60)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and ("in use by pid" in line or "2 names" in line), done.stderr
    (ns.workdir / "hard.db").unlink()
    queue = ns.topology("catalog").queue
    wait_until("the first run to apply every event", lambda: count_rows(db, "inbox") == len(events), 120, [first])
    first.send_signal(signal.SIGTERM)
    assert first.communicate(timeout=60) and first.returncode == 0
    assert len(read_rows(db, "inbox", "DISTINCT event_id")) == len(events)
    assert _catalog(db) == model(events)
    assert ns.count(queue) == 0


def test_an_older_backup_restored_while_stopped_is_refused_until_the_loss_is_accepted(ns: Namespace) -> None:
    """300 events applied, a backup taken while stopped, 300 more applied; the backup restored:
    run refuses it (exit 2, one line: older than what was acknowledged, how to proceed) and
    consumes nothing; run --accept-loss starts (the loss logged, the record moved back); after
    replaying the lost 300 from their source the database holds all 600 receipts, the catalog the
    model, and a plain run starts again."""
    first, second = make_events(300, 60, seed=1), make_events(300, 60, seed=2)
    for e in second:
        e["revision"] = int(e["revision"]) + 1000  # newer than the first batch's
    db = ns.db("catalog")
    _publish(ns, first)
    assert ns.run_until_idle("catalog").returncode == 0
    backup = ns.workdir / "backup.db"
    shutil.copyfile(db, backup)
    _publish(ns, second)
    assert ns.run_until_idle("catalog").returncode == 0
    assert count_rows(db, "inbox") == 600
    for name in (f"{db}-wal", f"{db}-shm"):
        Path(name).unlink(missing_ok=True)
    shutil.copyfile(backup, db)  # the restore
    refused = ns.run_until_idle("catalog")
    assert refused.returncode == 2, refused.stderr
    line = _one_line(refused.stderr, "older than what was acknowledged")
    assert "receipts up to number 600" in line and "replay" in line.lower() and "--accept-loss" in line
    assert count_rows(db, "inbox") == 300
    accepted = ns.run_until_idle("catalog", "--accept-loss")
    assert accepted.returncode == 0, accepted.stderr
    assert "accepting the loss (--accept-loss)" in accepted.stderr
    assert count_rows(db, "inbox") == 300
    source = ns.workdir / "second.ndjson"
    source.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in second))
    assert ns.cli("replay", "--consumer", "catalog", "--db", str(db), str(source)).returncode == 0
    again = ns.run_until_idle("catalog")
    assert again.returncode == 0, again.stderr
    assert count_rows(db, "inbox") == 600
    assert _catalog(db) == model(first + second)


def test_a_deleted_database_or_an_empty_file_is_not_adopted(ns: Namespace) -> None:
    """After events were acknowledged, the database deleted: run refuses the new, empty one it
    would make (exit 2, one line), again at the next start; a 0-byte file at the path is refused
    in one line too; nothing is consumed."""
    db = ns.db("catalog")
    _publish(ns, make_events(50, 10))
    assert ns.run_until_idle("catalog").returncode == 0
    for name in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        name.unlink(missing_ok=True)
    _publish(ns, make_events(5, 5, seed=9))
    for _ in range(2):
        refused = ns.run_until_idle("catalog")
        assert refused.returncode == 2, refused.stderr
        _one_line(refused.stderr, "a new, empty database is here")
    db.unlink()
    db.write_bytes(b"")
    refused = ns.run_until_idle("catalog")
    assert refused.returncode == 2, refused.stderr
    _one_line(refused.stderr, "holds no database")
    assert ns.count(ns.topology("catalog").queue) == 5
