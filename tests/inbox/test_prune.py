"""``inbox prune``: what goes, what is always kept, refusals, and a prune
while ``run`` keeps committing -- real broker, real SQLite, real processes.

Old receipts are written directly through SQL with an old ``received_at``.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, kill
from hypothesis import given, settings
from hypothesis import strategies as st
from support import env as envelope
from support import new_event, read_rows, wait_until

from delivery_consumer import consumers
from delivery_consumer.amqp.admin import declare
from delivery_consumer.amqp.dead_queue import DeadQueue
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.inbox import apply_batch, apply_event, dialect, inbox_rowid_before, retention
from delivery_consumer.model.deliveries import OutMessage
from delivery_consumer.model.errors import PruneRefused, Rejection
from delivery_consumer.store.sqlite import now_iso

DAY = 86400.0


def ago(days: float) -> str:
    return now_iso(time.time() - days * DAY)


def insert(db: Path, statement: str, rows: list[tuple[Any, ...]]) -> None:
    """*statement* once per row of *rows*, in one transaction (what a consumer would have written)."""
    conn = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        conn.execute("BEGIN")
        conn.executemany(statement, rows)
        conn.execute("COMMIT")
    finally:
        conn.close()


def add_receipts(db: Path, event_ids: list[str], days_old: float) -> None:
    insert(db, "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)",
           [(e, "f" * 64, "updated", "material.published", ago(days_old)) for e in event_ids])


def add_deliveries(db: Path, event_ids: list[str], days_old: float) -> None:
    insert(db, "INSERT INTO deliveries (key, event_id, deliveries, redeliveries, attempts, crashes, first_at, last_at,"
               " last_outcome) VALUES (?, ?, 1, 0, 1, 0, ?, ?, 'updated')",
           [(e, e, ago(days_old), ago(days_old)) for e in event_ids])


def add_rejection(db: Path, event_id: str, *, days_old: float, resolved_days_old: float | None = None,
                  dead_letter: str | None = None, body_sha256: str | None = None) -> None:
    resolved = ago(resolved_days_old) if resolved_days_old is not None else None
    insert(db, "INSERT INTO rejected (code, reason, event_id, body_sha256, attempts, dead_letter, rejected_at,"
               " resolved_at) VALUES ('event-id-reused', 'test', ?, ?, 1, ?, ?, ?)",
           [(event_id, body_sha256, dead_letter, ago(days_old), resolved)])


def ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


def new_db(ns: Namespace, consumer: str = "catalog") -> Path:
    path = ns.db(consumer)
    consumers.open_db(path, consumer, create=True).close()
    return path


def prune(ns: Namespace, *args: str, consumer: str = "catalog") -> subprocess.CompletedProcess[str]:
    return ns.cli("inbox", "prune", "--db", str(ns.db(consumer)), *args)


def remaining(db: Path, table: str, column: str = "event_id") -> set[Any]:
    return {row[0] for row in read_rows(db, table, column)}


def test_prune_refuses_an_age_below_the_horizon(ns: Namespace) -> None:
    """--older-than shorter than the horizon is refused with the reason, touching nothing;
    a lower --horizon (or DELIVERY_REDELIVERY_HORIZON) allows it."""
    db = new_db(ns)
    declare(ns.url, [ns.topology("catalog")])
    add_receipts(db, ids(3), days_old=4)
    refused = prune(ns, "--older-than", "3d")
    assert 2 == refused.returncode
    assert "--older-than 3d is shorter than the redelivery horizon 7d" in refused.stderr
    assert "applied again" in refused.stderr
    assert 3 == len(remaining(db, "inbox"))
    seconds = prune(ns, "--older-than", "30")  # a bare number is seconds
    assert 2 == seconds.returncode
    assert "--older-than 30s is shorter than the redelivery horizon 7d" in seconds.stderr
    bad = prune(ns, "--older-than", "30 days")
    assert 2 == bad.returncode
    assert "'30 days' is not a duration" in bad.stderr
    lowered = prune(ns, "--older-than", "3d", "--horizon", "2d")
    assert 0 == lowered.returncode, lowered.stderr
    assert set() == remaining(db, "inbox")
    add_receipts(db, ids(2), days_old=4)
    by_env = ns.cli("inbox", "prune", "--db", str(db), "--older-than", "3d",
                    env=ns.env(DELIVERY_REDELIVERY_HORIZON="3d"))
    assert 0 == by_env.returncode, by_env.stderr
    assert set() == remaining(db, "inbox")


def test_prune_keeps_young_dead_and_unresolved_receipts_and_deletes_the_rest(ns: Namespace) -> None:
    """Old receipts, delivery records and resolved rejections go in batches; receipts
    younger than --older-than, of events in the dead queue, or with an unresolved
    rejection stay; --dry-run counts the same and deletes nothing."""
    db = new_db(ns)
    topo = ns.topology("catalog")
    declare(ns.url, [topo])
    old, young, recent = ids(1200), ids(5), ids(4)
    (in_dead,), (unresolved,), (resolved,) = ids(1), ids(1), ids(1)
    add_receipts(db, [*old, in_dead, unresolved, resolved], days_old=40)
    add_receipts(db, young, days_old=1)
    add_receipts(db, recent, days_old=20)  # older than the horizon, younger than --older-than
    add_deliveries(db, [*old[:700], in_dead, unresolved], days_old=40)
    add_deliveries(db, young, days_old=1)
    add_rejection(db, unresolved, days_old=40)
    add_rejection(db, resolved, days_old=40, resolved_days_old=35)
    add_rejection(db, young[0], days_old=3, resolved_days_old=1)
    with Publisher(ns.url) as pub:  # a broker-side dead letter: no row in rejected
        (result,) = pub.publish([OutMessage(topo.dead_queue, orjson.dumps(new_event(event_id=in_dead)),
                                            message_id=in_dead)])
        assert result.ok
    dry = prune(ns, "--older-than", "30d", "--dry-run", "--json")
    assert 0 == dry.returncode, dry.stderr
    counted = orjson.loads(dry.stdout)
    assert (1201, 1, 1, 700, 1) == (counted["receipts"], counted["keptInDeadQueue"], counted["keptUnresolved"],
                                    counted["deliveries"], counted["rejections"])
    assert 1212 == len(remaining(db, "inbox"))
    done = prune(ns, "--older-than", "30d", "--batch", "500", "--json")
    assert 0 == done.returncode, done.stderr
    report = orjson.loads(done.stdout)
    assert {k: counted[k] for k in ("receipts", "deliveries", "rejections")} == {
        k: report[k] for k in ("receipts", "deliveries", "rejections")}
    assert report["batches"] >= 3 + 2 + 1
    assert {in_dead, unresolved, *young, *recent} == remaining(db, "inbox")
    assert {in_dead, unresolved, *young} == remaining(db, "deliveries")
    assert {unresolved, young[0]} == remaining(db, "rejected")
    assert 1 == ns.count(topo.dead_queue)  # read, and given back
    text = prune(ns, "--older-than", "30d")
    assert 0 == text.returncode, text.stderr
    assert "receipts:   0 deleted; kept: 1 in the dead queue, 1 with an unresolved rejection" in text.stdout


def test_prune_refuses_when_the_dead_queue_cannot_be_read_unless_told(ns: Namespace) -> None:
    """Broker unreachable, dead queue missing (wrong prefix) or held by another reader:
    prune refuses and deletes nothing; --without-dead-queue goes on, saying so."""
    db = new_db(ns)
    topo = ns.topology("catalog")
    add_receipts(db, ids(3), days_old=40)
    missing = prune(ns, "--older-than", "30d")
    assert 2 == missing.returncode
    assert f"cannot read the dead queue {topo.dead_queue}" in missing.stderr
    assert "does not exist" in missing.stderr
    down = prune(ns, "--older-than", "30d", "--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2F")
    assert 2 == down.returncode
    assert "--without-dead-queue" in down.stderr
    declare(ns.url, [topo])
    with DeadQueue(ns.url, topo.dead_queue) as holder:
        holder.open()
        busy = prune(ns, "--older-than", "30d")
    assert 2 == busy.returncode
    assert "in use by another reader" in busy.stderr
    assert 3 == len(remaining(db, "inbox"))
    forced = prune(ns, "--older-than", "30d", "--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2F",
                   "--without-dead-queue")
    assert 0 == forced.returncode, forced.stderr
    assert "the dead queue was not read" in forced.stdout
    assert set() == remaining(db, "inbox")


def test_prune_resolves_rejections_whose_dead_letter_is_gone(ns: Namespace) -> None:
    """An unresolved rejection whose copy is no longer in the dead queue (a requeue killed
    before it resolved it) is resolved by prune, which can then remove the receipt; one
    whose copy is still there keeps protecting its receipt."""
    db = new_db(ns)
    topo = ns.topology("catalog")
    declare(ns.url, [topo])
    (gone, present) = ids(2)
    present_body = orjson.dumps(new_event(event_id=present))
    from delivery_consumer.model.envelope import body_digest

    add_receipts(db, [gone, present], days_old=40)
    add_rejection(db, gone, days_old=40, dead_letter=topo.dead_queue, body_sha256="0" * 64)
    add_rejection(db, present, days_old=40, dead_letter=topo.dead_queue, body_sha256=body_digest(present_body))
    with Publisher(ns.url) as pub:
        assert pub.publish([OutMessage(topo.dead_queue, present_body, message_id=present)])[0].ok
    done = prune(ns, "--older-than", "30d")
    assert 0 == done.returncode, done.stderr
    assert "1 rejection resolved first" in done.stdout
    assert {present} == remaining(db, "inbox")
    assert [(gone,)] == read_rows(db, "rejected", "event_id", "resolved_at IS NOT NULL")


def test_prune_while_run_commits(ns: Namespace) -> None:
    """30 000 old receipts pruned in batches of 200 while run applies a steady stream:
    run keeps committing throughout (no gap over 1 s, no lock error), every event is
    applied once, and only the old receipts go."""
    db = new_db(ns)
    topo = ns.topology("catalog")
    declare(ns.url, [topo])
    old = ids(30_000)
    add_receipts(db, old, days_old=40)
    # Warnings only: nobody reads the pipe until the end, and a full pipe would block the logger.
    proc = ns.start_run("catalog", "--batch", "10", "--batch-wait", "0", "--log-level", "warning")
    stop = threading.Event()
    published: list[str] = []

    def publish_steadily() -> None:
        with Publisher(ns.url, exchanges=[ns.exchange]) as pub:
            while not stop.is_set():
                events = [new_event(article_id=f"a-{len(published) + i}") for i in range(10)]
                results = pub.publish([OutMessage(e["type"], orjson.dumps(e), exchange=ns.exchange,
                                                  message_id=e["eventId"]) for e in events])
                assert all(r.ok for r in results)
                published.extend(e["eventId"] for e in events)
                time.sleep(0.01)  # paces the stream (a steady load, not a flood); nothing waits on it

    thread = threading.Thread(target=publish_steadily)
    thread.start()
    try:
        wait_until("run's first commit", lambda: len(remaining(db, "inbox")) > len(old), procs=[proc])
        done = prune(ns, "--older-than", "30d", "--batch", "200", "--json")
        finished = time.time()  # the gap check below looks at run's commits up to here only
    finally:
        stop.set()
        thread.join()
    try:
        assert 0 == done.returncode, done.stderr
        report = orjson.loads(done.stdout)
        assert len(old) == report["receipts"]
        assert report["batches"] >= 150
        wait_until("every published event applied", lambda: set(published) <= remaining(db, "inbox"), 120, [proc])
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            kill(proc)
    assert 0 == proc.returncode, err
    assert "locked" not in err and "not committed" not in err
    missing = set(published) - remaining(db, "inbox")
    assert not missing, f"{len(missing)} of {len(published)} not applied; queue {ns.count(topo.queue)}; {err[-2000:]}"
    started = finished - report["seconds"]
    window = [row[0] for row in read_rows(db, "inbox", "DISTINCT received_at", "received_at BETWEEN ? AND ?",
                                          (now_iso(started), now_iso(finished)))]
    assert len(window) >= 5, f"run committed {len(window)} times during a {report['seconds']:.2f}s prune"
    stamps = [time.mktime(time.strptime(w[:19], "%Y-%m-%dT%H:%M:%S")) + float(w[19:-1]) for w in window]
    gaps = [b - a for a, b in zip([started - time.timezone, *stamps], [*stamps, finished - time.timezone],
                                  strict=True)]
    assert max(gaps) < 1.0, f"run stalled {max(gaps):.2f}s during the prune"


def test_redelivery_after_the_receipt_was_pruned_changes_no_effect(open_inbox: Any) -> None:
    """Past the horizon, without its receipt (on either backend): catalog's revision check answers
    stale or same-state and the row stays; audit's primary key answers recorded with still one
    row, and a reused eventId is still refused."""
    catalog, audit = open_inbox("catalog"), open_inbox("audit")
    r1, r2 = envelope(event_id=str(uuid.uuid4())), envelope(event_id=str(uuid.uuid4()), revision=2, title="v2")
    for db in (catalog, audit):
        for env in (r1, r2):
            apply_event(db, env)
        db.conn.execute("UPDATE inbox SET received_at = ?", (ago(40),))
        report = retention.prune(db, older_than_s=30 * DAY, keep_event_ids=set())
        assert 2 == report.receipts
    before = catalog.conn.execute("SELECT * FROM catalog").fetchall()
    assert ["stale", "same-state"] == [apply_event(catalog, env) for env in (r1, r2)]
    assert before == catalog.conn.execute("SELECT * FROM catalog").fetchall()
    assert ["recorded", "recorded"] == [apply_event(audit, env) for env in (r1, r2)]
    assert [(2,)] == audit.conn.execute("SELECT count(*) FROM audit").fetchall()
    with pytest.raises(Rejection, match="event-id-reused"):
        apply_event(audit, envelope(event_id=r1.event_id, title="another body"))


@settings(max_examples=60, deadline=None)
@given(ages=st.lists(st.integers(0, 60), max_size=60), holes=st.sets(st.integers(1, 60)),
       cutoff_days=st.integers(0, 61))
def test_the_rowid_bound_ends_the_prefix_received_before_the_cutoff(
        ages: list[int], holes: set[int], cutoff_days: int) -> None:
    """Receipts appended in time order (some deleted since): the rowids up to the bound the
    binary search finds are exactly the receipts received before the cutoff."""
    stamps = sorted(ago(days) for days in ages)
    with tempfile.TemporaryDirectory() as tmp:
        db = consumers.open_db(Path(tmp) / "x.db", "catalog", create=True)
        try:
            add = "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)"
            db.conn.executemany(add, [(str(uuid.uuid4()), "f" * 64, "updated", "t", s) for s in stamps])
            db.conn.executemany("DELETE FROM inbox WHERE rowid = ?", [(h,) for h in holes])
            cutoff = ago(cutoff_days)
            last = inbox_rowid_before(db.conn, cutoff)
            older = db.conn.execute("SELECT rowid FROM inbox WHERE received_at < ?", (cutoff,)).fetchall()
            assert older == db.conn.execute("SELECT rowid FROM inbox WHERE rowid <= ?", (last,)).fetchall()
        finally:
            db.close()


def test_prune_after_the_clock_went_back_never_deletes_a_young_receipt(open_inbox: Any) -> None:
    """Receipts written after the clock stepped back are out of time order (their own order: the
    rowid, PostgreSQL's seq): prune deletes the old prefix and keeps every receipt younger than the
    cutoff (an old one that lies beyond a younger one may stay until a later prune)."""
    db = open_inbox("catalog")
    old, young, late_old, more_young = ids(10), ids(3), ids(2), ids(2)
    add = "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)"
    for group, days in ((old, 40), (young, 1), (late_old, 40), (more_young, 1)):
        db.conn.executemany(add, [(e, "f" * 64, "updated", "material.published", ago(days)) for e in group])
    report = retention.prune(db, older_than_s=30 * DAY, keep_event_ids=set())
    left = {row[0] for row in db.conn.execute("SELECT event_id FROM inbox")}
    assert not left & set(old)
    assert {*young, *more_young} <= left
    assert 17 - len(left) == report.receipts
    assert set(late_old) <= left  # beyond a younger receipt in the receipts' own order


def test_prune_keeps_what_a_redelivery_still_needs_on_either_backend(open_inbox: Any) -> None:
    """Through the library on SQLite and PostgreSQL alike: old receipts, delivery records and resolved
    rejections go in batches; the young receipts, those of events kept (the dead queue's) and those with
    an unresolved rejection stay; a dry run counts the same and deletes nothing."""
    db = open_inbox("catalog")
    old, young = ids(23), ids(3)
    (kept,), (unresolved,), (resolved,) = ids(1), ids(1), ids(1)
    add = "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)"
    db.conn.executemany(add, [(e, "f" * 64, "updated", "t", ago(40)) for e in [*old, kept, unresolved, resolved]])
    db.conn.executemany(add, [(e, "f" * 64, "updated", "t", ago(1)) for e in young])
    db.conn.executemany("INSERT INTO deliveries (key, event_id, deliveries, redeliveries, attempts, crashes,"
                        " first_at, last_at, last_outcome) VALUES (?, ?, 1, 0, 1, 0, ?, ?, 'updated')",
                        [(e, e, ago(40), ago(40)) for e in [*old[:9], kept, unresolved]])
    reject = ("INSERT INTO rejected (code, reason, event_id, attempts, rejected_at, resolved_at)"
              " VALUES ('event-id-reused', 'test', ?, 1, ?, ?)")
    db.conn.execute(reject, (unresolved, ago(40), None))
    db.conn.execute(reject, (resolved, ago(40), ago(35)))
    dry = retention.prune(db, older_than_s=30 * DAY, keep_event_ids={kept}, dry_run=True, batch=5)
    assert (24, 1, 1, 9, 1) == (dry.receipts, dry.kept_in_dead_queue, dry.kept_unresolved, dry.deliveries,
                                dry.rejections)
    assert 29 == db.conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
    done = retention.prune(db, older_than_s=30 * DAY, keep_event_ids={kept}, batch=5, sleep=lambda _s: None)
    assert (24, 9, 1) == (done.receipts, done.deliveries, done.rejections)
    assert done.batches >= 5 + 2 + 1
    assert {kept, unresolved, *young} == {row[0] for row in db.conn.execute("SELECT event_id FROM inbox")}
    assert {kept, unresolved} == {row[0] for row in db.conn.execute("SELECT event_id FROM deliveries")}
    assert [(unresolved,)] == db.conn.execute("SELECT event_id FROM rejected").fetchall()


# -- clocks ---------------------------------------------------------------------------------------

FAKETIME = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))


@pytest.mark.parametrize("skew", ["+400d", "-400d"])
def test_prune_under_a_skewed_clock_is_refused_and_redeliveries_stay_duplicates(ns: Namespace, skew: str) -> None:
    """inbox prune --older-than 30d run under a clock 400 days off (libfaketime: the process's clock
    only, as a wrong container clock or a faked one): refused in one line, every receipt kept; the
    same 50 events sent again are all duplicates (applied once). The same prune under the true clock
    deletes nothing young either."""
    if not FAKETIME:
        pytest.skip("libfaketime is not installed (apt-get install libfaketime; .ci/run installs it)")
    db = new_db(ns)
    declare(ns.url, [ns.topology("catalog")])
    events = [new_event(article_id=f"a{i}") for i in range(50)]
    source = ns.workdir / "events.ndjson"
    source.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    assert ns.cli("replay", "--consumer", "catalog", "--db", str(db), str(source)).returncode == 0
    skewed = ns.env(LD_PRELOAD=str(FAKETIME[0]), FAKETIME=skew, DONT_FAKE_MONOTONIC="1")
    refused = ns.cli("inbox", "prune", "--db", str(db), "--older-than", "30d", env=skewed)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused:" in lines[0] and "clock" in lines[0] and "disagree" in lines[0], lines
    assert 50 == len(remaining(db, "inbox"))
    honest = prune(ns, "--older-than", "30d")
    assert honest.returncode == 0, honest.stderr
    again = ns.cli("replay", "--consumer", "catalog", "--db", str(db), str(source))
    assert again.returncode == 0, again.stderr
    answered = [line.split() for line in again.stdout.splitlines()]
    assert {e["eventId"] for e in events} == {w[0] for w in answered if w[1:] == ["duplicate:updated"]}, again.stdout


def test_prune_refuses_receipts_stamped_in_its_future(open_inbox: Any) -> None:
    """Receipts stamped 400 days ahead of the system's clock (the consumer's clock was ahead, or
    this one was set back), on either backend: prune refuses in one line naming the newest receipt;
    --trust-clock prunes what its own clock calls old."""
    db = open_inbox("catalog")
    for i in range(3):
        apply_event(db, envelope(event_id=str(uuid.uuid4()), article_id=f"a{i}", revision=1))
    db.conn.execute("UPDATE inbox SET received_at = ?", (ago(-400),))
    with pytest.raises(PruneRefused, match="in this clock's future") as refused:
        retention.prune(db, older_than_s=30 * DAY, keep_event_ids=set())
    assert "\n" not in str(refused.value)
    assert 3 == db.conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
    assert 0 == retention.prune(db, older_than_s=30 * DAY, keep_event_ids=set(), trust_clock=True).receipts


def test_prune_refuses_when_this_clock_and_the_system_s_disagree(open_inbox: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's clock 400 days ahead of the system's (SQLite: a new file's time; PostgreSQL: the
    database server's clock), receipts 40 days old by the true clock: prune refuses in one line and
    keeps them all, though by its own clock they are 440 days old."""
    db = open_inbox("catalog")
    add = "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)"
    db.conn.executemany(add, [(e, "f" * 64, "updated", "t", ago(40)) for e in ids(3)])
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 400 * DAY)
    with pytest.raises(PruneRefused, match="disagree by 400d") as refused:
        retention.prune(db, older_than_s=30 * DAY, keep_event_ids=set())
    said = str(refused.value)
    assert "\n" not in said and ("database server's" if open_inbox.kind == "postgres" else "new file's") in said
    assert 3 == db.conn.execute("SELECT count(*) FROM inbox").fetchone()[0]


def test_a_jump_of_the_writer_s_clock_stops_prune_from_aging_the_receipts_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The system clock jumps 400 days ahead under a writer (its wall clock against its monotonic
    one): the writer records the jump; a prune by the same (jumped) clock would call the receipts
    written a minute before it 400 days old -- it is refused in one line, and keeps them all."""
    db = consumers.open_db(tmp_path / "c.db", "catalog", create=True)
    before = [envelope(event_id=str(uuid.uuid4()), article_id=f"a{i}", revision=1) for i in range(20)]
    apply_batch(db, before)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 400 * DAY)
    db.count_due = 0.0  # the writer looks at its clock at its next catch-up
    apply_batch(db, [envelope(event_id=str(uuid.uuid4()), article_id="b", revision=1)])
    assert db.meta()["clock_jump"].split()[0] == "20"
    monkeypatch.setattr(dialect, "filesystem_now", lambda _directory: time.time())  # the whole system jumped
    with pytest.raises(PruneRefused, match="jumped 400d ahead") as refused:
        retention.prune(db, older_than_s=30 * DAY, keep_event_ids=set())
    assert "\n" not in str(refused.value)
    assert 21 == db.conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
    db.close()
