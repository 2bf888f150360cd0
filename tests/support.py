"""Helpers shared by the tests: envelopes, table snapshots, the CLI, and
:func:`wait_until`, the one way a test waits for something to happen.

A plain module (not a conftest) so that tests can import it by name: pytest
puts ``tests/`` on ``sys.path`` (rootdir-relative "prepend" import mode).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson
from click.testing import CliRunner, Result

from delivery_consumer.cli import main
from delivery_consumer.inbox import ConsumerDB
from delivery_consumer.model.envelope import Envelope, from_mapping

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SAMPLES = REPO / "sample_events"

#: The lesson's example event.
EVENT_ID = "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11"
TITLE = "Доставка без потерь"
URL = "https://example.org/a/42"
PUBLISHED = "material.published"
WITHDRAWN = "material.withdrawn"

#: The ``open_db`` fixture: ``open_db(consumer="catalog", name=None, **open_kwargs)``.
OpenDB = Callable[..., ConsumerDB]


def make_envelope(
    *,
    event_id: str | None = EVENT_ID,
    type: str = PUBLISHED,
    article_id: str = "article-42",
    revision: Any = 1,
    occurred_at: str = "2026-11-29T10:00:00Z",
    title: str = TITLE,
    url: str = URL,
    **extra: Any,
) -> dict[str, Any]:
    """A fresh envelope dict; ``event_id=None`` draws a new UUID."""
    env: dict[str, Any] = {
        "eventId": event_id if event_id is not None else str(uuid.uuid4()),
        "type": type,
        "articleId": article_id,
        "revision": revision,
        "occurredAt": occurred_at,
        "data": {"title": title, "url": url},
    }
    env.update(extra)
    return env


def new_event(**kwargs: Any) -> dict[str, Any]:
    """Like :func:`make_envelope` but with a new eventId unless one is given."""
    kwargs.setdefault("event_id", None)
    return make_envelope(**kwargs)


def env(**kwargs: Any) -> Envelope:
    """A validated Envelope of :func:`make_envelope` (same keywords)."""
    return from_mapping(make_envelope(**kwargs))


def body(obj: Any) -> bytes:
    """The JSON bytes of *obj*, in its own key order."""
    return orjson.dumps(obj)


def ndjson(objs: Sequence[Any]) -> bytes:
    """NDJSON text of *objs* (bytes are taken as already-encoded lines)."""
    lines = [o if isinstance(o, bytes) else orjson.dumps(o) for o in objs]
    return b"".join(line + b"\n" for line in lines)


def rows(conn: sqlite3.Connection | ConsumerDB, table: str, columns: str = "*", where: str = "",
         params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """The rows of *table* (those matching *where*, if given), sorted, through
    a connection or a ConsumerDB."""
    if isinstance(conn, ConsumerDB):
        conn = conn.conn
    sql = f"SELECT {columns} FROM {table}" + (f" WHERE {where}" if where else "")
    return sorted(conn.execute(sql, params).fetchall())


def effect_and_inbox(db: ConsumerDB) -> dict[str, list[tuple[Any, ...]]]:
    """A snapshot of the inbox and of the consumer's effect tables."""
    return {table: rows(db, table) for table in ("inbox", *db.spec.tables)}


def read_rows(path: Path, table: str, columns: str = "*", where: str = "",
              params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Rows of *table* (see :func:`rows`) through a fresh, independent
    read-only connection (what another process would see: only committed data)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return rows(conn, table, columns, where, params)
    finally:
        conn.close()


def count_rows(path: Path, table: str, where: str = "", params: Sequence[Any] = ()) -> int:
    """How many rows of *table* match *where* (see :func:`read_rows`); 0 while the
    database or the table does not exist yet (a process still creating it)."""
    if not path.exists():
        return 0
    try:
        return int(read_rows(path, table, "count(*)", where, params)[0][0])
    except sqlite3.OperationalError:
        return 0


def cli(args: Sequence[str], *, input: bytes | str | None = None, env: dict[str, str] | None = None) -> Result:
    """Run ``delivery-consumer ARGS`` in-process and return click's Result.
    Only *env* sets ``DELIVERY_*`` variables: those of the test process are
    hidden, so that a test sees the same CLI whatever the shell exported."""
    isolated: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DELIVERY_")}
    isolated.update(env or {})
    runner = CliRunner(env=isolated)
    return runner.invoke(main, list(args), input=input, catch_exceptions=False)


def json_lines(text: str) -> list[dict[str, Any]]:
    """Parse one JSON object per non-empty line."""
    return [orjson.loads(line) for line in text.splitlines() if line.strip()]


def console_script() -> str:
    """The installed ``delivery-consumer`` script of the running interpreter."""
    beside = Path(sys.executable).parent / "delivery-consumer"
    if beside.exists():
        return str(beside)
    found = shutil.which("delivery-consumer")
    assert found is not None, "the delivery-consumer console script is not installed"
    return found


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: ours, without options that would
    change what the CLI does, plus *extra*."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DELIVERY_")}
    environ.update(extra)
    return environ


T = TypeVar("T")


class _Closable(Protocol):
    def close(self) -> object: ...


C = TypeVar("C", bound=_Closable)


@contextlib.contextmanager
def closed_at_exit() -> Iterator[Callable[[C], C]]:
    """A fixture's ``keep``: it returns what it is given and closes it when the
    block ends (the last kept first), also when the test failed."""
    with contextlib.ExitStack() as stack:

        def keep(thing: C) -> C:
            stack.callback(thing.close)
            return thing

        yield keep


class _Process(Protocol):
    def poll(self) -> int | None: ...


def wait_until(what: str, condition: Callable[[], T | None], timeout: float = 60.0, procs: Sequence[_Process] = (), *,
               ignoring: tuple[type[BaseException], ...] = (), interval: float = 0.02) -> T:
    """Poll *condition* until it returns something true, and return that.

    What a test waits for must be observable: a receipt count, a queue depth,
    a log line, a metric, a file. *timeout* only bounds a failure (it is
    generous: the machine may be loaded), it never decides an outcome. The
    wait fails at once, with that process's log when it keeps one (see
    ``brokerkit.RunProcess``), if a process of *procs* exits meanwhile.
    Exceptions of the types *ignoring* count as "not yet" (a port not
    listening yet, a broker still starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except ignoring:
            value = None
        if value:
            return value
        for proc in procs:
            if proc.poll() is not None:
                output = getattr(proc, "output", None)
                log = output()[1][-3000:] if output is not None else ""
                raise AssertionError(f"a process exited ({proc.poll()}) while waiting for {what}:\n{log}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
