"""The producer side under faults, without a broker: quarantine, order per
article during retries, dead owners, exit when idle, misuse of the API and
the upgrade of an existing producer database.

The publisher is :class:`outboxkit.FakePublisher` (verdicts scripted per
eventId) and the clock is the test's, so every decision is checked exactly.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pika.data
import pika.exceptions
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outboxkit import Clock, FakePublisher, add, dispatcher, envelope, row, twin
from support import wait_until

from delivery_consumer import outbox
from delivery_consumer.cli import main
from delivery_consumer.model.errors import DatabaseError, TransientError
from delivery_consumer.outbox import demo_producer as producer
from delivery_consumer.outbox import owners
from delivery_consumer.store import liveness
from delivery_consumer.store.sqlite import now_iso


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A producer database with the outbox and a material table."""
    c = outbox.connect(tmp_path / "producer.db")
    c.execute("CREATE TABLE material (name TEXT NOT NULL) STRICT")
    yield c
    c.close()


def raw_row(conn: sqlite3.Connection, routing_key: str, article: str = "a") -> str:
    """A row written without enqueue's checks (by older code, or by hand)."""
    env = envelope(article)
    body = orjson.dumps(env)
    conn.execute("INSERT INTO outbox (event_id, routing_key, ordering_key, body, fingerprint, created_at)"
                 " VALUES (?, ?, ?, ?, 'x', ?)", (env["eventId"], routing_key, article, body, now_iso()))
    return str(env["eventId"])


# -- misuse of the API ------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "why"), [
    ("k" * 256, "256 bytes"),
    ("é" * 128, "256 bytes"),  # 128 characters, but two bytes each in UTF-8
    ("a\x00b", "control character"),
    ("line\nbreak", "control character"),
    ("\ud800", "not valid UTF-8"),
])
def test_enqueue_refuses_a_routing_key_amqp_cannot_carry(conn: sqlite3.Connection, key: str, why: str) -> None:
    """A routing key over 255 UTF-8 bytes or with a control character is refused with OutboxError, nothing is
    written, and the caller's transaction goes on."""
    with outbox.transaction(conn):
        conn.execute("INSERT INTO material VALUES ('kept')")
        with pytest.raises(outbox.OutboxError, match=why):
            outbox.enqueue(conn, envelope(), routing_key=key)
        assert outbox.enqueue(conn, envelope(), routing_key="k" * 255)
    assert [("kept",)] == conn.execute("SELECT name FROM material").fetchall()
    assert [("k" * 255,)] == conn.execute("SELECT routing_key FROM outbox").fetchall()


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_routing_key_check_agrees_with_pikas_encoder(key: str) -> None:
    """Every key the check accepts, pika encodes (and decodes back unchanged); every key pika cannot encode,
    the check refuses."""
    problem = outbox.routing_key_problem(key)
    pieces: list[bytes] = []
    try:
        pika.data.encode_short_string(pieces, key)
    except (pika.exceptions.ShortStringTooLong, UnicodeError):
        assert problem is not None
        return
    if problem is None:
        decoded, _ = pika.data.decode_short_string(b"".join(pieces), 0)
        assert key == decoded


def test_misuse_gives_one_clear_sentence(tmp_path: Path, conn: sqlite3.Connection) -> None:
    """enqueue on a database without the outbox, or of something that is not an envelope, raises OutboxError."""
    bare = sqlite3.connect(tmp_path / "bare.db", isolation_level=None)
    bare.execute("BEGIN IMMEDIATE")
    with pytest.raises(outbox.OutboxError, match="outbox is not installed in this database"):
        outbox.enqueue(bare, envelope())
    bare.execute("ROLLBACK")
    bare.close()
    with outbox.transaction(conn):
        for thing in ([1, 2], 42, None, "{}"):
            with pytest.raises(outbox.OutboxError, match="enqueue takes an Envelope, a dict or JSON bytes"):
                outbox.enqueue(conn, thing)  # type: ignore[arg-type]
    assert 0 == outbox.unpublished(conn)


def test_a_nested_transaction_is_refused_and_the_outer_one_is_left_as_it_was(conn: sqlite3.Connection) -> None:
    """outbox.transaction inside an open transaction raises OutboxError without rolling the outer one back: the
    caller who goes on commits its change and its event together; one who lets it propagate commits neither."""
    with outbox.transaction(conn):
        conn.execute("INSERT INTO material VALUES ('both')")
        with pytest.raises(outbox.OutboxError, match="cannot be nested"), outbox.transaction(conn):
            pass
        assert conn.in_transaction
        both = envelope("both")
        outbox.enqueue(conn, both)
    with pytest.raises(outbox.OutboxError), outbox.transaction(conn):
        conn.execute("INSERT INTO material VALUES ('neither')")
        with outbox.transaction(conn):
            outbox.enqueue(conn, envelope("neither"))
    assert [("both",)] == conn.execute("SELECT name FROM material").fetchall()
    assert [both["eventId"]] == [r[0] for r in conn.execute("SELECT event_id FROM outbox")]


def test_produce_inside_the_callers_transaction_is_refused_and_leaves_it_open(tmp_path: Path) -> None:
    """producer.produce (its own outbox.transaction) inside a caller's raw BEGIN raises and keeps the caller's
    transaction and its writes."""
    conn = producer.open_db(tmp_path / "p.db")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO material VALUES ('x', 1, 't', 'u', 1, 'e', 'now')")
    with pytest.raises(outbox.OutboxError, match="nested"):
        producer.produce(conn, "a", title="T", url="u")
    assert conn.in_transaction
    conn.execute("COMMIT")
    assert [("x",)] == conn.execute("SELECT article_id FROM material").fetchall()
    conn.close()


def test_a_transaction_that_cannot_begin_rolls_back_nothing(tmp_path: Path) -> None:
    """When BEGIN IMMEDIATE fails (the write lock held past busy_timeout) the error is transient and nothing else
    happens."""
    path = tmp_path / "p.db"
    holder, mine = outbox.connect(path), outbox.connect(path, busy_timeout_ms=20)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(TransientError), outbox.transaction(mine):
        pass
    assert not mine.in_transaction and holder.in_transaction
    holder.execute("ROLLBACK")
    holder.close()
    mine.close()


# -- quarantine ---------------------------------------------------------------------------------


def test_permanent_failures_are_quarantined_at_once(conn: sqlite3.Connection) -> None:
    """Returned (unroutable) and unencodable rows are quarantined on their first attempt with their reason; the
    other rows are published."""
    ids = add(conn, *(envelope(f"a{i}") for i in range(5)))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = {ids[1]: "returned", ids[3]: "unencodable"}
    d = dispatcher(conn, pub, clock)
    assert 5 == d.step()
    assert 2 == d.stats.quarantined
    got = {i: row(conn, i) for i in ids}
    assert ["published", "quarantined", "published", "quarantined", "published"] == [got[i]["state"] for i in ids]
    assert "returned: unroutable: 312 NO_ROUTE" == got[ids[1]]["quarantineReason"]
    assert got[ids[3]]["quarantineReason"].startswith("unencodable")
    assert (1, 1, now_iso(clock.now)) == (got[ids[1]]["attempts"], got[ids[1]]["failures"],
                                          got[ids[1]]["quarantinedAt"])
    assert 0 == d.step()  # quarantined rows left the stream
    assert Counter(quarantined=2) == outbox.waiting(conn, now=clock.now)


def test_a_nacked_row_is_quarantined_after_max_attempts_with_growing_backoff(conn: sqlite3.Connection) -> None:
    """Nacks of the row's own (its destination confirms the rows behind it) back off (growing) and quarantine the
    row at max_attempts, saying so."""
    event_id = add(conn, envelope())[0]
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[event_id] = "nacked"
    d = dispatcher(conn, pub, clock, retry_base_s=1, retry_cap_s=100, max_attempts=4)
    waits = []
    for n in range(3):
        add(conn, envelope(twin("article-1"), n + 1))
        assert 2 == d.step()
        assert "retrying" == row(conn, event_id)["state"]
        waits.append(datetime.fromisoformat(row(conn, event_id)["nextAttemptAt"]).timestamp() - clock.now)
        clock.now += 10
    assert waits == sorted(waits) and 0.5 <= waits[0] <= 1 and 2 <= waits[2] <= 4
    add(conn, envelope(twin("article-1"), 4))
    assert 2 == d.step()
    r = row(conn, event_id)
    assert ("quarantined", 4, 4) == (r["state"], r["attempts"], r["failures"])
    assert "(failed 4 times, max-attempts 4)" in r["quarantineReason"]
    assert 1 == d.stats.quarantined


def test_a_broker_outage_never_counts_toward_quarantine(conn: sqlite3.Connection) -> None:
    """Unconfirmed rows (connection lost) go again without a failure, whatever max_attempts says."""
    event_id = add(conn, envelope())[0]
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[event_id] = "unconfirmed"
    d = dispatcher(conn, pub, clock, max_attempts=1)
    for _ in range(5):
        d.step()
    r = row(conn, event_id)
    assert ("pending", 5, 0) == (r["status"], r["attempts"], r["failures"])


def test_a_row_written_with_a_bad_key_is_quarantined_at_claim_and_does_not_hold_its_article(
    conn: sqlite3.Connection,
) -> None:
    """A row whose routing key AMQP cannot carry (written before enqueue checked it) is quarantined when claimed,
    never sent; the rows around it, of its article too, are published."""
    with outbox.transaction(conn):
        before = add_in(conn, envelope("a", 1))
        bad = raw_row(conn, "x" * 300, "a")
        nul = raw_row(conn, "a\x00b", "b")
        after = add_in(conn, envelope("a", 2))
    pub, clock = FakePublisher(), Clock()
    d = dispatcher(conn, pub, clock)
    d.step()
    assert [before, after] == [m.message_id for m in pub.sent]
    assert 2 == d.stats.quarantined
    assert row(conn, bad)["quarantineReason"].startswith("invalid: routing key is 300 bytes")
    assert "control character" in row(conn, nul)["quarantineReason"]
    assert (0, "quarantined") == (row(conn, bad)["attempts"], row(conn, bad)["status"])


def add_in(conn: sqlite3.Connection, env: dict[str, Any]) -> str:
    outbox.enqueue(conn, env)
    return str(env["eventId"])


# -- order per article ------------------------------------------------------------------------------


def test_later_rows_wait_for_a_retry_and_go_on_once_it_is_quarantined(conn: sqlite3.Connection) -> None:
    """While a1 is retried (its own nacks: its destination confirms a twin key's rows behind it), a2 and a3 wait
    (held behind it) and other articles go on; once a1 is quarantined they are published, and show(a1) names
    them as having gone past it."""
    a1, b1 = add(conn, envelope("a", 1), envelope(twin("a"), 1))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[a1] = "nacked"
    d = dispatcher(conn, pub, clock, retry_base_s=1, retry_cap_s=1, max_attempts=3)
    d.step()
    a2, a3, b2 = add(conn, envelope("a", 2), envelope("a", 3), envelope(twin("a"), 2))
    pub.sent.clear()
    d.step()
    assert [b2] == [m.message_id for m in pub.sent]
    listed = {r["eventId"]: r for r in outbox.list_rows(conn, state="pending", now=clock.now)}
    assert "retrying" == listed[a1]["state"]
    assert (f"held behind {a1}", f"held behind {a1}") == (listed[a2]["detail"], listed[a3]["detail"])
    assert [a2, a3] == [r["eventId"] for r in outbox.list_rows(conn, state="held", now=clock.now)]
    for n in range(2):  # two more failed attempts, each alone for its article
        twin_row = add(conn, envelope(twin("a"), 3 + n))[0]
        clock.now += 1.01
        pub.sent.clear()
        d.step()
        assert [a1, twin_row] == [m.message_id for m in pub.sent]
    assert "quarantined" == row(conn, a1)["state"]
    assert [] == row(conn, a1)["passedBy"]
    pub.sent.clear()
    d.step()
    assert [a2, a3] == [m.message_id for m in pub.sent]
    assert [a2, a3] == row(conn, a1)["passedBy"]
    assert [] == row(conn, b1)["passedBy"]


def test_a_requeued_row_goes_alone_and_its_article_waits_for_it(conn: sqlite3.Connection) -> None:
    """After requeue a quarantined row is sent on its own; a later row of its article follows only once it is
    confirmed."""
    a1 = add(conn, envelope("a", 1))[0]
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[a1] = "returned"
    d = dispatcher(conn, pub, clock)
    d.step()
    a2 = add(conn, envelope("a", 2))[0]
    del pub.verdicts[a1]
    assert "requeued" == outbox.requeue(conn, [a1], by="ops", now=clock.now)[0]["outcome"]
    pub.log.clear()
    d.step()
    d.step()
    assert [("send", [a1]), ("collect", [a1]), ("send", [a2]), ("collect", [a2])] == pub.log


VERDICTS = st.sampled_from(["ok", "ok", "nacked", "returned", "unconfirmed"])


@given(st.lists(st.tuples(st.integers(0, 3), st.lists(VERDICTS, max_size=4)), min_size=1, max_size=30),
       st.integers(1, 4), st.integers(1, 2))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_order_per_article_under_random_failures(tmp_path: Path, plan: list[tuple[int, list[str]]], batch: int,
                                                 depth: int) -> None:
    """Whatever fails when (nacks, returns, lost connections, in any sequence per row): no row is sent while an
    earlier row of its article has failed and is neither published nor quarantined; in the end every row is
    published or quarantined."""
    conn = outbox.connect(tmp_path / f"{os.urandom(6).hex()}.db")
    try:
        ids = add(conn, *(envelope(f"a{article}", i + 1) for i, (article, _) in enumerate(plan)))
        article = {event_id: plan[i][0] for i, event_id in enumerate(ids)}
        seq = {event_id: i for i, event_id in enumerate(ids)}
        fates = {event_id: iter([*plan[i][1], *["ok"] * 10]) for i, event_id in enumerate(ids)}
        in_retry: set[str] = set()

        class Scripted(FakePublisher):
            def send(self, messages: Any) -> Any:
                for m in messages:
                    earlier = [e for e in in_retry if article[e] == article[m.message_id]
                               and seq[e] < seq[m.message_id]]
                    assert not earlier, f"{m.message_id} sent while {earlier} is in retry"
                self.verdicts = {m.message_id: v for m in messages if (v := next(fates[m.message_id])) != "ok"}
                return super().send(messages)

        pub, clock = Scripted(), Clock()
        d = dispatcher(conn, pub, clock, batch=batch, depth=depth, retry_base_s=1, retry_cap_s=1, max_attempts=2)
        for _ in range(300):
            d.step()
            states = {r["eventId"]: r["state"] for r in outbox.list_rows(conn, limit=0, now=clock.now)}
            in_retry = {e for e, s in states.items() if s not in ("published", "quarantined") and
                        row(conn, e)["nextAttemptAt"] is not None}  # nacked (its own, or in an outage)
            if all(s in ("published", "quarantined") for s in states.values()):
                break
            clock.now += 1.01
        assert all(s in ("published", "quarantined") for s in states.values()), states
    finally:
        conn.close()


# -- requeue and drop -------------------------------------------------------------------------------


def test_requeue_and_drop_record_who_and_when(conn: sqlite3.Connection) -> None:
    """requeue puts quarantined rows back (dry-run changes nothing); drop keeps them out with who, when and why;
    rows in other states and unknown eventIds are reported, not touched."""
    ids = add(conn, envelope("a"), envelope("b"), envelope("c"))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = {ids[0]: "returned", ids[1]: "returned"}
    dispatcher(conn, pub, clock).step()
    dry = outbox.requeue(conn, [ids[0]], by="ann", dry_run=True, now=clock.now)
    assert [{"eventId": ids[0], "outcome": "would-be-requeued", "status": "quarantined"}] == dry
    assert "quarantined" == row(conn, ids[0])["status"]
    done = outbox.requeue(conn, [ids[0], ids[2], "nope"], by="ann", now=clock.now)
    assert ["requeued", "not-quarantined", "not-found"] == [r["outcome"] for r in done]
    r = row(conn, ids[0])
    assert ("pending", 0, "ann", now_iso(clock.now)) == (r["status"], r["failures"], r["requeuedBy"],
                                                          r["requeuedAt"])
    assert r["quarantineReason"]  # the last quarantine stays as history
    dropped = outbox.drop(conn, [ids[1], ids[0]], by="bob", reason="article deleted", now=clock.now)
    assert ["dropped", "not-quarantined"] == [r["outcome"] for r in dropped]
    r = row(conn, ids[1])
    assert ("dropped", "bob", "article deleted") == (r["state"], r["droppedBy"], r["dropReason"])
    assert f"dropped by bob at {now_iso(clock.now)}: article deleted" == r["detail"]
    assert Counter({"pending": 1}) == outbox.waiting(conn, now=clock.now)
    assert 2 == outbox.prune(conn, older_than_s=0, now=clock.now + 1)  # the published and the dropped row
    assert [ids[0]] == [r["eventId"] for r in outbox.list_rows(conn)]


def test_cli_requeue_drop_list_and_show(tmp_path: Path) -> None:
    """outbox requeue/drop through the CLI: --dry-run, --all, --by (default the OS user), exit 1 for an eventId
    it could not act on; list shows the quarantine reason, show what went past."""
    db = tmp_path / "p.db"
    conn = outbox.connect(db)
    ids = add(conn, envelope("a", 1), envelope("a", 2), envelope("b", 1))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = {ids[0]: "returned", ids[2]: "returned"}
    dispatcher(conn, pub, clock).step()
    conn.close()
    runner = CliRunner()

    def cli(*args: str) -> Any:
        return runner.invoke(main, [*args[:2], "--db", str(db), *args[2:]])

    listed = cli("outbox", "list", "--state", "quarantined")
    assert 0 == listed.exit_code and "returned: unroutable: 312 NO_ROUTE" in listed.output
    shown = orjson.loads(cli("outbox", "show", ids[0], "--json").output)
    assert [ids[1]] == shown["passedBy"]
    assert "passedBy: 1 later rows" in cli("outbox", "show", ids[0]).output
    dry = cli("outbox", "requeue", "--all", "--dry-run", "--json")
    assert ["would-be-requeued"] * 2 == [r["outcome"] for r in orjson.loads(dry.output)]
    assert 1 == cli("outbox", "requeue", ids[1]).exit_code  # published: nothing to requeue
    assert 2 == cli("outbox", "requeue").exit_code  # neither ids nor --all
    assert 0 == cli("outbox", "drop", ids[2], "--reason", "test data").exit_code
    assert 0 == cli("outbox", "requeue", ids[0], "--by", "carol").exit_code
    with closing(outbox.connect(db, readonly=True)) as ro:
        assert ("pending", "carol") == (row(ro, ids[0])["status"], row(ro, ids[0])["requeuedBy"])
        assert row(ro, ids[2])["droppedBy"]  # the OS user
    stats = orjson.loads(cli("outbox", "stats", "--json").output)
    assert (1, 0, 1) == (stats["pending"], stats["quarantined"], stats["dropped"])


def test_cli_requeue_of_unknown_ids_names_them_in_one_line(tmp_path: Path) -> None:
    """Typed ids that do not exist (a typo, a paste of the wrong column): exit 1, one line naming
    up to three of them and how many more; the table says what each row *was*."""
    db = tmp_path / "p.db"
    conn = outbox.connect(db)
    (published,) = add(conn, envelope("a", 1))
    conn.close()
    result = CliRunner().invoke(main, ["outbox", "requeue", "--db", str(db), published, "x1", "x2", "x3", "x4"])
    assert 1 == result.exit_code
    assert ["delivery-consumer: 5 of 5 rows not acted on (" + f"{published}: not-quarantined, x1: not-found, "
            "x2: not-found, and 2 more)"] == [line for line in result.stderr.splitlines() if line.strip()]
    assert re.search(r"eventId\s+outcome\s+was\n", result.stdout) and "pending" in result.stdout


# -- dead owners --------------------------------------------------------------------------------------


def lease_to(conn: sqlite3.Connection, owner: str, until: float) -> None:
    conn.execute("UPDATE outbox SET lease_owner = ?, lease_until = ?", (owner, now_iso(until)))


def registered(conn: sqlite3.Connection, owner: str, *, host: str | None = None, pid: int = 1,
               proc_start: str | None = None, beat_at: float | None = None, boot: str | None = "same") -> None:
    me = owners.Identity.mine("me")
    conn.execute("INSERT INTO outbox_owners VALUES (?, ?, ?, ?, ?, 2.0, ?, ?)",
                 (owner, host or me.host, me.boot_id if boot == "same" else boot, pid, proc_start,
                  now_iso(), now_iso(beat_at)))


def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_leases_of_a_dead_process_on_this_host_are_taken_back_at_once(conn: sqlite3.Connection) -> None:
    """A lease whose owner ran on this host and whose pid is gone is claimed at once, with the reason recorded;
    the dead owner leaves the table."""
    event_id = add(conn, envelope())[0]
    clock = Clock()
    registered(conn, "dead", pid=gone_pid(), beat_at=clock.now)
    lease_to(conn, "dead", clock.now + 3600)
    assert "leased by dead until" in outbox.list_rows(conn, now=clock.now)[0]["detail"]
    d = dispatcher(conn, FakePublisher(), clock)
    assert 1 == d.step()
    r = row(conn, event_id)
    assert r["publishedAt"] is not None
    assert "lease of dead taken back: its process" in r["lastError"]
    assert [] == conn.execute("SELECT owner FROM outbox_owners").fetchall()


def test_a_live_owner_keeps_its_lease_and_a_reused_pid_does_not_count(conn: sqlite3.Connection) -> None:
    """A registered owner whose pid runs with the same start time keeps its lease; the same pid with another
    start time (reused) is dead."""
    add(conn, envelope())
    clock = Clock()
    mine = owners.proc_start(os.getpid())
    registered(conn, "alive", pid=os.getpid(), proc_start=mine, beat_at=clock.now)
    lease_to(conn, "alive", clock.now + 3600)
    d = dispatcher(conn, FakePublisher(), clock)
    assert 0 == d.step()
    conn.execute("UPDATE outbox_owners SET proc_start = '1'")
    clock.now += 1.5  # the next reap
    assert 1 == d.step()


def test_a_running_owner_here_keeps_its_lease_without_heartbeat_a_stopped_one_loses_it(
    conn: sqlite3.Connection,
) -> None:
    """On this host a running owner is alive even with a stale heartbeat (its writes may be starved by a long
    transaction); once SIGSTOPped, the stale heartbeat makes it dead."""
    add(conn, envelope())
    clock = Clock()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        registered(conn, "sleepy", pid=owner.pid, proc_start=owners.proc_start(owner.pid), beat_at=clock.now - 60)
        lease_to(conn, "sleepy", clock.now + 3600)
        d = dispatcher(conn, FakePublisher(), clock)
        assert 0 == d.step()
        os.kill(owner.pid, signal.SIGSTOP)
        wait_until("the owner's state to show the stop",  # the stop is asynchronous
                   lambda: (liveness.proc_stat(owner.pid) or ("?",))[0] in ("T", "t"))
        clock.now += 1.5
        assert 1 == d.step()
        assert "no heartbeat for" in conn.execute("SELECT last_error FROM outbox").fetchone()[0]
    finally:
        owner.kill()
        owner.wait()


def test_a_pid_in_another_pid_namespace_is_never_checked_here(conn: sqlite3.Connection) -> None:
    """An owner on this host name and boot but in another pid namespace (another container) is judged by its
    heartbeat only, however dead its pid looks here; one registered in an earlier boot is dead."""
    add(conn, envelope())
    clock = Clock()
    me = owners.Identity.mine("me")
    assert me.boot_id is not None
    registered(conn, "container", pid=gone_pid(), beat_at=clock.now, boot=me.boot_id.split()[0] + " pid:[1]")
    lease_to(conn, "container", clock.now + 3600)
    d = dispatcher(conn, FakePublisher(), clock)
    assert 0 == d.step()
    conn.execute("UPDATE outbox_owners SET boot_id = 'earlier-boot pid:[1]'")
    clock.now += 1.5
    assert 1 == d.step()
    assert "was restarted" in conn.execute("SELECT last_error FROM outbox").fetchone()[0]


def test_an_owner_whose_heartbeat_stopped_is_dead_on_any_host(conn: sqlite3.Connection) -> None:
    """On another host only the heartbeat tells: fresh keeps the lease, older than 5 beats loses it."""
    add(conn, envelope())
    clock = Clock()
    registered(conn, "far", host="elsewhere.example", beat_at=clock.now)
    lease_to(conn, "far", clock.now + 3600)
    d = dispatcher(conn, FakePublisher(), clock)
    assert 0 == d.step()
    clock.now += 9  # 4.5 beats of 2 s
    assert 0 == d.step()
    clock.now += 2
    assert 1 == d.step()
    assert "no heartbeat for 11s" in conn.execute("SELECT last_error FROM outbox").fetchone()[0]


def test_run_registers_with_a_heartbeat_and_leaves_cleanly(conn: sqlite3.Connection) -> None:
    """While run() works its owner row exists with this pid; afterwards the row is gone and no lease is held."""
    add(conn, envelope())
    seen: list[tuple[Any, ...]] = []

    class Watching(FakePublisher):
        def idle(self, seconds: float, wake: int | None = None) -> None:
            seen.extend(conn.execute("SELECT owner, pid, host FROM outbox_owners").fetchall())
            super().idle(seconds)

    clock = Clock()
    d = dispatcher(conn, Watching(), clock, exit_when_idle_s=1, poll_s=0.5)
    d.run()
    assert seen and {(d.config.owner, os.getpid(), socket.gethostname())} == set(seen)
    assert [] == conn.execute("SELECT * FROM outbox_owners").fetchall()
    assert [(None,)] == conn.execute("SELECT lease_owner FROM outbox").fetchall()


# -- exit when idle ---------------------------------------------------------------------------------------


def test_exit_when_idle_counts_only_progress(conn: sqlite3.Connection) -> None:
    """A row that keeps failing is not progress: run() returns after the idle time, the row still waiting (on
    the outage its nacks are: probed again and again, due at once)."""
    event_id = add(conn, envelope())[0]
    pub, clock = FakePublisher(), Clock()
    pub.verdicts[event_id] = "nacked"
    d = dispatcher(conn, pub, clock, exit_when_idle_s=5, poll_s=0.1, max_attempts=1000)
    started = clock.now
    stats = d.run()
    assert 5 <= clock.now - started < 6
    assert stats.results["nacked"] >= 3 and 0 == stats.progress
    assert (1, True) == (stats.outages, stats.in_outage)
    assert Counter(pending=1) == outbox.waiting(conn, now=clock.now)


def test_exit_when_idle_with_the_broker_down_says_it_never_connected(conn: sqlite3.Connection) -> None:
    """With the broker unreachable, run() returns after the idle time (the outage backoff is cut to it), not
    connected, the row untouched."""
    add(conn, envelope())
    pub, clock = FakePublisher(), Clock()
    pub.down = 1000
    started = clock.now
    stats = dispatcher(conn, pub, clock, exit_when_idle_s=2).run()
    assert (False, 0) == (stats.connected, stats.progress)
    assert 2 <= clock.now - started < 2.5
    assert "broker unreachable" in stats.last_outage
    assert Counter(pending=1) == outbox.waiting(conn, now=clock.now)
    assert "1 row left: 1 due now" == outbox.describe_waiting(outbox.waiting(conn, now=clock.now))


def test_dispatch_exits_2_when_the_broker_cannot_be_reached(tmp_path: Path) -> None:
    """The command with --exit-when-idle and nothing listening: one line, exit 2, the rows waiting."""
    db = tmp_path / "p.db"
    conn = outbox.connect(db)
    add(conn, envelope())
    conn.close()
    done = subprocess.run([sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(db), "--amqp-url",
                           "amqp://guest:guest@127.0.0.1:1/%2F", "--exit-when-idle", "1s"],
                          capture_output=True, text=True, timeout=60)
    assert 2 == done.returncode, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("delivery-consumer: the broker could not be reached in 1s")
    assert "1 row left: 1 due now" in last
    assert "Traceback" not in done.stderr


# -- an existing producer database --------------------------------------------------------------------------


def test_a_version_1_database_is_upgraded_and_keeps_its_rows(tmp_path: Path) -> None:
    """A database written by the first schema keeps every row: published ones become status published, the
    others pending; read-only commands ask for the upgrade first; dispatch publishes the rest."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path, isolation_level=None)
    old.execute("PRAGMA journal_mode = WAL")
    for statement in outbox.MIGRATIONS[0].split(";"):
        if statement.strip():
            old.execute(statement)
    old.execute("INSERT INTO outbox_meta VALUES ('version', '1')")
    ids = []
    for i in range(3):
        env = envelope(f"a{i}")
        old.execute("INSERT INTO outbox (event_id, routing_key, ordering_key, body, fingerprint, created_at,"
                    " published_at) VALUES (?, 'material.published', ?, ?, 'f', ?, ?)",
                    (env["eventId"], env["articleId"], orjson.dumps(env), now_iso(), now_iso() if i == 0 else None))
        ids.append(env["eventId"])
    old.close()
    with pytest.raises(DatabaseError, match="older"):
        outbox.connect(path, readonly=True)
    conn = outbox.connect(path)
    assert outbox.VERSION == outbox.installed_version(conn)
    assert ["published", "pending", "pending"] == [row(conn, i)["status"] for i in ids]
    pub, clock = FakePublisher(), Clock()
    assert 2 == dispatcher(conn, pub, clock).step()
    assert ids[1:] == [m.message_id for m in pub.sent]
    assert 0 == outbox.unpublished(conn)
    conn.close()


MISUSE = """
import sys
import time
from delivery_consumer import outbox
from delivery_consumer.outbox import demo_producer
conn = demo_producer.open_db(sys.argv[1])
with outbox.transaction(conn):
    conn.execute("INSERT INTO material VALUES ('a', 1, 't', 'u', 1, ?, 'now')", (sys.argv[2],))
    try:
        with outbox.transaction(conn):  # the misuse: refused, the outer transaction goes on
            pass
    except outbox.OutboxError as exc:
        print("refused:", exc, flush=True)
    outbox.enqueue(conn, {"eventId": sys.argv[2], "type": "material.published", "articleId": "a", "revision": 1,
                          "occurredAt": "2026-11-29T10:00:00Z", "data": {"title": "t", "url": "u"}})
    print("written", flush=True)
    if sys.stdin.readline().strip() != "commit":
        raise SystemExit("told not to commit")
print("committed", flush=True)
"""


@pytest.mark.parametrize("end", ["commit", "sigkill", "abort"])
def test_nested_transaction_misuse_in_a_real_process_keeps_change_and_event_together(tmp_path: Path,
                                                                                      end: str) -> None:
    """A producer process that misuses outbox.transaction, then commits, is SIGKILLed or gives up: its material
    row and its event are both committed or both absent."""
    db, event_id = tmp_path / "p.db", "0b7f3b1e-0000-4000-8000-000000000001"
    proc = subprocess.Popen([sys.executable, "-c", MISUSE, str(db), event_id], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("refused: outbox.transaction cannot be nested")
        assert "written\n" == proc.stdout.readline()
        if end == "sigkill":
            os.kill(proc.pid, 9)
        else:
            proc.stdin.write(f"{end}\n")
            proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    with closing(sqlite3.connect(db)) as conn:
        material = conn.execute("SELECT count(*) FROM material").fetchone()[0]
        events = conn.execute("SELECT count(*) FROM outbox WHERE event_id = ?", (event_id,)).fetchone()[0]
    expected = (1, 1) if end == "commit" else (0, 0)
    assert expected == (material, events)


# -- metrics ----------------------------------------------------------------------------------------------


def test_metrics_count_rows_by_state_and_this_dispatchers_results(conn: sqlite3.Connection, tmp_path: Path) -> None:
    """The collector reads rows by state from the database (quarantined included) and this process's counters."""
    from prometheus_client import generate_latest

    from delivery_consumer.outbox import metrics

    ids = add(conn, envelope("a"), envelope("b"), envelope("c"))
    pub, clock = FakePublisher(), Clock()
    pub.verdicts = {ids[0]: "returned", ids[1]: "nacked"}
    d = dispatcher(conn, pub, clock)
    d.step()
    text = generate_latest(metrics.registry(tmp_path / "producer.db", d.stats)).decode()
    for line in ('outbox_rows{state="quarantined"} 1.0', 'outbox_rows{state="published"} 1.0',
                 'outbox_rows{state="due"} 1.0', 'outbox_rows{state="retrying"} 0.0',
                 'outbox_dispatch_results_total{result="nacked"} 1.0', "outbox_dispatch_quarantined_total 1.0",
                 "outbox_dispatch_outages_total 1.0", "outbox_dispatch_outage 1.0"):
        assert line in text


def test_dispatch_serves_metrics_while_it_waits_for_the_broker(tmp_path: Path) -> None:
    """dispatch --metrics-port answers /metrics with the quarantined rows while the broker is unreachable."""
    import urllib.request

    db = tmp_path / "p.db"
    conn = outbox.connect(db)
    ids = add(conn, envelope("a"), envelope("b"))
    pub = FakePublisher()
    pub.verdicts = {ids[0]: "returned"}
    dispatcher(conn, pub, Clock()).step()
    conn.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(db), "--amqp-url",
                             "amqp://guest:guest@127.0.0.1:1/%2F", "--exit-when-idle", "30s", "--metrics-port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            return str(answer.read().decode())

    try:
        text = wait_until("dispatch's /metrics", scrape, procs=[proc], ignoring=(OSError,))
        assert 'outbox_rows{state="quarantined"} 1.0' in text
        assert 'outbox_rows{state="published"} 1.0' in text
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
