"""``status`` during outages tells the truth: a queue that cannot be read, a broker that
does not answer (within a bounded time), ghost consumers (listed, consuming nothing), a
quorum lost (management API), each red with exit 1; healthy stays healthy (exit 0)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from brokerkit import Namespace, RabbitNode, free_port, rabbitmq_sbin, wait_for_broker
from deploykit import dc, run_until_idle, write_deployment
from support import new_event, wait_until
from tcpproxy import Proxy

from delivery_consumer import consumers
from delivery_consumer.amqp import admin
from delivery_consumer.amqp.management import parse_queue

pytestmark = pytest.mark.broker


def _status(config: Path, *args: str, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    done = dc(config, "status", "--json", *args, timeout=timeout)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, orjson.loads(done.stdout)


def _row(shown: dict[str, Any], consumer: str = "catalog") -> dict[str, Any]:
    return next(c for c in shown["consumers"] if c["consumer"] == consumer)["databases"][0]


def test_a_queue_that_cannot_be_read_is_red_and_healthy_stays_healthy(ns: Namespace, tmp_path: Path) -> None:
    """The dead queue held by another connection (405 RESOURCE_LOCKED on its passive declare, as a
    queue on a node that is down answers 404): status exits 1, names the queue and why, shows it
    UNREADABLE (not "-" and healthy), and says leaders are unknown without a management API. Once the
    queue can be read again, and every event is applied: exit 0, every queue readable."""
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",))
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    dead = ns.topology("catalog").dead_queue
    conn, ch = ns.channel()
    try:
        ch.queue_delete(dead)
        ch.queue_declare(dead, exclusive=True)  # only this connection may touch it now
        code, shown = _status(config)
        assert 1 == code
        row = _row(shown)
        [asked] = [q for q in row["queues"] if q["queue"] == dead]
        assert asked["readable"] is False and "405 RESOURCE_LOCKED" in asked["error"], asked
        assert row["readable"] is True  # the main queue answers
        assert any(p.startswith(f"catalog: queue {dead} cannot be read: unavailable (405") for p in shown["problems"])
        text = dc(config, "status")
        assert 1 == text.returncode
        assert "UNREADABLE" in text.stdout and "leaders and members online unknown" in text.stdout, text.stdout
    finally:
        conn.close()  # the exclusive queue goes with its connection
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    ns.publish([orjson.dumps(new_event(article_id="h1"))])
    assert 0 == run_until_idle(config, "catalog").returncode
    code, shown = _status(config)
    assert (0, []) == (code, shown["problems"]), shown["problems"]
    assert all(q["readable"] for q in _row(shown)["queues"]), _row(shown)["queues"]
    text = dc(config, "status")
    assert 0 == text.returncode and "healthy" in text.stdout


def test_a_silent_broker_costs_status_one_deadline_not_minutes(ns: Namespace, tmp_path: Path) -> None:
    """Through a proxy that accepts and never answers (a paused node): status with --broker-timeout 1
    ends within a few seconds, exit 1, every queue "unavailable (no answer within 1s)"."""
    proxy = Proxy(ns.url)
    try:
        proxy("blackhole")
        config = write_deployment(tmp_path, consumers=("catalog",), extra="\n".join([
            f'amqp_url = "{proxy.url}"', f'exchange = "{ns.exchange}"', f'queue_prefix = "{ns.prefix}"']))
        started = time.monotonic()
        code, shown = _status(config, "--broker-timeout", "1")
        took = time.monotonic() - started
        assert 1 == code
        assert "unavailable (no answer within 1s)" == shown["broker"]["error"]
        assert "broker: unavailable (no answer within 1s)" in shown["problems"]
        assert took < 10, took  # python's start-up and one deadline, not a minute
    finally:
        proxy.close()


def test_a_silent_first_address_costs_one_deadline_and_the_next_answers(ns: Namespace, tmp_path: Path) -> None:
    """amqp_url a list whose first node accepts and never answers: status asks the next one after
    one deadline (--broker-timeout 1) and is healthy, every queue readable."""
    proxy = Proxy(ns.url)
    try:
        proxy("blackhole")
        config = write_deployment(tmp_path, consumers=("catalog",), extra="\n".join([
            f'amqp_url = ["{proxy.url}", "{ns.url}"]', f'exchange = "{ns.exchange}"',
            f'queue_prefix = "{ns.prefix}"']))
        assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
        started = time.monotonic()
        code, shown = _status(config, "--broker-timeout", "1")
        took = time.monotonic() - started
        assert (0, []) == (code, shown["problems"])
        assert all(q["readable"] for q in _row(shown)["queues"]), _row(shown)["queues"]
        assert took < 10, took
    finally:
        proxy.close()


def test_a_declare_that_does_not_answer_is_cut_at_its_deadline_and_the_rest_asked_again(ns: Namespace) -> None:
    """A connection that goes silent after its handshake (half-open): the passive declare waiting on it
    ends at the deadline, that queue unreadable, the next ones asked on a new connection (unreadable too
    when that one cannot be made in time either)."""
    proxy = Proxy(ns.url)
    try:
        conn = admin._open(proxy.url, "test", 1.0)
        proxy("halfopen")
        out: dict[str, admin.QueueState] = {}
        started = time.monotonic()
        left = admin._declare_each(conn, ["a", "b"], out, 1.0)
        assert 0.9 < time.monotonic() - started < 3
        assert ({"a": admin.Unreadable("unavailable (no answer within 1s)")}, ["b"]) == (out, left)
        assert not conn.is_open
        proxy("blackhole")
        started = time.monotonic()
        states = admin.queue_states(proxy.url, ["a", "b"], timeout_s=1.0)
        assert time.monotonic() - started < 3
        assert {q: admin.Unreadable("unavailable (no answer within 1s)") for q in "ab"} == states
    finally:
        proxy.close()


def test_ghost_consumers_with_a_backlog_and_no_receipt_are_red(ns: Namespace, tmp_path: Path) -> None:
    """A consumer attached that never acks (prefetch 2) while 6 events wait, and the consumer's database
    without a receipt, last written 10 minutes ago: status exits 1 naming ghost consumers; the same
    within --receipt-max-age of the last write is not flagged; once a real run applies everything
    (the ghost gone): healthy."""
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",))
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    db_path = tmp_path / "state" / "catalog" / "inbox.db"
    db_path.parent.mkdir(parents=True)
    with consumers.open_db(db_path, "catalog", create=True):
        pass
    old = time.time() - 600
    for path in db_path.parent.iterdir():
        os.utime(path, (old, old))
    ns.publish([orjson.dumps(new_event(article_id=f"g{i}")) for i in range(6)])
    queue = ns.topology("catalog").queue
    conn, ch = ns.channel()
    try:
        ch.basic_qos(prefetch_count=2)
        ch.basic_consume(queue, lambda *a: None, auto_ack=False)
        conn.process_data_events(time_limit=0.5)
        code, shown = _status(config)
        assert 1 == code, _row(shown)
        row = _row(shown)
        assert (4, 1) == (row["ready"], row["consumersConnected"])
        [ghost] = [p for p in shown["problems"] if "ghost consumers" in p]
        assert ghost.startswith(f"catalog: 4 messages ready in {queue} with 1 consumer listed, but the newest "
                                "receipt (none yet; the database was last written) 10m"), ghost
        assert "GHOSTS" in dc(config, "status").stdout
        code, shown = _status(config, "--receipt-max-age", "1h")
        assert 0 == code, shown["problems"]
    finally:
        conn.close()  # the ghost gone: its unacked messages back to ready
    assert 0 == run_until_idle(config, "catalog").returncode
    code, shown = _status(config)
    assert (0, []) == (code, shown["problems"])


def test_the_management_api_parses_leaders_members_and_a_lost_quorum() -> None:
    """A quorum queue with 1 of 3 members online has lost its quorum, with 2 of 3 it has not; a
    classic queue's leader is its node, quorum not applicable (as the API's answers read)."""
    lost = parse_queue({"name": "q", "type": "quorum", "state": "running", "leader": "rabbit@a",
                        "members": ["rabbit@a", "rabbit@b", "rabbit@c"], "online": ["rabbit@a"],
                        "messages_unacknowledged": 3})
    assert (True, "rabbit@a", 3) == (lost.quorum_lost, lost.leader, lost.unacked)
    kept = parse_queue({"name": "q", "type": "quorum", "leader": "rabbit@b",
                        "members": ["rabbit@a", "rabbit@b", "rabbit@c"], "online": ["rabbit@b", "rabbit@c"]})
    assert kept.quorum_lost is False
    classic = parse_queue({"name": "d", "type": "classic", "state": "down", "node": "rabbit@c"})
    assert (None, "rabbit@c", True, None) == (classic.quorum_lost, classic.leader, classic.down, classic.unacked)


@pytest.fixture
def management_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RabbitNode, int]]:
    """A private RabbitMQ node with rabbitmq_management on a port of its own; stopped afterwards."""
    sbin = rabbitmq_sbin()
    if sbin is None:
        if os.environ.get("DELIVERY_REQUIRE_BROKER"):
            pytest.fail("rabbitmq-server is not installed")
        pytest.skip("rabbitmq-server not installed")
    node = RabbitNode(sbin, tmp_path_factory.mktemp("rabbitmq-management"))
    port = free_port()
    (node.base / "enabled_plugins").write_text("[rabbitmq_management].\n")
    (node.base / "rabbitmq.conf").write_text(f"management.tcp.port = {port}\nmanagement.tcp.ip = 127.0.0.1\n")
    try:
        node.start()
        yield node, port
    finally:
        node.stop()


@pytest.mark.timeout(300)
def test_status_shows_each_queues_leader_and_members_from_a_private_nodes_management_api(
        management_node: tuple[RabbitNode, int], tmp_path: Path) -> None:
    """A private node with the management plugin: status --management-url shows the main queue's
    leader (the node), 1/1 members online, no quorum lost, healthy. The node stopped: exit 1 within the
    deadline, the broker and the management API unavailable."""
    node, port = management_node
    wait_for_broker(node.url)
    space = Namespace(node.url, "delivery", tmp_path)
    config = write_deployment(tmp_path, ns=space, consumers=("catalog",))
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    api = f"http://127.0.0.1:{port}"
    code, shown = _status(config, "--management-url", api)
    assert (0, []) == (code, shown["problems"])
    row = _row(shown)
    node_name = node.name
    assert (node_name, [node_name], [node_name], False) == (
        row["leader"], row["members"], row["online"], row["quorumLost"]), row
    assert None is shown["broker"]["management"]["error"]
    text = dc(config, "status", "--management-url", api)
    assert 0 == text.returncode and "1/1" in text.stdout and node_name in text.stdout, text.stdout
    node.stop()
    started = time.monotonic()
    code, shown = _status(config, "--management-url", api, "--broker-timeout", "2")
    assert 1 == code and time.monotonic() - started < 15
    assert shown["broker"]["error"] and shown["broker"]["management"]["error"], shown["broker"]


COOKIE = "DELIVERYSTATUSTESTCOOKIE"


@pytest.fixture
def three_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[RabbitNode, int]]]:
    """Three private RabbitMQ nodes clustered together (one Erlang cookie), each with the management
    plugin on a port of its own; every one stopped afterwards. Never the shared broker."""
    sbin = rabbitmq_sbin()
    if sbin is None:
        if os.environ.get("DELIVERY_REQUIRE_BROKER"):
            pytest.fail("rabbitmq-server is not installed")
        pytest.skip("rabbitmq-server not installed")
    nodes: list[tuple[RabbitNode, int]] = []
    try:
        for i in range(3):
            node = RabbitNode(sbin, tmp_path_factory.mktemp(f"rabbitmq-cluster-{i}"))
            port = free_port()
            (node.base / "enabled_plugins").write_text("[rabbitmq_management].\n")
            (node.base / "rabbitmq.conf").write_text(
                f"management.tcp.port = {port}\nmanagement.tcp.ip = 127.0.0.1\n")
            cookie = node.base / "home" / ".erlang.cookie"
            cookie.write_text(COOKIE)
            cookie.chmod(0o400)
            nodes.append((node, port))
        for node, _ in nodes:
            node.start()
        first = nodes[0][0].name
        for node, _ in nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", first)
            node.ctl("start_app")
            wait_for_broker(node.url)
        yield nodes
    finally:
        for node, _ in nodes:
            node.stop()


@pytest.mark.timeout(600)
def test_on_a_three_node_cluster_status_is_red_exactly_while_a_quorum_is_lost(
        three_nodes: list[tuple[RabbitNode, int]], tmp_path: Path) -> None:
    """Three clustered private nodes, the main queues quorum queues on all three: healthy with 3/3
    online. Two nodes stopped: status (through the node left) exits 1 within its deadlines, the main
    queue NO QUORUM (1 of 3 online) or unreadable. One node back: 2/3 online, quorum kept, healthy
    again (exit 0). The node the dead queue lives on paused (SIGSTOP): status through another node
    is red within its deadlines (two declares cut, the queues after them not asked), a classic dead
    queue unreadable."""
    (first, api1), (second, api2), (third, _) = three_nodes
    space = Namespace(first.url, "delivery", tmp_path)
    config = write_deployment(tmp_path, ns=space, consumers=("catalog", "audit", "webhook"))
    assert 0 == dc(config, "topology", "declare").returncode  # through the first node: classic queues live there
    args = ("--management-url", f"http://127.0.0.1:{api1}", "--broker-timeout", "3")
    code, shown = _status(config, *args)
    assert (0, []) == (code, shown["problems"])
    row = _row(shown)
    assert (3, 3, False) == (len(row["members"]), len(row["online"]), row["quorumLost"]), row

    second.ctl("stop_app")
    third.ctl("stop_app")
    took: list[float] = []

    def red() -> dict[str, Any] | None:
        # The management API's figures are collected every few seconds: ask until they say it.
        started = time.monotonic()
        code, shown = _status(config, *args, timeout=120)
        took.append(time.monotonic() - started)
        return shown if code == 1 else None

    shown = wait_until("status red with two nodes of three stopped", red, timeout=120, interval=1)
    row = _row(shown)
    [main] = [q for q in row["queues"] if q["kind"] == "main"]
    assert main["quorumLost"] is True or main["readable"] is False, main
    assert any(row["queue"] in p and ("lost its quorum" in p or "cannot be read" in p) for p in shown["problems"])
    assert max(took) < 60, took
    text = dc(config, "status", *args, timeout=120)
    assert 1 == text.returncode and ("NO QUORUM" in text.stdout or "UNREADABLE" in text.stdout), text.stdout

    second.ctl("start_app")
    wait_for_broker(second.url)
    shown = wait_until("status healthy with two nodes of three", lambda: (
        lambda answer: answer[1] if answer[0] == 0 else None)(_status(config, *args, timeout=120)),
        timeout=120, interval=1)
    assert [] == shown["problems"]
    row = _row(shown)
    assert (3, 2, False) == (len(row["members"]), len(row["online"]), row["quorumLost"]), row

    # The first node (which declared the dead queue) paused (SIGSTOP: it holds its sockets and
    # answers nothing, the others wait for it until the cluster's tick times out), asked through
    # the second: every call cut at its deadline, red; a classic dead queue (its home node paused)
    # unreadable, a replicated one not necessarily.
    third.ctl("start_app")
    wait_for_broker(third.url)
    dead = next(q for q in row["queues"] if q["kind"] == "dead")
    (tmp_path / "via-second").mkdir()
    other = write_deployment(tmp_path / "via-second", ns=Namespace(second.url, "delivery", tmp_path),
                             consumers=("catalog", "audit", "webhook"))
    assert first.proc is not None
    os.killpg(first.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        code, shown = _status(other, "--management-url", f"http://127.0.0.1:{api2}", "--broker-timeout", "2",
                              timeout=120)
        took = time.monotonic() - started
    finally:
        os.killpg(first.proc.pid, signal.SIGCONT)
    assert 1 == code, shown
    assert took < 2 * (2 + 1) + 8, took  # the connection and two silent declares at most, python's start-up
    [asked] = [q for q in _row(shown)["queues"] if q["kind"] == "dead"]
    if dead["type"] == "classic":  # three dead queues on the paused node: two cut, the third not asked
        assert asked["readable"] is False, asked
        assert any(f"queue {asked['queue']} cannot be read" in p for p in shown["problems"]), shown["problems"]
        [webhook] = [q for q in _row(shown, "webhook")["queues"] if q["kind"] == "dead"]
        assert webhook["error"].startswith("not asked (2 queues before it did not answer within 2s)"), webhook
