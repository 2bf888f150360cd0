"""Releases have versions: the package's is in the CHANGELOG, a database records
the release that last migrated it, and a database newer than the code says
which release wrote it and what to run instead."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest
from support import OpenDB, cli

from delivery_consumer import __version__, consumers
from delivery_consumer.inbox import database
from delivery_consumer.model.errors import DatabaseError

REPO = Path(__file__).resolve().parents[2]


def test_the_changelog_has_a_section_for_this_version() -> None:
    """CHANGELOG.md has a section for the package's version and for the one before (0.1.0)."""
    headings = re.findall(r"^## \[([0-9][^\]]*)\]", (REPO / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert __version__ == headings[0] and "0.1.0" in headings
    assert "0.1.0" != __version__


def test_a_new_database_records_the_release_that_made_it(open_db: OpenDB) -> None:
    """A fresh database names the release that migrated it last (this one)."""
    db = open_db("catalog")
    assert f"delivery-consumer {__version__}" == db.meta()[database.SCHEMA_BY_KEY]


@pytest.mark.parametrize("readonly", [False, True])
def test_a_newer_database_names_its_release_and_what_to_do(open_db: OpenDB, readonly: bool) -> None:
    """A database a later release migrated is refused with its schema version, the release
    that wrote it, this release and the way out -- in one line, the file unchanged."""
    db = open_db("catalog")
    db.conn.execute(f"PRAGMA user_version = {database.STORE_VERSION + 1}")
    db.conn.execute("UPDATE meta SET value = 'delivery-consumer 9.1.0' WHERE key = ?", (database.SCHEMA_BY_KEY,))
    db.close()
    content = db.path.read_bytes()

    with pytest.raises(DatabaseError) as info:
        consumers.open_db(db.path, "catalog", readonly=readonly)

    message = str(info.value)
    assert "\n" not in message
    assert f"database schema version {database.STORE_VERSION + 1} was written by delivery-consumer 9.1.0" in message
    assert f"delivery-consumer {__version__} knows versions up to {database.STORE_VERSION}" in message
    assert "open it with that release or a later one" in message
    assert content == db.path.read_bytes()


def test_a_newer_database_without_a_release_says_so(open_db: OpenDB) -> None:
    """Without the release recorded (a later release that did not say), the CLI still
    explains in one line, exit 2."""
    db = open_db("catalog")
    path = db.path
    db.close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {database.STORE_VERSION + 1}")
        conn.execute("DELETE FROM meta WHERE key = ?", (database.SCHEMA_BY_KEY,))
    conn.close()

    result = cli(["init", "--consumer", "catalog", "--db", str(path)])

    assert 2 == result.exit_code
    assert "was written by a later release" in result.output and "Traceback" not in result.output
