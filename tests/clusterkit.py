"""A three-node RabbitMQ cluster of the test session's own, for the tests of ``tests/cluster/``.

Three private nodes (:class:`~brokerkit.RabbitNode`: their own names, AMQP and
distribution ports, data and log directories in pytest's tmp dir) share one
Erlang cookie and are joined into one cluster with
``cluster_partition_handling = pause_minority``. A test kills a node hard
(SIGKILL of its ``beam.smp``), stops it gracefully or only its RabbitMQ
application, freezes it (SIGSTOP), starts it again, and asks who leads a
quorum queue. The shared broker on 5672 is never touched.

The fixture ``rabbit_cluster`` starts the cluster once per session (only when a
cluster test runs) and stops every node at the end, whatever happened; a test
leaves the cluster whole again (``heal``), which the fixture ``cluster_ns``
checks before and after each test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pika
import pytest
from brokerkit import Namespace, RabbitNode, rabbitmq_sbin, session_processes
from support import wait_until

#: What every node of the cluster is configured with: a minority pauses itself rather
#: than serve a split brain (docs/cluster.md).
CLUSTER_CONF = "cluster_partition_handling = pause_minority\n"

#: Few scheduler threads and async I/O threads per node: three nodes and the tests
#: share two cores with everything else on the machine.
ERL_ARGS = "+S 1:1 +SDcpu 1:1 +SDio 2 +A 4 +sbwt none +sbwtdcpu none +sbwtdio none"


def _ppid_and_comm(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    head, _, tail = stat.rpartition(b")")
    comm = head.partition(b"(")[2].decode(errors="replace")
    fields = tail.split()
    if fields[0] == b"Z":
        return None
    return int(fields[1]), comm


class ClusterNode(RabbitNode):
    """One node of a :class:`RabbitCluster`."""

    def __init__(self, sbin: Path, base: Path, *, index: int, tag: str, home: Path) -> None:
        super().__init__(sbin, base, name=f"dc{index}-{tag}@localhost", home=home, conf=CLUSTER_CONF,
                         extra_env={"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": ERL_ARGS})
        self.index = index

    def __repr__(self) -> str:
        return f"<node {self.name} :{self.port}>"

    @property
    def running(self) -> bool:
        """The node's process is alive (it may be paused, or its application stopped)."""
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        """Start the node's process without waiting for it."""
        assert not self.running, f"{self} is running already"
        with open(self.base / "server.out", "ab") as out:
            self.proc = subprocess.Popen([str(self.sbin / "rabbitmq-server")], env=self.env, cwd=self.base,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout: float = 120.0) -> None:
        """Wait until the node takes AMQP connections (fails with its log if it exits)."""
        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = (self.base / "server.out").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{self} exited ({self.proc.returncode}):\n{log}")
            pika.BlockingConnection(pika.URLParameters(self.url)).close()
            return True

        wait_until(f"{self} to take connections", answers, timeout=timeout,
                   ignoring=(pika.exceptions.AMQPError, OSError), interval=0.2)

    def ctl_out(self, *args: str, timeout: float = 60.0, tool: str = "rabbitmqctl") -> str:
        """``rabbitmqctl -n <node> ARGS`` (or another CLI tool); its stdout. Fails with its stderr."""
        done = subprocess.run([str(self.sbin / tool), "-n", self.name, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{tool} {' '.join(args)} on {self}: {done.stderr or done.stdout}"
        return done.stdout

    def beam_pid(self) -> int:
        """The PID of the node's Erlang VM (``beam.smp``, the child of the start script)."""
        assert self.proc is not None and self.proc.poll() is None, f"{self} is not running"
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                found = _ppid_and_comm(int(entry.name))
                if found and found[0] == self.proc.pid and found[1].startswith("beam"):
                    return int(entry.name)
        raise AssertionError(f"no beam.smp under {self}'s start script {self.proc.pid}")

    # -- what a scenario does to a node --
    def kill(self) -> None:
        """SIGKILL the node's Erlang VM (a crash, a power loss: no goodbye to
        clients or peers), then reap what it leaves."""
        os.kill(self.beam_pid(), signal.SIGKILL)
        self._reap()

    def shutdown(self) -> None:
        """Stop the node gracefully (``rabbitmqctl shutdown``: connections closed,
        leaderships handed over) and wait until its process has ended."""
        self.ctl_out("shutdown", timeout=120)
        self._reap()

    def _reap(self) -> None:
        proc = self.proc
        assert proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        with contextlib.suppress(ProcessLookupError):  # epmd registration helpers, erl_child_setup
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.proc = None

    def stop_app(self) -> None:
        """Stop the RabbitMQ application only (the Erlang node stays in the cluster)."""
        self.ctl_out("stop_app", timeout=120)

    def start_app(self) -> None:
        self.ctl_out("start_app", timeout=120)
        self.wait_up()

    def pause(self) -> None:
        """SIGSTOP the Erlang VM: the node keeps its sockets open and answers nothing."""
        os.kill(self.beam_pid(), signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.beam_pid(), signal.SIGCONT)

    def stop(self) -> None:
        """Whatever state the node is in: stopped, nothing of it left running."""
        if self.running:
            with contextlib.suppress(AssertionError, OSError):
                self.resume()
        super().stop()


class RabbitCluster:
    """Three :class:`ClusterNode` joined into one cluster; ``nodes[0]`` is the one the others joined."""

    def __init__(self, sbin: Path, base: Path, size: int = 3) -> None:
        tag = uuid.uuid4().hex[:6]
        home = base / "home"
        home.mkdir(parents=True, exist_ok=True)
        (home / ".erlang.cookie").write_text(uuid.uuid4().hex.upper())
        (home / ".erlang.cookie").chmod(0o400)
        self.nodes = [ClusterNode(sbin, base / f"dc{i}", index=i, tag=tag, home=home) for i in range(1, size + 1)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url_list(self) -> str:
        """Every node's URL, comma-separated (what ``--amqp-url`` takes for several nodes)."""
        return ",".join(self.urls)

    def node(self, name_or_port: str | int) -> ClusterNode:
        for n in self.nodes:
            if name_or_port in (n.name, n.port, n.name.partition("@")[0]):
                return n
        raise KeyError(name_or_port)

    def up(self) -> list[ClusterNode]:
        """The nodes whose process runs and whose application takes connections now."""
        return [n for n in self.nodes if n.running and _takes_connections(n.url)]

    def start(self) -> None:
        """Start every node, join the others to the first, and wait until all run in one cluster."""
        for n in self.nodes:
            n.launch()
        _parallel([n.wait_up for n in self.nodes])

        def join(n: ClusterNode) -> None:
            n.stop_app()
            n.ctl_out("join_cluster", self.nodes[0].name, timeout=120)
            n.start_app()

        _parallel([lambda n=n: join(n) for n in self.nodes[1:]])  # type: ignore[misc]
        self.wait_whole()

    def running_nodes(self, via: ClusterNode | None = None) -> set[str]:
        """The nodes the cluster counts as running (asked of *via*, else any node that answers)."""
        for n in [via] if via else [n for n in self.nodes if n.running]:
            status = orjson.loads(n.ctl_out("cluster_status", "--formatter", "json"))
            return set(status.get("running_nodes", []))
        return set()

    def wait_whole(self, timeout: float = 180.0) -> None:
        """Wait until every node runs, takes connections and sees the others running."""
        names = {n.name for n in self.nodes}

        def whole() -> bool:
            return all(n.running and _takes_connections(n.url) and self.running_nodes(n) == names
                       for n in self.nodes)

        wait_until("all three nodes running in one cluster", whole, timeout=timeout, ignoring=(AssertionError,),
                   interval=0.3)

    def heal(self) -> None:
        """Bring every node back: resumed, its process started, its application started; then whole."""
        for n in self.nodes:
            if n.running:
                with contextlib.suppress(AssertionError, OSError):
                    n.resume()
        for n in self.nodes:
            if not n.running:
                n.launch()
        for n in self.nodes:
            if not _takes_connections(n.url):
                with contextlib.suppress(AssertionError):
                    n.ctl_out("start_app", timeout=120)
        self.wait_whole()

    def stop(self) -> None:
        """Stop every node; nothing of the cluster is left running."""
        _parallel([n.stop for n in self.nodes], reraise=False)

    # -- quorum queues --
    def queues(self, via: ClusterNode | None = None, vhost: str = "/") -> dict[str, dict[str, Any]]:
        """Every queue of *vhost* as the cluster reports it: type, leader, members, online members."""
        asked = via or next(n for n in self.nodes if n.running and _takes_connections(n.url))
        rows = orjson.loads(asked.ctl_out("list_queues", "-p", vhost, "name", "type", "leader", "members",
                                          "online", "messages", "--formatter", "json"))
        return {r["name"]: r for r in rows}

    def leader(self, queue: str, vhost: str = "/") -> ClusterNode:
        """The node that leads quorum queue *queue* now (waits while an election is under way)."""
        def elected() -> ClusterNode | None:
            row = self.queues(vhost=vhost).get(queue)
            assert row is not None, f"no queue {queue}"
            leader = row.get("leader")
            return self.node(leader) if leader and leader != "" else None

        return wait_until(f"a leader of {queue}", elected, timeout=60, ignoring=(KeyError,))

    def wait_members_online(self, queue: str, count: int = 3, vhost: str = "/", timeout: float = 120.0) -> None:
        """Wait until *count* members of quorum queue *queue* are online (a restarted member caught up)."""
        wait_until(f"{count} members of {queue} online",
                   lambda: len(self.queues(vhost=vhost)[queue].get("online") or []) >= count, timeout=timeout,
                   ignoring=(KeyError, AssertionError, StopIteration), interval=0.3)


def _takes_connections(url: str) -> bool:
    try:
        pika.BlockingConnection(pika.URLParameters(url + "?connection_attempts=1&socket_timeout=2"
                                                   "&blocked_connection_timeout=2")).close()
    except (pika.exceptions.AMQPError, OSError):
        return False
    return True


def _parallel(calls: Sequence[Callable[[], object]], *, reraise: bool = True) -> None:
    """Run *calls* in threads; the first failure is raised once all have ended."""
    errors: list[BaseException] = []

    def call(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(fn,), daemon=True) for fn in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and reraise:
        raise errors[0]


@pytest.fixture(scope="session")
def rabbit_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitCluster]:
    """Three private RabbitMQ nodes in one cluster, started once for the session's cluster
    tests; every node stopped at the end (even on failure). Skips when RabbitMQ is not
    installed (fails under DELIVERY_REQUIRE_BROKER)."""
    sbin = rabbitmq_sbin()
    if sbin is None:
        if os.environ.get("DELIVERY_REQUIRE_BROKER"):
            pytest.fail("a RabbitMQ cluster is required but rabbitmq-server is not installed "
                        "(set DELIVERY_RABBITMQ_SBIN to its directory)")
        pytest.skip("rabbitmq-server not installed; set DELIVERY_RABBITMQ_SBIN to its directory")
    cluster = RabbitCluster(sbin, tmp_path_factory.mktemp("rabbit-cluster"))
    try:
        began = time.monotonic()
        cluster.start()
        print(f"\nthree-node cluster up in {time.monotonic() - began:.1f}s: {cluster.url_list}")
        yield cluster
    finally:
        cluster.stop()


@dataclass
class ClusterNamespace(Namespace):
    """A :class:`~brokerkit.Namespace` on the cluster: the CLI processes it starts are given every
    node's address (``DELIVERY_AMQP_URL``, comma-separated); the test's own connections
    (counting, draining, deleting) go to whichever node takes them."""

    cluster: RabbitCluster | None = None

    def env(self, **extra: str) -> dict[str, str]:
        assert self.cluster is not None
        return super().env(**{"DELIVERY_AMQP_URL": self.cluster.url_list, **extra})

    def channel(self) -> Any:
        assert self.cluster is not None
        conn = pika.BlockingConnection([pika.URLParameters(u) for u in self.cluster.urls])
        return conn, conn.channel()


@pytest.fixture
def cluster_ns(rabbit_cluster: RabbitCluster, tmp_path: Path) -> Iterator[ClusterNamespace]:
    """A namespace on the cluster, its processes given every node's address; the cluster
    is whole before the test and made whole again after it, the namespace deleted."""
    rabbit_cluster.heal()
    space = ClusterNamespace(rabbit_cluster.nodes[0].url, f"t{uuid.uuid4().hex[:10]}", tmp_path,
                             cluster=rabbit_cluster)
    yield space
    for proc in space.started:
        if session_processes(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    rabbit_cluster.heal()
    space.delete()
