"""PostgreSQL for the tests: the shared server, a database of the test's own.

``pg_server`` is the server's admin URL (``DELIVERY_POSTGRES_URL``, default
``postgresql://postgres@127.0.0.1:5432/postgres``); tests that need it skip
with a reason when it is unreachable, unless ``DELIVERY_REQUIRE_POSTGRES`` is
set (as ``.ci/run`` does), in which case they fail. ``pg_url`` is a database
created for one test under a random name and dropped afterwards (its
connections ended first), so tests never see each other's outbox.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def server_url() -> str:
    return os.environ.get("DELIVERY_POSTGRES_URL", DEFAULT_URL)


def with_database(url: str, name: str) -> str:
    """*url* naming database *name* instead of its own."""
    base, _, query = url.partition("?")
    base = base.rsplit("/", 1)[0] if base.count("/") > 2 else base
    return f"{base}/{name}" + (f"?{query}" if query else "")


def admin(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The server's admin URL; skips (or fails under DELIVERY_REQUIRE_POSTGRES) when it is unreachable."""
    url = server_url()
    try:
        import psycopg
    except ImportError:
        if os.environ.get("DELIVERY_REQUIRE_POSTGRES"):
            pytest.fail("psycopg is required (DELIVERY_REQUIRE_POSTGRES) but not installed")
        pytest.skip("psycopg is not installed (pip install -e '.[test]')")
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        if os.environ.get("DELIVERY_REQUIRE_POSTGRES"):
            pytest.fail(f"PostgreSQL is required (DELIVERY_REQUIRE_POSTGRES) but unreachable at {url}: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {url}; set DELIVERY_REQUIRE_POSTGRES=1 to fail instead")
    return url


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A database of this test's own (random name), dropped afterwards."""
    name = f"dc_test_{secrets.token_hex(6)}"
    admin(pg_server, f'CREATE DATABASE "{name}"')
    try:
        yield with_database(pg_server, name)
    finally:
        admin(pg_server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
