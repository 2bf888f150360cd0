"""A consumer's PostgreSQL inbox and a real streaming standby (a private primary and a private
standby made by ``pg_basebackup``; the shared server is never touched): ``run`` refuses the
standby with one line and consumes nothing, the operator's reads work on it, and once it is
promoted (a failover after the primary's loss) ``run`` on it applies what the primary had not
and recognises as duplicates the redeliveries of what the primary had applied."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace
from pgkit import PrivatePostgres
from support import wait_until
from test_pg_inbox_broker import CONSUMER, drained, ledger, stream

from delivery_consumer.model.contract import ConsumerSpec

pytestmark = [pytest.mark.broker, pytest.mark.postgres]


@pytest.fixture(autouse=True)
def registered(counter: ConsumerSpec) -> ConsumerSpec:
    """The counter consumer registered in this process (publish declares its queue by it)."""
    return counter


@pytest.fixture
def pair() -> Iterator[tuple[PrivatePostgres, PrivatePostgres]]:
    """A private primary and its streaming standby, both stopped and removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="delivery-standby-pg-"))
    base.chmod(0o755)  # the servers' user (postgres, when the tests run as root) must reach their directories
    primary, standby = PrivatePostgres(base / "primary"), PrivatePostgres(base / "standby")
    try:
        if not (primary.bin / "pg_basebackup").exists():
            pytest.skip(f"no pg_basebackup in {primary.bin}; set DELIVERY_POSTGRES_BIN")
        primary.init()
        primary.start()
        standby.copy_of(primary)
        standby.start()
        yield primary, standby
    finally:
        for server in (standby, primary):
            with contextlib.suppress(subprocess.SubprocessError):
                server.stop()
        shutil.rmtree(base, ignore_errors=True)


def caught_up(primary: PrivatePostgres, standby: PrivatePostgres) -> None:
    """Wait until the standby has replayed everything the primary has written so far."""
    import psycopg

    with psycopg.connect(primary.url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]

    def replayed() -> bool:
        with psycopg.connect(standby.url, autocommit=True, connect_timeout=5) as conn:
            behind = conn.execute("SELECT pg_wal_lsn_diff(%s::pg_lsn, pg_last_wal_replay_lsn())", (target,))
            got = behind.fetchone()
            return got is not None and got[0] <= 0

    wait_until("the standby to replay the primary's WAL", replayed, timeout=60)


def test_a_standby_is_refused_read_and_after_promotion_applies_only_what_the_primary_had_not(
        ns: Namespace, pair: tuple[PrivatePostgres, PrivatePostgres]) -> None:
    """run on the standby exits 2 with one line naming the read-only database and consumes nothing;
    `inbox stats` and `trace` read the standby; after the primary is stopped and the standby promoted, run on it
    drains the queue: every event has one receipt and was counted once, the redeliveries of what the
    primary applied are duplicates, nothing is rejected."""
    primary, standby = pair
    env = ns.env(DELIVERY_PLUGINS="counter_consumer")
    events, _ = stream(900, seed=5)
    first, rest = events[:600], events[600:]
    ns.publish([orjson.dumps(e) for e in first], declare=[CONSUMER])
    done = ns.run_until_idle(CONSUMER, "--db", primary.url, "--batch", "50", env=env, idle=2)
    assert 0 == done.returncode, done.stderr
    assert (600, 600, 0) == ledger(primary.url)[:3]
    caught_up(primary, standby)

    again = first[:150]  # applied on the primary: redelivered after the failover
    bodies = [orjson.dumps(e) for e in rest + again]
    ns.publish(bodies)
    refused = ns.cli("run", "--consumer", CONSUMER, "--db", standby.url, env=env, timeout=60)
    assert 2 == refused.returncode, refused.stderr
    assert 1 == len(refused.stderr.splitlines()), refused.stderr
    assert "is read-only (a standby" in refused.stderr and "the inbox needs the primary" in refused.stderr
    assert len(bodies) == ns.count(ns.topology(CONSUMER).queue)

    stats = ns.cli("inbox", "stats", "--consumer", CONSUMER, "--db", standby.url, "--json", env=env)
    assert 0 == stats.returncode, stats.stderr
    assert 600 == orjson.loads(stats.stdout)["receipts"]
    traced = ns.cli("trace", str(first[0]["eventId"]), "--consumer", CONSUMER, "--db", standby.url, "--offline",
                    env=env)
    assert 0 == traced.returncode, traced.stderr
    assert str(first[0]["eventId"]) in traced.stdout

    primary.stop()  # the primary is lost
    standby.promote()
    done = ns.run_until_idle(CONSUMER, "--db", standby.url, "--batch", "50", env=env, idle=2)
    assert 0 == done.returncode, done.stderr
    assert (900, 900, 0, 0) == ledger(standby.url)[:4]
    assert 0 == drained(ns)
