"""PostgreSQL for the tests: the shared server, a database of the test's own.

``pg_server`` is the server's admin URL (``DELIVERY_POSTGRES_URL``, default
``postgresql://postgres@127.0.0.1:5432/postgres``); tests that need it skip
with a reason when it is unreachable, unless ``DELIVERY_REQUIRE_POSTGRES`` is
set (as ``.ci/run`` does), in which case they fail. ``pg_url`` is a database
created for one test under a random name and dropped afterwards (its
connections ended first), so tests never see each other's outbox.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

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


class PrivatePostgres:
    """A PostgreSQL server of the test session's own (initdb in a temporary
    directory, a free port), for the tests that restart a server: the shared
    one is never touched. Run as the ``postgres`` user when the tests run as
    root (the server refuses root)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.data = base / "data"
        self.port = free_port()
        self.bin = Path(os.environ.get("DELIVERY_POSTGRES_BIN", _find_bin()))

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    def init(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync",
                  "-E", "UTF8")

    def start(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.base / "server.log"), "-w",
                  "-o", f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def copy_of(self, primary: PrivatePostgres) -> None:
        """Make this server a streaming standby of *primary* (``pg_basebackup -R``); start() starts it."""
        self.base.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres")
        self._run(str(self.bin / "pg_basebackup"), "-D", str(self.data), "-R", "-X", "stream", "-h", "127.0.0.1",
                  "-p", str(primary.port), "-U", "postgres")

    def promote(self) -> None:
        """A standby made the primary (a failover's last step), waiting until it takes writes."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "promote")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _find_bin() -> str:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return str(found[-1].parent) if found else "/usr/lib/postgresql/15/bin"


@pytest.fixture(scope="session")
def private_pg() -> Iterator[PrivatePostgres]:
    """A private server (see PrivatePostgres), started once per session, stopped at its end."""
    # Not under pytest's directory (mode 0700): the server's user must reach it.
    base = Path(tempfile.mkdtemp(prefix="delivery-private-pg-"))
    server = PrivatePostgres(base)
    try:
        if not (server.bin / "initdb").exists():
            if os.environ.get("DELIVERY_REQUIRE_POSTGRES"):
                pytest.fail(f"no PostgreSQL server binaries in {server.bin} (DELIVERY_POSTGRES_BIN)")
            pytest.skip(f"no PostgreSQL server binaries in {server.bin}; set DELIVERY_POSTGRES_BIN")
        server.init()
        server.start()
        try:
            yield server
        finally:
            with contextlib.suppress(subprocess.SubprocessError):
                server.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
