"""The outbox in PostgreSQL with the real server, broker and processes: the documented producers (psycopg and
SQLAlchemy) end to end, wake-ups by LISTEN/NOTIFY, and the faults -- a dispatcher SIGKILLed mid-batch, its
connections terminated, a statement timeout, a read-only database, bad credentials."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from brokerkit import Namespace, RunProcess, kill
from outboxkit import envelope
from pgkit import admin, with_database
from support import read_rows, wait_until
from test_outbox_broker import queued_ids

from delivery_consumer import outbox
from delivery_consumer.console.server import Console
from delivery_consumer.ops import deployment as config_lib

REPO = Path(__file__).resolve().parents[2]


def readme_block(marker: str) -> str:
    """The python block of the producer's page (docs/outbox.md) whose first line is *marker*."""
    text = (REPO / "docs" / "outbox.md").read_text("utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [b for b in blocks if b.startswith(marker)]
    assert 1 == len(found), f"docs/outbox.md has no python block starting with {marker!r}"
    return found[0]


def run_python(code: str, url: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DATABASE_URL": url})
    assert 0 == done.returncode, done.stderr


def produce(url: str, envs: list[dict[str, Any]]) -> list[str]:
    """Enqueue *envs* in one transaction of an application connection."""
    with psycopg.connect(url, autocommit=True) as conn:
        outbox.install(conn)
        with conn.transaction():
            for env in envs:
                outbox.enqueue(conn, env)
    return [env["eventId"] for env in envs]


def published(url: str) -> int:
    with psycopg.connect(url) as conn:
        return int(conn.execute("SELECT count(*) FROM outbox WHERE status = 'published'").fetchone()[0])


def pg_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return list(conn.execute(sql).fetchall())


def start_dispatch(ns: Namespace, url: str, *args: str) -> RunProcess:
    cmd = [sys.executable, "-m", "delivery_consumer", "dispatch", "--db", url, "--consumer", "catalog", *args]
    proc = RunProcess(cmd, cwd=ns.workdir, env=ns.env())
    ns.started.append(proc)
    return proc


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes killed at teardown if still running."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            kill(proc)  # type: ignore[arg-type]


def test_the_documented_producers_reach_the_consumer_exactly_once(ns: Namespace, pg_url: str) -> None:
    """The psycopg and SQLAlchemy producers of docs/outbox.md save their rows and events in PostgreSQL;
    dispatch publishes them; the catalog consumer ends up with the producer's articles, each event applied once."""
    run_python(readme_block("# producer_pg.py"), pg_url)
    run_python(readme_block("# producer_sqlalchemy.py"), pg_url)
    done = ns.cli("dispatch", "--db", pg_url, "--consumer", "catalog", "--exit-when-idle", "1s", "--poll", "50ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    assert 3 == published(pg_url)
    run = ns.run_until_idle("catalog", idle=1.0)
    assert 0 == run.returncode, run.stderr[-2000:]
    articles = sorted(pg_rows(pg_url, "SELECT id, revision, title, url FROM article"))
    catalog = sorted(read_rows(ns.db("catalog"), "catalog", "article_id, revision, title, url"))
    assert articles == catalog
    assert 3 == len(read_rows(ns.db("catalog"), "inbox", "event_id"))


def test_sqlalchemy_rollback_leaves_no_event_and_a_session_outside_a_transaction_is_refused(pg_url: str) -> None:
    """A Session's rolled-back transaction takes its event with it; a Connection with no transaction open is
    refused (the row would commit on its own)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    with closing(psycopg.connect(pg_url, autocommit=True)) as conn:
        outbox.install(conn)
    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
            session.execute(text("SELECT 1"))
            outbox.enqueue(session, envelope())
            raise RuntimeError("rolled back")
        with engine.connect() as connection:
            connection.commit()
            with pytest.raises(outbox.OutboxError, match="open transaction"):
                outbox.enqueue(connection, envelope())
            connection.rollback()
            with connection.begin():
                assert outbox.enqueue(connection, envelope()) is True
    finally:
        engine.dispose()
    assert [(1,)] == pg_rows(pg_url, "SELECT count(*) FROM outbox")


def test_a_commit_wakes_the_dispatcher_through_listen_notify(ns: Namespace, pg_url: str,
                                                             stopped: list[subprocess.Popen[str]]) -> None:
    """A dispatcher polling only every 10 minutes publishes a row committed while it waits: the trigger's
    NOTIFY woke it (the poll could not have)."""
    produce(pg_url, [])
    proc = start_dispatch(ns, pg_url, "--poll", "10m")
    stopped.append(proc)
    wait_until("the dispatcher listens", lambda: bool(pg_rows(
        pg_url, "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()")),
        procs=[proc])
    wait_until("the dispatcher registered", lambda: bool(pg_rows(pg_url, "SELECT 1 FROM outbox_owners")),
               procs=[proc])
    ids = produce(pg_url, [envelope("a"), envelope("b")])
    wait_until("both rows published", lambda: published(pg_url) == 2, procs=[proc])
    assert set(ids) == set(queued_ids(ns))


def test_a_dispatcher_killed_mid_batch_loses_nothing_and_duplicates_at_most_depth_times_batch(
    ns: Namespace, pg_url: str,
) -> None:
    """SIGKILL between the two halves of a batch's mark (rolled back with the transaction): the next dispatcher
    publishes every row; the broker has each at least once, extra copies at most depth x batch; the consumer
    applies each once."""
    ids = produce(pg_url, [envelope(f"article-{i % 30}", i // 30 + 1) for i in range(300)])
    crashed = ns.cli("dispatch", "--db", pg_url, "--consumer", "catalog", "--batch", "50", "--depth", "2",
                     "--lease", "10m", env=ns.env(DELIVERY_CRASH_AT="dispatch-mid-batch:2"))
    assert -9 == crashed.returncode, crashed.stderr[-2000:]
    done = ns.cli("dispatch", "--db", pg_url, "--consumer", "catalog", "--batch", "50", "--exit-when-idle", "1s",
                  "--poll", "50ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    assert "took back" in done.stderr  # at once: the dead owner's pid is gone, no lease had to expire
    copies = queued_ids(ns)
    assert set(ids) == set(copies)
    assert sum(copies.values()) - len(ids) <= 2 * 50
    run = ns.run_until_idle("catalog", idle=1.0)
    assert 0 == run.returncode, run.stderr[-2000:]
    assert sorted(ids) == sorted(r[0] for r in read_rows(ns.db("catalog"), "inbox", "event_id"))
    assert [(0,)] == pg_rows(pg_url, "SELECT count(*) FROM outbox WHERE failures > 0")


def test_terminated_connections_are_reopened_and_spend_no_attempt(ns: Namespace, pg_url: str,
                                                                   stopped: list[subprocess.Popen[str]]) -> None:
    """The server ends every connection of a running dispatcher (pg_terminate_backend, as a failover or an
    idle-session killer does): it reconnects, listens again, and publishes what is committed next, each row
    with one attempt."""
    first = produce(pg_url, [envelope(f"a{i}") for i in range(20)])
    proc = start_dispatch(ns, pg_url, "--poll", "100ms")
    stopped.append(proc)
    wait_until("the first rows published", lambda: published(pg_url) == 20, procs=[proc])
    ended = pg_rows(pg_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname ="
                    " current_database() AND application_name LIKE 'delivery-consumer%'")
    assert len(ended) >= 2  # the dispatcher's, its heartbeat's and its LISTEN connection
    later = produce(pg_url, [envelope(f"b{i}") for i in range(20)])
    wait_until("the later rows published", lambda: published(pg_url) == 40, procs=[proc])
    assert set(first + later) == set(queued_ids(ns))
    assert [(1, 1)] == pg_rows(pg_url, "SELECT min(attempts), max(attempts) FROM outbox")
    wait_until("it listens again", lambda: bool(pg_rows(
        pg_url, "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()")),
        procs=[proc])


def test_a_statement_timeout_is_waited_out(ns: Namespace, pg_url: str,
                                           stopped: list[subprocess.Popen[str]]) -> None:
    """While the outbox is locked by someone else, the dispatcher's statements time out (statement_timeout in
    its URL): it logs it, waits, and publishes once the lock is gone; no row spends an attempt on it."""
    ids = produce(pg_url, [envelope(f"a{i}") for i in range(10)])
    with psycopg.connect(pg_url) as locker:
        locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        proc = start_dispatch(ns, pg_url + "?options=-c%20statement_timeout%3D200", "--poll", "50ms")
        stopped.append(proc)
        log = proc.wait_for_log("statement timeout")  # (a count of the outbox would wait for the lock too)
        assert "retrying in" in log
        locker.rollback()
    wait_until("every row published", lambda: published(pg_url) == 10, procs=[proc])
    assert set(ids) == set(queued_ids(ns))
    assert [(1, 1)] == pg_rows(pg_url, "SELECT min(attempts), max(attempts) FROM outbox")


def test_a_read_only_database_and_bad_credentials_exit_2_with_one_line(ns: Namespace, pg_url: str) -> None:
    """A read-only database (a standby given by mistake) and an unknown user: one line on stderr, exit 2."""
    produce(pg_url, [envelope()])
    name = pg_url.rsplit("/", 1)[1]
    admin(with_database(pg_url, "postgres"), f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    read_only = ns.cli("dispatch", "--db", pg_url, "--consumer", "catalog", "--exit-when-idle", "1s")
    assert 2 == read_only.returncode
    assert 1 == len(read_only.stderr.strip().splitlines()), read_only.stderr
    assert re.match(r"delivery-consumer: .*: the database is read-only", read_only.stderr)
    assert "Traceback" not in read_only.stderr
    bad_user = pg_url.replace("postgresql://postgres@", "postgresql://nobody_here:secret@")
    denied = ns.cli("dispatch", "--db", bad_user, "--consumer", "catalog", "--exit-when-idle", "1s")
    assert 2 == denied.returncode
    assert 1 == len(denied.stderr.strip().splitlines())
    assert "nobody_here" in denied.stderr and "secret" not in denied.stderr
    listed = ns.cli("outbox", "stats", "--db", pg_url)
    assert 0 == listed.returncode, listed.stderr  # reading a read-only database is fine
    assert "unpublished:        1" in listed.stdout


def test_outbox_commands_work_on_postgresql(ns: Namespace, pg_url: str) -> None:
    """outbox list, show, stats, requeue, drop and prune take a PostgreSQL URL; a quarantined row is shown with
    its reason, dropped, requeued and published."""
    bad, good = produce(pg_url, [envelope("a"), envelope("b")])
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET routing_key = 'nowhere.x' WHERE event_id = %s", (bad,))
    first = ns.cli("dispatch", "--db", pg_url, "--consumer", "catalog", "--exit-when-idle", "1s", "--poll", "50ms")
    assert 1 == first.returncode and "1 row left: 1 quarantined" in first.stderr, first.stderr[-2000:]
    listed = ns.cli("outbox", "list", "--db", pg_url, "--state", "quarantined")
    assert bad in listed.stdout and "312 NO_ROUTE" in listed.stdout
    shown = ns.cli("outbox", "show", "--db", pg_url, good, "--json")
    assert '"published"' in shown.stdout
    assert 0 == ns.cli("outbox", "drop", "--db", pg_url, bad, "--reason", "bad key").returncode
    assert 0 == ns.cli("outbox", "requeue", "--db", pg_url, bad).returncode  # a dropped row too
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET routing_key = 'material.published' WHERE event_id = %s", (bad,))
    again = ns.cli("dispatch", "--db", pg_url, "--consumer", "catalog", "--exit-when-idle", "1s", "--poll", "50ms")
    assert 0 == again.returncode, again.stderr[-2000:]
    assert Counter({bad: 1, good: 1}) == queued_ids(ns)
    pruned = ns.cli("outbox", "prune", "--db", pg_url, "--older-than", "0s")
    assert "2 published or dropped rows deleted" in pruned.stdout


def test_a_postgresql_producer_in_the_deployment_file_is_dispatched_traced_and_shown(
    ns: Namespace, pg_url: str, tmp_path: Path,
) -> None:
    """[producers.orders] db = a PostgreSQL URL: dispatch takes it from the file, trace finds its row, status
    and the console's producer table show its counts; the password never appears."""
    from deploykit import dc, write_deployment

    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",))
    secret_url = pg_url.replace("postgresql://postgres@", "postgresql://postgres:hunter2@")
    config.write_text(config.read_text().replace('[producers.material]\ndb = "producer.db"',
                                                 f'[producers.orders]\ndb = "{secret_url}"'))
    (event_id,) = produce(pg_url, [envelope("a")])
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    done = dc(config, "dispatch", "--exit-when-idle", "1s", "--poll", "50ms")
    assert 0 == done.returncode, done.stderr[-2000:]
    traced = dc(config, "trace", event_id, "--json")
    assert 0 == traced.returncode, traced.stderr
    assert '"published"' in traced.stdout and "hunter2" not in traced.stdout
    status = dc(config, "status", "--json")
    shown = orjson.loads(status.stdout)
    (producer,) = shown["producers"]
    assert (1, 0) == (producer["published"], producer["unpublished"]), producer
    assert "hunter2" not in status.stdout
    dep = config_lib.load(config)
    assert dep is not None
    page = Console(dep).build_status_page()
    assert "orders" in page and "hunter2" not in page


def test_metrics_read_a_postgresql_outbox(pg_url: str) -> None:
    """The dispatcher's Prometheus collector reads rows by state from a PostgreSQL outbox at each scrape."""
    from delivery_consumer.outbox import metrics

    produce(pg_url, [envelope("a"), envelope("b")])
    families = {f.name: f for f in metrics.OutboxCollector(pg_url).collect()}
    due = {s.labels["state"]: s.value for s in families["outbox_rows"].samples}
    assert 2 == due["due"] and 0 == due["published"]
    assert families["outbox_oldest_pending_age_seconds"].samples[0].value >= 0


def test_two_dispatchers_on_one_database_publish_each_row_exactly_once(ns: Namespace, pg_url: str) -> None:
    """Two dispatchers drain one PostgreSQL outbox at once with small batches: no crash, so any copy beyond
    one would be a double claim -- the broker has every row exactly once, and both took a share."""
    produce(pg_url, [])
    procs = [start_dispatch(ns, pg_url, "--batch", "25", "--poll", "20ms", "--exit-when-idle", "5s")
             for _ in range(2)]
    wait_until("both dispatchers registered", lambda: 2 == len(pg_rows(pg_url, "SELECT 1 FROM outbox_owners")),
               procs=procs)
    ids = produce(pg_url, [envelope(f"article-{i % 40}", i // 40 + 1) for i in range(3000)])
    results = [proc.until_idle(240) for proc in procs]
    assert [0, 0] == [r.returncode for r in results], [r.stderr[-1500:] for r in results]
    assert Counter(dict.fromkeys(ids, 1)) == queued_ids(ns)
    shares = [int(re.search(r"exiting: (\d+) published", r.stderr).group(1)) for r in results]  # type: ignore[union-attr]
    assert len(ids) == sum(shares) and min(shares) > 0, shares
