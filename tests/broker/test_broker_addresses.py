"""``run`` given several broker addresses: a dead first node (refusing, or accepting and silent) costs no
reconnect backoff -- the next address is tried at once; a reconnect after losing a node starts with the next
one; the node in use is in the log and in ``delivery_broker_connected{node=...}``."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace, RunProcess, free_port
from support import count_rows, new_event, read_rows, wait_until
from tcpproxy import Proxy


@pytest.fixture
def proxies(ns: Namespace) -> Iterator[list[Proxy]]:
    """Two proxies in front of the test's broker, forwarding; killed afterwards."""
    made = [Proxy(ns.url), Proxy(ns.url)]
    yield made
    for proxy in made:
        proxy.close()


def events(n: int) -> list[bytes]:
    return [orjson.dumps(new_event(article_id=f"a-{i % 50}")) for i in range(n)]


def node_metric(port: int, node: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    series = f'delivery_broker_connected{{consumer="audit",node="{node}"}}'
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rpartition(" ")[2])
    return None


def stop(proc: RunProcess) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert 0 == proc.returncode, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return err


def applied_once(db: Path, n: int) -> bool:
    return [(n, n)] == read_rows(db, "audit", "count(*), count(DISTINCT event_id)")


def broker_node(ns: Namespace) -> str:
    params = ns.url.split("@", 1)[1].split("/", 1)[0]
    return params if ":" in params else f"{params}:5672"


@pytest.mark.parametrize("first", ["refuse", "blackhole"])
def test_a_dead_first_address_fails_over_to_the_next_at_once(ns: Namespace, proxies: list[Proxy], first: str) -> None:
    """The first address refuses, or accepts and never answers; the second is the broker: run consumes from
    the second (log line and metric naming it) without waiting out a reconnect backoff for the first."""
    ns.publish(events(50), declare=["audit"])
    dead = proxies[0]
    dead(first)
    port = free_port()
    urls = f"{dead.url},{ns.url}"
    started = time.monotonic()
    proc = ns.start_run("audit", "--metrics-port", str(port), env=ns.env(DELIVERY_AMQP_URL=urls))
    proc.wait_for_log(f"connected to {broker_node(ns)}")
    print(f"first address {first}: consuming from the second {time.monotonic() - started:.1f}s after the start")
    db = ns.db("audit")
    wait_until("50 events applied", lambda: count_rows(db, "inbox") >= 50, procs=[proc])
    wait_until("the node's metric", lambda: node_metric(port, broker_node(ns)) == 1, procs=[proc], ignoring=(OSError,))
    err = stop(proc)
    assert applied_once(db, 50)
    assert "reconnecting in" not in err, err  # no backoff: the next address was tried in the same attempt


def test_a_reconnect_after_losing_a_node_starts_with_the_next(ns: Namespace, proxies: list[Proxy]) -> None:
    """Connected through the first address, its connection reset (the address still answers): run's next
    consuming connection goes to the second address, not the first again (log line and metric name it);
    every event applied exactly once."""
    a, b = proxies
    ns.publish(events(100), declare=["audit"])
    port = free_port()
    proc = ns.start_run("audit", "--metrics-port", str(port), env=ns.env(DELIVERY_AMQP_URL=f"{a.url},{b.url}"))
    proc.wait_for_log(f"connected to 127.0.0.1:{a.port}")
    db = ns.db("audit")
    wait_until("100 events applied", lambda: count_rows(db, "inbox") >= 100, procs=[proc])
    lost = time.monotonic()
    a("reset")
    proc.wait_for_log(f"connected to 127.0.0.1:{b.port}")
    print(f"connected to the next node {time.monotonic() - lost:.1f}s after the connection was reset")
    wait_until("the second node's metric 1", lambda: node_metric(port, f"127.0.0.1:{b.port}") == 1, procs=[proc])
    assert 0 == node_metric(port, f"127.0.0.1:{a.port}")
    ns.publish(events(100))
    wait_until("200 events applied", lambda: count_rows(db, "inbox") >= 200, procs=[proc])
    stop(proc)
    assert applied_once(db, 200)
