"""What the inbox and the outbox on PostgreSQL take from ``store/postgres.py``: a URL's password kept out of
messages, and every psycopg error sorted the same way for both (an outage waits, a configuration error exits 2)."""

from __future__ import annotations

import socket

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from delivery_consumer.inbox import pg as inbox_pg
from delivery_consumer.model.errors import DatabaseError, StoreUnavailable
from delivery_consumer.outbox import pg as outbox_pg
from delivery_consumer.store import postgres

_SECRET = st.text(alphabet=st.characters(blacklist_characters=":/@?", blacklist_categories=("Cs",)), min_size=1)


@given(user=st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), password=_SECRET)
def test_redact_keeps_the_user_and_drops_the_password(user: str, password: str) -> None:
    """redact leaves the user, host and database of a URL and never its password; a URL without one is unchanged."""
    url = f"postgresql://{user}:{password}@db.example:5432/orders?sslmode=require"
    assert postgres.redact(url) == f"postgresql://{user}@db.example:5432/orders?sslmode=require"
    assert postgres.redact(f"postgresql://{user}@db.example/orders") == f"postgresql://{user}@db.example/orders"
    assert inbox_pg.redact is postgres.redact and outbox_pg.redact is postgres.redact


def test_is_url_tells_a_server_from_a_file() -> None:
    """Both URL schemes name a server; a path, a sqlite-looking string or a non-string does not."""
    assert postgres.is_url("postgresql://h/db") and postgres.is_url("postgres://h/db")
    assert not postgres.is_url("catalog.db") and not postgres.is_url("/var/lib/x.db") and not postgres.is_url(None)


@pytest.mark.parametrize(("error", "expected"), [
    (psycopg.errors.lookup("25006")("read-only transaction"), DatabaseError),
    (psycopg.errors.lookup("28P01")("password authentication failed"), DatabaseError),
    (psycopg.errors.lookup("3D000")("database does not exist"), DatabaseError),
    (psycopg.errors.lookup("40001")("could not serialize access"), StoreUnavailable),
    (psycopg.errors.lookup("40P01")("deadlock detected"), StoreUnavailable),
    (psycopg.errors.lookup("57P01")("terminating connection due to administrator command"), StoreUnavailable),
    (psycopg.errors.lookup("23505")("duplicate key"), DatabaseError),
    (psycopg.OperationalError("connection refused"), StoreUnavailable),
    (psycopg.OperationalError("the database system is starting up"), StoreUnavailable),
    (psycopg.OperationalError('role "x" does not exist'), DatabaseError),
    (psycopg.InterfaceError("the connection is closed"), StoreUnavailable),
])
def test_both_backends_sort_an_error_alike(error: Exception, expected: type[Exception]) -> None:
    """The inbox and the outbox turn one psycopg error into the same class of the project's, with the label."""
    for translated in (inbox_pg.translate(error, "pg://x"), outbox_pg.translate(error, "pg://x")):
        assert type(translated) is expected
        assert "pg://x: " in str(translated)


def test_each_backend_names_itself() -> None:
    """A read-only database names who needs the primary; only the outbox reads a missing table as no outbox."""
    read_only = psycopg.errors.lookup("25006")("read-only transaction")
    assert "the inbox needs the primary" in str(inbox_pg.translate(read_only, "pg://x"))
    assert "the outbox needs the primary" in str(outbox_pg.translate(read_only, "pg://x"))
    missing = psycopg.errors.lookup("42P01")('relation "outbox" does not exist')
    assert "no outbox in this database" in str(outbox_pg.translate(missing, "pg://x"))
    assert "no outbox" not in str(inbox_pg.translate(missing, "pg://x"))


def test_connect_to_nothing_is_an_outage_without_the_password() -> None:
    """A server that refuses the connection is StoreUnavailable (wait), and the message shows the label only."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://u:s3cret@127.0.0.1:{port}/db"
    with pytest.raises(StoreUnavailable) as caught:
        postgres.connect(url, postgres.redact(url), user="the inbox", application_name="test")
    assert "s3cret" not in str(caught.value)
    assert f"postgresql://u@127.0.0.1:{port}/db: " in str(caught.value)
