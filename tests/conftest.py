"""Fixtures: consumer databases in tmp_path, and the test-only consumers.

The tests are laid out by the package they test (``core/``, ``inbox/``,
``outbox/``, ``service/``, ``cli/``), with the suite that needs RabbitMQ in
``broker/`` and the whole-system suite (status, trace, console, deploy) in
``system/``; the helpers (``*kit.py``, ``support.py``, the test-only
consumers) stay here, beside this file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import OpenDB, closed_at_exit

from delivery_consumer import consumers
from delivery_consumer.inbox import ConsumerDB
from delivery_consumer.model.contract import ConsumerSpec

#: The suites' directories: on sys.path, so that a test module may import another
#: suite's helpers by its name (``from test_worker import ...``) whatever the order.
SUITES = sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
sys.path[1:1] = [str(p) for p in SUITES if str(p) not in sys.path]

# Broker fixtures (amqp_url, ns) for the tests that need RabbitMQ; cluster for partitioned ones.
pytest_plugins = ["brokerkit", "partitionkit", "pgkit", "clusterkit"]

#: Fixtures that reach RabbitMQ: a test using any of them (directly or through
#: another fixture) needs the broker.
BROKER_FIXTURES = frozenset({"amqp_url", "ns", "private_broker", "private_ns", "rabbit_cluster", "cluster_ns"})
#: Fixtures that reach PostgreSQL (tests/pgkit.py).
POSTGRES_FIXTURES = frozenset({"pg_server", "pg_url", "private_pg"})


#: The directory of the suite that needs RabbitMQ: every test in it is marked ``broker``.
BROKER_SUITE = Path(__file__).resolve().parent / "broker"
#: The suite on a three-node cluster of private nodes (tests/clusterkit.py): marked ``broker`` and ``cluster``.
CLUSTER_SUITE = Path(__file__).resolve().parent / "cluster"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of ``broker/``, and every other test that uses a broker fixture,
    ``broker``, so that ``pytest -m "not broker"`` runs the rest without RabbitMQ; and
    keep together on one xdist worker (``--dist loadgroup``) what shares a costly fixture."""
    groups = {item.nodeid: _worker_group(item) for item in items}
    for item in items:
        if groups[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    # The cluster's scenarios are the longest group of one worker: started first, they run beside the rest.
    items.sort(key=lambda item: groups[item.nodeid] != "cluster")
    for item in items:
        if BROKER_SUITE in Path(item.path).parents or BROKER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.broker)
        if CLUSTER_SUITE in Path(item.path).parents:
            item.add_marker(pytest.mark.broker)
            item.add_marker(pytest.mark.cluster)
        if POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


def _worker_group(item: pytest.Item) -> str | None:
    """The worker group of a test: the cluster's tests share its three nodes (one cluster per
    run, not one per worker); a module's tests share its module-scoped fixture (one build)."""
    if CLUSTER_SUITE in Path(item.path).parents or "rabbit_cluster" in getattr(item, "fixturenames", ()):
        return "cluster"
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d.scope in ("module", "package", "class") for chain in defs for d in chain):
        return Path(item.path).stem
    return None


@pytest.fixture
def open_db(tmp_path: Path) -> Iterator[OpenDB]:
    """Open (creating) a consumer database in tmp_path; closed at teardown."""
    with closed_at_exit() as keep:

        def _open(consumer: str = "catalog", name: str | None = None, **kwargs: object) -> ConsumerDB:
            path = tmp_path / (name or f"{consumer}.db")
            kwargs.setdefault("create", True)
            return keep(consumers.open_db(path, consumer, **kwargs))  # type: ignore[arg-type]

        yield _open


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def open_inbox(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """Open (creating) a consumer's inbox on each backend in turn: a file in tmp_path, then a schema of
    the test's own PostgreSQL database (tests/pgkit.py); closed at teardown. ``open_inbox.kind`` is
    the backend's name."""
    with closed_at_exit() as keep:
        if request.param == "sqlite":

            def _open(consumer: str = "catalog") -> Any:
                return keep(consumers.open_db(tmp_path / f"{consumer}.db", consumer, create=True))
        else:
            from delivery_consumer.inbox.pg import PgInboxDB

            url = request.getfixturevalue("pg_url")

            def _open(consumer: str = "catalog") -> Any:
                return keep(PgInboxDB.open(url, consumers.get(consumer), create=True))

        _open.kind = request.param  # type: ignore[attr-defined]
        yield _open


@pytest.fixture
def catalog_db(open_db: OpenDB) -> ConsumerDB:
    """A fresh catalog database."""
    return open_db("catalog")


@pytest.fixture
def audit_db(open_db: OpenDB) -> ConsumerDB:
    """A fresh audit database."""
    return open_db("audit")


@pytest.fixture
def counter() -> Iterator[ConsumerSpec]:
    """The test-only ``counter`` consumer, registered for one test."""
    import counter_consumer  # registers itself on first import

    spec = consumers.register(counter_consumer.SPEC, replace=True)
    yield spec
    consumers.unregister(spec.name)


@pytest.fixture
def register() -> Iterator[Callable[[ConsumerSpec], ConsumerSpec]]:
    """Register ad-hoc consumer specs for one test; unregistered afterwards."""
    names: list[str] = []

    def _register(spec: ConsumerSpec) -> ConsumerSpec:
        names.append(spec.name)
        return consumers.register(spec, replace=True)

    yield _register
    for name in names:
        consumers.unregister(name)
