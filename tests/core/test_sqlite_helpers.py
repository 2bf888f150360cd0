"""The transaction, read snapshot and timestamp age every database of the project takes from ``sqlite.py``."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delivery_consumer.model.errors import DatabaseError, StoreUnavailable
from delivery_consumer.store import sqlite


def table(tmp_path: Path) -> sqlite3.Connection:
    conn = sqlite.connect(tmp_path / "t.db", busy_timeout_ms=0)
    conn.execute("CREATE TABLE t (x INTEGER PRIMARY KEY)")
    return conn


def test_a_transaction_commits_or_rolls_back_and_translates_or_not(tmp_path: Path) -> None:
    """sqlite.transaction commits what its block wrote; a block that raises leaves nothing; an sqlite3 error leaves
    translated (DatabaseError), or as it is with translated=False; a busy database is the environment's fault."""
    conn = table(tmp_path)
    with sqlite.transaction(conn):
        conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(KeyError), sqlite.transaction(conn):
        conn.execute("INSERT INTO t VALUES (2)")
        raise KeyError("the block failed")
    with pytest.raises(DatabaseError, match=r"t\.db: UNIQUE constraint failed"), sqlite.transaction(conn):
        conn.execute("INSERT INTO t VALUES (3)")
        conn.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(sqlite3.IntegrityError), sqlite.transaction(conn, translated=False):
        conn.execute("INSERT INTO t VALUES (4)")
        conn.execute("INSERT INTO t VALUES (1)")
    assert not conn.in_transaction
    assert [(1,)] == conn.execute("SELECT x FROM t").fetchall()
    other = sqlite.connect(tmp_path / "t.db", busy_timeout_ms=0)
    try:
        with sqlite.transaction(other):
            with pytest.raises(StoreUnavailable, match="database is locked"), sqlite.transaction(conn):
                pass
            with pytest.raises(sqlite3.OperationalError), sqlite.transaction(conn, translated=False):
                pass
    finally:
        other.close()
        conn.close()


def test_a_read_snapshot_sees_one_state_and_joins_an_open_transaction(tmp_path: Path) -> None:
    """Reads inside read_snapshot see the state at its first read, whatever another connection commits meanwhile;
    it leaves no transaction open; inside a transaction already open it reads that one and leaves it open."""
    conn = table(tmp_path)
    conn.execute("INSERT INTO t VALUES (1)")
    writer = sqlite.connect(tmp_path / "t.db")
    try:
        with sqlite.read_snapshot(conn):
            assert [(1,)] == conn.execute("SELECT x FROM t").fetchall()
            writer.execute("INSERT INTO t VALUES (2)")  # committed (autocommit) beside the snapshot (WAL)
            assert [(1,)] == conn.execute("SELECT x FROM t").fetchall()
        assert not conn.in_transaction
        assert [(1,), (2,)] == conn.execute("SELECT x FROM t").fetchall()
        with sqlite.transaction(conn):
            conn.execute("INSERT INTO t VALUES (3)")
            with sqlite.read_snapshot(conn):
                assert 3 == conn.execute("SELECT count(*) FROM t").fetchone()[0]
            assert conn.in_transaction
        assert 3 == conn.execute("SELECT count(*) FROM t").fetchone()[0]
    finally:
        writer.close()
        conn.close()


@given(st.floats(min_value=0, max_value=4_000_000_000), st.floats(min_value=0, max_value=10_000_000))
def test_the_age_of_a_stored_timestamp_is_the_time_since_it_to_the_millisecond(when: float, later: float) -> None:
    """age_s(now_iso(t), t + d) is d to within the millisecond now_iso keeps; no timestamp has no age."""
    age = sqlite.age_s(sqlite.now_iso(when), when + later)
    assert abs(age - later) <= 0.0015
    assert sqlite.age_s(None, when) is None
