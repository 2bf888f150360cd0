"""The outbox in PostgreSQL across a server restart, on a private server of the session's own (the shared
one is never restarted): a dispatcher frozen mid-dispatch while the server restarts waits and goes on
without spending an attempt; and the ledger -- 3 writer processes committing and rolling back, 2
dispatchers, one SIGKILLed, a server restart -- every committed event applied exactly once downstream,
none of the rolled-back ones."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from brokerkit import Namespace, freeze_session, kill
from outboxkit import envelope
from pgkit import PrivatePostgres, admin, with_database
from support import read_rows, wait_until
from test_outbox_broker import queued_ids
from test_outbox_pg import pg_rows, produce, published, start_dispatch

pytestmark = pytest.mark.slow


@pytest.fixture
def private_url(private_pg: PrivatePostgres) -> Iterator[str]:
    """A database of this test's own on the private server."""
    name = f"dc_private_{secrets.token_hex(4)}"
    admin(private_pg.url, f'CREATE DATABASE "{name}"')
    try:
        yield with_database(private_pg.url, name)
    finally:
        admin(private_pg.url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_server_restart_while_dispatching_is_waited_out_without_spending_an_attempt(
    ns: Namespace, private_pg: PrivatePostgres, private_url: str,
) -> None:
    """The dispatcher is frozen with batches in flight, the server restarts under it, and it is thawed: its
    marks fail, are kept and made once the server is back; every row is published with one attempt, none
    failed, and the broker has each row."""
    ids = produce(private_url, [envelope(f"article-{i % 50}", i // 50 + 1) for i in range(6000)])
    proc = start_dispatch(ns, private_url, "--batch", "20", "--depth", "2", "--poll", "50ms",
                          "--exit-when-idle", "30s")

    def frozen_mid_dispatch() -> bool:
        freeze_session(proc.pid)
        done = published(private_url)
        assert done < len(ids), "everything was published before the restart"
        if done == 0:
            os.kill(proc.pid, signal.SIGCONT)
        return done > 0

    try:
        wait_until("the dispatcher frozen mid-dispatch", frozen_mid_dispatch, interval=0.01, procs=[proc])
        private_pg.restart()
        os.kill(proc.pid, signal.SIGCONT)
        done = proc.until_idle(240)
    finally:
        if proc.poll() is None:
            kill(proc)  # type: ignore[arg-type]
    assert 0 == done.returncode, done.stderr[-3000:]
    assert "retrying in" in done.stderr  # it saw the outage and waited
    assert [(len(ids), 1, 1, 0)] == pg_rows(
        private_url, "SELECT count(*), min(attempts), max(attempts), max(failures) FROM outbox"
                     " WHERE status = 'published'")
    copies = queued_ids(ns)
    assert set(ids) == set(copies)
    assert sum(copies.values()) - len(ids) <= 2 * 20


WRITER = r"""
import random, sys, time, uuid
import psycopg
from delivery_consumer import outbox

url, count, seed, rolled_back_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(seed)
conn = None
written = 0
with open(rolled_back_file, "a") as rolled_back:
    while written < count:
        event = {"eventId": str(uuid.uuid4()), "type": "material.published", "articleId": f"w{seed}-{written % 7}",
                 "revision": written + 1, "occurredAt": "2026-12-01T10:00:00Z",
                 "data": {"title": f"t{written}", "url": f"https://example.org/{written}"}}
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(url, autocommit=True, connect_timeout=5)
            undo = rng.random() < 0.3
            try:
                with conn.transaction():
                    conn.execute("INSERT INTO ledger (event_id) VALUES (%s)", (event["eventId"],))
                    outbox.enqueue(conn, event)
                    if undo:
                        rolled_back.write(event["eventId"] + "\n")
                        rolled_back.flush()
                        raise LookupError("the application rolls back")
            except LookupError:
                pass
            written += 1
        except (psycopg.OperationalError, Exception) as exc:  # the server restarts: the fate is in the database
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.05)
"""


def test_ledger_writers_dispatchers_kills_and_a_restart(
    ns: Namespace, private_pg: PrivatePostgres, private_url: str, tmp_path: Path,
) -> None:
    """3 writer processes commit and roll back (30%) application rows with their events, 2 dispatchers
    publish, one is SIGKILLed and the server restarts meanwhile; afterwards every committed event (the
    ledger table is the truth) is applied exactly once by the consumer, no rolled-back one at all."""
    with psycopg.connect(private_url, autocommit=True) as conn:
        from delivery_consumer import outbox

        outbox.install(conn)
        conn.execute("CREATE TABLE ledger (event_id text PRIMARY KEY)")
    rolled_back = tmp_path / "rolled-back.txt"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, private_url, "400", str(i), str(rolled_back)],
                                env=ns.env(), start_new_session=True) for i in range(3)]
    victim = start_dispatch(ns, private_url, "--batch", "20", "--poll", "50ms", "--lease", "10m")
    survivor = start_dispatch(ns, private_url, "--batch", "20", "--poll", "50ms")
    try:
        wait_until("some rows published", lambda: published(private_url) > 50, procs=[victim, survivor])
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        private_pg.restart()
        for writer in writers:
            assert 0 == writer.wait(timeout=240)
        committed = {r[0] for r in pg_rows(private_url, "SELECT event_id FROM ledger")}
        wait_until("every committed row published", lambda: published(private_url) == len(committed),
                   timeout=240, procs=[survivor])
        survivor.send_signal(signal.SIGTERM)
        assert 0 == survivor.wait(timeout=60)
    finally:
        for proc in (*writers, victim, survivor):
            if proc.poll() is None:
                kill(proc)  # type: ignore[arg-type]
    undone = set(rolled_back.read_text().split())
    assert undone and not undone & committed
    outboxed = {r[0] for r in pg_rows(private_url, "SELECT event_id FROM outbox")}
    assert committed == outboxed
    assert committed == set(queued_ids(ns))
    run = ns.run_until_idle("catalog", idle=1.5, timeout=240)
    assert 0 == run.returncode, run.stderr[-2000:]
    receipts = [r[0] for r in read_rows(ns.db("catalog"), "inbox", "event_id")]
    assert sorted(committed) == sorted(receipts)
