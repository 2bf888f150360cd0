"""``run``, ``dispatch`` and the broker commands behind a TCP proxy that fails
on command (tests/tcpproxy.py): refused, accepted then closed, silent,
half-open and slow connections are waited out, never a configuration error."""

from __future__ import annotations

import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace, RunProcess
from support import count_rows, new_event, read_rows, wait_until
from tcpproxy import Proxy

from delivery_consumer.amqp.connection import HANDSHAKE_TIMEOUT_S, HEARTBEAT_S
from delivery_consumer.outbox import demo_producer as producer

#: pika closes a connection on which nothing arrived for one check interval
#: (heartbeat + 5 s), checked every interval: the bound docs/amqp.md states.
DETECTION_BOUND_S = 2 * (HEARTBEAT_S + 5)

#: What run and dispatch log for each way the proxy fails a new connection.
FIRST_WORDS = {
    "refuse": "broker unreachable",
    "close": "closed before the AMQP handshake",
    "blackhole": "no AMQP handshake within the connection timeout",
}


@pytest.fixture
def proxy(ns: Namespace) -> Iterator[Proxy]:
    """A proxy in front of the test's broker, forwarding; killed afterwards."""
    p = Proxy(ns.url)
    yield p
    p.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connected(port: int, series: str = 'delivery_connected{consumer="audit"}') -> float | None:
    """The value of *series* on /metrics (None when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rpartition(" ")[2])
    return None


def events(n: int) -> list[bytes]:
    return [orjson.dumps(new_event(article_id=f"a-{i % 50}")) for i in range(n)]


def applied_once(db: Path, n: int) -> bool:
    return [(n, n)] == read_rows(db, "audit", "count(*), count(DISTINCT event_id)") and \
        [(n,)] == read_rows(db, "inbox", "count(*)")


def stop(proc: RunProcess) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert 0 == proc.returncode, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return err


@pytest.mark.parametrize("mode", ["refuse", "close", "blackhole"])
def test_run_waits_out_a_broker_it_cannot_reach_and_consumes_when_it_answers(
        ns: Namespace, proxy: Proxy, mode: str) -> None:
    """A proxy refusing, closing or never answering new connections: run logs it once, keeps trying,
    shows delivery_connected 0, and consumes every event exactly once when the proxy forwards again."""
    ns.publish(events(200), declare=["audit"])
    proxy(mode)
    port = free_port()
    proc = ns.start_run("audit", "--metrics-port", str(port), env=ns.env(DELIVERY_AMQP_URL=proxy.url))
    proc.wait_for_log(FIRST_WORDS[mode], timeout=HANDSHAKE_TIMEOUT_S + 60)
    wait_until("delivery_connected 0", lambda: connected(port) == 0, procs=[proc], ignoring=(OSError,))
    wait_until("a second attempt", lambda: proxy.accepted() >= 2 or mode == "refuse", procs=[proc])
    proxy("forward")
    db = ns.db("audit")
    wait_until("200 events applied", lambda: count_rows(db, "inbox") >= 200, procs=[proc], timeout=120)
    wait_until("delivery_connected 1", lambda: connected(port) == 1, procs=[proc])
    ns.publish(events(100))
    wait_until("300 events applied", lambda: count_rows(db, "inbox") >= 300, procs=[proc])
    err = stop(proc)
    assert applied_once(db, 300)
    assert 1 == sum(FIRST_WORDS[mode] in line for line in err.splitlines()), err  # once per change of state
    assert "broker reachable again" in err
    assert "not an AMQP" not in err


def test_sigterm_while_run_checks_the_layout_exits_0(ns: Namespace, proxy: Proxy) -> None:
    """SIGTERM while run asks a silent broker which layout the consumer has (before any worker): exit 0."""
    proxy("blackhole")
    proc = ns.start_run("audit", env=ns.env(DELIVERY_AMQP_URL=proxy.url))
    wait_until("the layout check's connection accepted", lambda: proxy.accepted() >= 1, procs=[proc])
    err = stop(proc)
    assert "received before consuming: stopping" in err, err


def test_sigterm_while_the_handshake_is_pending_exits_0(ns: Namespace, proxy: Proxy) -> None:
    """SIGTERM to a run whose connection was accepted and never answered: exit 0, no traceback."""
    proxy("blackhole")
    proc = ns.start_run("audit", env=ns.env(DELIVERY_AMQP_URL=proxy.url))
    # the first connection is run's layout check (it times out on a silent broker and run goes on);
    # the second is the consumer's: the worker is up and the connection process waits for the handshake
    wait_until("the consumer's connection accepted", lambda: proxy.accepted() >= 2, procs=[proc])
    stop(proc)


@pytest.mark.slow
def test_run_detects_a_half_open_connection_and_reconnects(ns: Namespace, proxy: Proxy) -> None:
    """An established connection that goes silent (nothing forwarded either way) is detected within
    the heartbeat bound, logged, and replaced; every event is applied exactly once."""
    ns.publish(events(100), declare=["audit"])
    proc = ns.start_run("audit", env=ns.env(DELIVERY_AMQP_URL=proxy.url))
    db = ns.db("audit")
    wait_until("100 events applied", lambda: count_rows(db, "inbox") >= 100, procs=[proc])
    proxy("halfopen")
    frozen = time.monotonic()
    ns.publish(events(100))
    proc.wait_for_log("nothing heard from the broker", timeout=DETECTION_BOUND_S + 30)
    detected = time.monotonic() - frozen
    wait_until("200 events applied", lambda: count_rows(db, "inbox") >= 200, procs=[proc])
    stop(proc)
    assert applied_once(db, 200)
    print(f"half-open connection detected after {detected:.1f}s (bound {DETECTION_BOUND_S}s)")


@pytest.mark.slow
def test_a_silent_broker_shows_delivery_connected_0_until_it_answers(ns: Namespace, proxy: Proxy) -> None:
    """The broker goes silent under a consuming run (established and new connections): delivery_connected
    turns 0 within the heartbeat bound and back to 1 within a few seconds of the broker's return."""
    ns.publish(events(50), declare=["audit"])
    port = free_port()
    proc = ns.start_run("audit", "--metrics-port", str(port), env=ns.env(DELIVERY_AMQP_URL=proxy.url))
    db = ns.db("audit")
    wait_until("50 events applied", lambda: count_rows(db, "inbox") >= 50, procs=[proc])
    wait_until("delivery_connected 1", lambda: connected(port) == 1, procs=[proc], ignoring=(OSError,))
    proxy("blackhole")
    wait_until("delivery_connected 0", lambda: connected(port) == 0, procs=[proc], timeout=DETECTION_BOUND_S + 30)
    ns.publish(events(50))
    proxy("forward")
    back = time.monotonic()
    wait_until("delivery_connected 1 again", lambda: connected(port) == 1, procs=[proc], timeout=60)
    print(f"consuming again {time.monotonic() - back:.1f}s after the broker answered again")
    wait_until("100 events applied", lambda: count_rows(db, "inbox") >= 100, procs=[proc])
    stop(proc)
    assert applied_once(db, 100)


def test_run_through_a_slow_connection_applies_everything_once(ns: Namespace, proxy: Proxy) -> None:
    """Every chunk delayed 50 ms each way: run keeps consuming, every event applied exactly once."""
    ns.publish(events(300), declare=["audit"])
    proxy("slow 0.05")
    proc = ns.start_run("audit", "--batch", "50", "--prefetch", "100", env=ns.env(DELIVERY_AMQP_URL=proxy.url))
    db = ns.db("audit")
    wait_until("300 events applied", lambda: count_rows(db, "inbox") >= 300, procs=[proc], timeout=120)
    stop(proc)
    assert applied_once(db, 300)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_answer_while_the_worker_is_stuck_and_say_so(ns: Namespace) -> None:
    """A worker stuck inside a batch: /metrics (served by the connection process) still answers at once,
    its heartbeat timestamp stays behind, and catches up when the worker goes on."""
    import flaky_consumer  # noqa: F401  (registers the "flaky" consumer in this process too)

    flaky = ns.workdir / "flaky"
    env = ns.env(DELIVERY_PLUGINS="flaky_consumer", FLAKY_DIR=str(flaky))
    ns.publish([orjson.dumps(new_event(title="stall"))], declare=["flaky"])
    port = free_port()
    proc = ns.start_run("flaky", "--metrics-port", str(port), env=env)
    beat = 'delivery_worker_heartbeat_timestamp_seconds{consumer="flaky"}'
    wait_until("the worker stalled", lambda: (flaky / "stalled").exists(), procs=[proc])
    stuck_since = time.time()
    behind = wait_until("a heartbeat 3s behind", lambda: (m := scrape(port)) and time.time() - m[beat] > 3 and m,
                        procs=[proc], ignoring=(OSError,))
    assert behind[beat] <= stuck_since
    assert 1 == behind['delivery_connected{consumer="flaky"}']
    (flaky / "release").touch()
    wait_until("a fresh heartbeat", lambda: scrape(port)[beat] > stuck_since, procs=[proc])
    wait_until("the event applied", lambda: count_rows(ns.db("flaky"), "flaky") == 1, procs=[proc])
    stop(proc)


# -- dispatch ------------------------------------------------------------------------------


def start_dispatch(ns: Namespace, db: Path, url: str, *args: str) -> RunProcess:
    cmd = [sys.executable, "-m", "delivery_consumer", "dispatch", "--db", str(db), "--consumer", "catalog", *args]
    proc = RunProcess(cmd, cwd=ns.workdir, env=ns.env(DELIVERY_AMQP_URL=url))
    ns.started.append(proc)
    return proc


def produce(db: Path, n: int, start: int = 0) -> None:
    conn = producer.open_db(db)
    try:
        for i in range(start, start + n):
            producer.produce(conn, f"article-{i % 30}", title=f"t{i}", url=f"https://example.org/{i}")
    finally:
        conn.close()


def published(db: Path) -> int:
    return count_rows(db, "outbox", "published_at IS NOT NULL")


def consumed_once(ns: Namespace, db: Path) -> None:
    """The catalog consumer applies every row of the outbox exactly once."""
    done = ns.run_until_idle("catalog", idle=1.0)
    assert 0 == done.returncode, done.stderr[-2000:]
    ids = {row[0] for row in read_rows(db, "outbox", "event_id")}
    inbox = read_rows(ns.db("catalog"), "inbox", "event_id")
    assert sorted(ids) == [row[0] for row in inbox]


@pytest.mark.parametrize("mode", ["refuse", "close", "blackhole"])
def test_dispatch_waits_out_a_broker_it_cannot_reach(ns: Namespace, proxy: Proxy, mode: str) -> None:
    """dispatch behind a proxy that refuses, closes or never answers: it keeps running, logs the outage
    once, shows outbox_dispatch_connected 0, and publishes every row once the proxy forwards again."""
    db = ns.workdir / "producer.db"
    produce(db, 50)
    ns.cli("topology", "declare", "--consumer", "catalog")
    proxy(mode)
    port = free_port()
    proc = start_dispatch(ns, db, proxy.url, "--poll", "50ms", "--metrics-port", str(port))
    proc.wait_for_log(FIRST_WORDS[mode], timeout=HANDSHAKE_TIMEOUT_S + 60)
    wait_until("outbox_dispatch_connected 0", lambda: connected(port, "outbox_dispatch_connected") == 0,
               procs=[proc], ignoring=(OSError,))
    proxy("forward")
    wait_until("50 rows published", lambda: published(db) >= 50, procs=[proc], timeout=120)
    assert 1 == connected(port, "outbox_dispatch_connected")
    produce(db, 50, start=50)
    wait_until("100 rows published", lambda: published(db) >= 100, procs=[proc])
    err = stop(proc)
    assert 1 == sum(FIRST_WORDS[mode] in line for line in err.splitlines()), err
    assert "broker reachable again" in err
    consumed_once(ns, db)


def test_dispatch_stops_at_once_on_sigterm_while_the_handshake_is_pending(ns: Namespace, proxy: Proxy) -> None:
    """SIGTERM to a dispatcher whose connection was accepted and never answered: exit 0, without waiting for
    the handshake timeout (which would log the outage), no traceback."""
    db = ns.workdir / "producer.db"
    produce(db, 5)
    proxy("blackhole")
    proc = start_dispatch(ns, db, proxy.url, "--poll", "50ms")
    wait_until("the connection accepted", lambda: proxy.accepted() >= 1, procs=[proc])
    proc.wait_for_log("dispatching")
    err = stop(proc)
    assert "no AMQP handshake" not in err, err
    assert 0 == published(db)


@pytest.mark.slow
def test_dispatch_through_a_half_open_connection_publishes_everything(ns: Namespace, proxy: Proxy) -> None:
    """The dispatcher's connection goes half-open while rows keep coming: it gives the connection up,
    reconnects, and every row is published and consumed exactly once."""
    db = ns.workdir / "producer.db"
    produce(db, 20)
    ns.cli("topology", "declare", "--consumer", "catalog")
    proc = start_dispatch(ns, db, proxy.url, "--poll", "50ms")
    wait_until("20 rows published", lambda: published(db) >= 20, procs=[proc])
    proxy("halfopen")
    produce(db, 30, start=20)
    wait_until("50 rows published", lambda: published(db) >= 50, procs=[proc], timeout=DETECTION_BOUND_S + 90)
    stop(proc)
    consumed_once(ns, db)


def test_dispatch_through_a_slow_connection_publishes_everything(ns: Namespace, proxy: Proxy) -> None:
    """Every chunk delayed 50 ms each way: every row is published, and consumed exactly once."""
    db = ns.workdir / "producer.db"
    produce(db, 200)
    ns.cli("topology", "declare", "--consumer", "catalog")
    proxy("slow 0.05")
    proc = start_dispatch(ns, db, proxy.url, "--poll", "50ms")
    wait_until("200 rows published", lambda: published(db) >= 200, procs=[proc], timeout=120)
    stop(proc)
    consumed_once(ns, db)


# -- the broker commands -------------------------------------------------------------------


@pytest.mark.parametrize("command", [
    ["dead", "list", "--consumer", "catalog"],
    ["dead", "requeue", "--consumer", "catalog", "--all", "--db", "{db}"],
    ["dead", "purge", "--consumer", "catalog", "--all", "--db", "{db}"],
    ["inbox", "prune", "--consumer", "catalog", "--older-than", "30d", "--db", "{db}"],
    ["reroute", "--consumer", "catalog"],
])
def test_a_broker_command_answers_a_silent_broker_with_one_line(
        ns: Namespace, proxy: Proxy, command: list[str]) -> None:
    """A broker that accepts TCP and never answers: the command says so in one line, no traceback."""
    init = ns.cli("init", "--consumer", "catalog", "--db", str(ns.db("catalog")))
    assert 0 == init.returncode, init.stderr
    proxy("blackhole")
    args = [str(ns.db("catalog")) if arg == "{db}" else arg for arg in command]
    done = ns.cli(*args, env=ns.env(DELIVERY_AMQP_URL=proxy.url), timeout=120)
    assert done.returncode not in (0, 1), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert 1 == len(lines), done.stderr
    assert "no AMQP handshake" in lines[0], lines


def test_status_does_not_call_a_closing_proxy_a_non_amqp_server(ns: Namespace, proxy: Proxy) -> None:
    """A connection accepted and closed before the handshake is reported as that, not as a wrong server."""
    from deploykit import dc, write_deployment

    config = write_deployment(ns.workdir, ns=Namespace(proxy.url, ns.prefix, ns.workdir), consumers=("catalog",))
    proxy("close")
    done = dc(config, "status")
    assert 1 == done.returncode, done.stdout + done.stderr
    assert "closed before the AMQP handshake" in done.stdout + done.stderr
    assert "not an AMQP" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr
