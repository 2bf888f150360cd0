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
import datetime as dt
import itertools
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
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
from brokerkit import Namespace, RabbitNode, RunProcess, node_env, rabbitmq_sbin, session_processes
from partitionkit import Cluster as PartitionedConsumer
from support import count_rows, read_rows, wait_until

from delivery_consumer import outbox

#: What every node of the cluster is configured with: a minority pauses itself rather
#: than serve a split brain (docs/cluster.md).
CLUSTER_CONF = "cluster_partition_handling = pause_minority\n"

#: Few scheduler threads and async I/O threads per node: three nodes and the tests
#: share two cores with everything else on the machine.
ERL_ARGS = "+S 1:1 +SDcpu 1:1 +SDio 2 +A 4"


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


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def lasting_port() -> int:
    """A free loopback port below the kernel's ephemeral range. A node that is killed and started
    again needs its ports back, and a port the kernel handed out (``bind(0)``) goes, once freed, to
    the next outgoing connection of any process: the restart then fails with ``dist_port_already_used``."""
    rnd = random.Random()
    low = _ephemeral_low()
    for _ in range(1000):
        port = rnd.randrange(12000, max(12001, low - 1))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


class ClusterNode(RabbitNode):
    """One node of a :class:`RabbitCluster`, on ports of its own for its whole life (:func:`lasting_port`)."""

    def __init__(self, sbin: Path, base: Path, *, index: int, tag: str, home: Path) -> None:
        super().__init__(sbin, base, name=f"dc{index}-{tag}@localhost", home=home, conf=CLUSTER_CONF)
        self.index = index
        self.port, self.dist_port = lasting_port(), lasting_port()
        self.env = {**node_env(base, self.name, self.port, self.dist_port, home=home),
                    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": ERL_ARGS}

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
            # One node at a time: two joins at once meet in mnesia's schema transaction
            # (seen: "schema_prepare" refusing one of them). A join that failed anyway is
            # tried again from a reset node.
            n.stop_app()
            for attempt in range(3):
                try:
                    n.ctl_out("join_cluster", self.nodes[0].name, timeout=120)
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
                    n.ctl_out("reset", timeout=120)
            n.start_app()

        for n in self.nodes[1:]:
            join(n)
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
            for n in self.nodes:
                if n.proc is not None and n.proc.poll() is not None:
                    log = (n.base / "server.out").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{n} exited ({n.proc.returncode}):\n{log}")
            # The cheap checks first: each rabbitmqctl boots an Erlang VM (~0.6 s of a core), and
            # asking it while a node is still booting only slows that boot down.
            if not all(n.running and _takes_connections(n.url) for n in self.nodes):
                return False
            return all(self.running_nodes(n) == names for n in self.nodes)

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
            # Right after its leader's node died a quorum queue may be missing from list_queues
            # (listed as offline until the record names the new leader): not yet.
            row = self.queues(vhost=vhost).get(queue) or {}
            leader = row.get("leader")
            return self.node(leader) if leader else None

        return wait_until(f"a leader of {queue}", elected, timeout=60, ignoring=(KeyError,))

    def busiest(self) -> ClusterNode:
        """The node that holds the most client connections now (the one the clients use)."""
        rows = orjson.loads(self.up()[0].ctl_out("list_connections", "port", "--formatter", "json"))
        counts: dict[int, int] = {}
        for row in rows:  # the server's port the client connected to: the node's AMQP port
            counts[int(row["port"])] = counts.get(int(row["port"]), 0) + 1
        assert counts, "no client connection on the cluster"
        return self.node(max(counts, key=lambda n: counts[n]))

    def wait_queues_online(self, prefix: str, timeout: float = 120.0) -> None:
        """Wait until every quorum queue named *prefix*.* has a leader and every member online."""
        size = len(self.nodes)

        def online() -> bool:
            rows = [r for name, r in self.queues().items() if name.startswith(prefix + ".") and r["type"] == "quorum"]
            return bool(rows) and all(r.get("leader") and len(r.get("online") or []) == size for r in rows)

        wait_until(f"every member of the {prefix}.* quorum queues online", online, timeout=timeout,
                   ignoring=(AssertionError, StopIteration), interval=0.3)

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


# -- traffic and its ledger -------------------------------------------------------------------------------

#: How long consumption may stay stopped after a fault before the test fails: the toolkit must come
#: back by itself, with no person; how long it actually took is measured and printed, never asserted.
RESUME_BOUND = 60.0

#: The consumers every scenario runs: the catalog (idempotent by revision) and the counter (not
#: idempotent by itself: a second application of one event would count twice).
CONSUMERS = ("catalog", "counter")


def _epoch(stamp: str) -> float:
    """An ``YYYY-MM-DDTHH:MM:SS.mmmZ`` receipt time as seconds since the epoch."""
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()


#: What dispatch logs when every publish to a destination is nacked (the outbox's nack storm).
NACK_STORM = "the broker nacks every message to"


@dataclass
class Outcome:
    """What one scenario measured: per consumer, the longest pause between two receipts from
    the fault on (the consumption gap) and the time from the fault (or from the moment the
    cluster was whole again, for a fault that stops every node) to the first receipt after it."""

    scenario: str
    events: int
    gap: dict[str, float]
    resumed: dict[str, float]
    #: Nack storms dispatch met (each one outage, probed on a new channel: the failover race, or
    #: quorum lost).
    storms: int = 0

    def line(self) -> str:
        gaps = ", ".join(f"{c} {self.gap[c]:.2f}s" for c in self.gap)
        resumed = ", ".join(f"{c} {self.resumed[c]:.2f}s" for c in self.resumed)
        storms = f"; dispatch met {self.storms} nack storm(s)" if self.storms else ""
        return f"{self.scenario}: {self.events} events; consumption gap {gaps}; first receipt after {resumed}{storms}"


class Traffic:
    """Events written into a producer's outbox at a steady *rate* (a thread of this process),
    published by a ``dispatch`` process and consumed by ``run`` processes of the catalog (or of
    its partitions, each with *standbys*) and of the counter, every process given every node's
    address. :meth:`finish` checks the ledger."""

    def __init__(self, ns: ClusterNamespace, *, rate: float = 150.0, articles: int = 40,
                 partitions: int = 0, standbys: int = 0) -> None:
        self.ns = ns
        self.rate = rate
        self.articles = articles
        self.partitions = partitions
        self.standbys = standbys
        self.producer_db = ns.workdir / "producer.db"
        self.written: list[dict[str, Any]] = []
        self.procs: dict[str, RunProcess] = {}
        self.marks: list[tuple[str, float]] = []
        self._revision = [0] * articles
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="outbox-producer", daemon=True)
        self.error: BaseException | None = None

    # -- setup --
    def env(self) -> dict[str, str]:
        return self.ns.env(DELIVERY_PLUGINS="counter_consumer")

    def dbs(self, consumer: str) -> list[Path]:
        if consumer == "catalog" and self.partitions:
            return [self.ns.workdir / "state" / "catalog" / f"p{k}" / "inbox.db" for k in range(self.partitions)]
        return [self.ns.db(consumer)]

    def start(self) -> None:
        """Declare the topology, start dispatch and the runs, wait until they consume, start producing."""
        for consumer in CONSUMERS:
            extra = ("--partitions", str(self.partitions)) if consumer == "catalog" and self.partitions else ()
            done = self.ns.cli("topology", "declare", "--consumer", consumer, *extra, env=self.env())
            assert done.returncode == 0, done.stderr
        if self.partitions:
            for k in range(self.partitions):
                for s in range(1 + self.standbys):
                    self._start(f"catalog.p{k}" + (f".standby{s}" if s else ""), "run", "--consumer", "catalog",
                                "--partition", str(k), "--partitions", str(self.partitions))
                    if s == 0:  # the first one started is the active one
                        self.wait_log(f"catalog.p{k}", "consuming ")
        else:
            self._start("catalog", "run", "--consumer", "catalog", "--db", str(self.ns.db("catalog")))
        self._start("counter", "run", "--consumer", "counter", "--db", str(self.ns.db("counter")))
        for name in self.procs:
            if ".standby" not in name:
                self.wait_log(name, "consuming ")
        with contextlib.closing(outbox.connect(self.producer_db)):
            pass
        self._start("dispatch", "dispatch", "--db", str(self.producer_db), *(f"-c{c}" for c in CONSUMERS))
        self._thread.start()
        self.wait_caught_up("traffic to flow")

    def _start(self, name: str, *args: str) -> RunProcess:
        proc = RunProcess([sys.executable, "-m", "delivery_consumer", *args], cwd=self.ns.workdir, env=self.env())
        self.ns.started.append(proc)
        self.procs[name] = proc
        return proc

    def wait_log(self, name: str, text: str, timeout: float = 90.0) -> None:
        self.procs[name].wait_for_log(text, timeout=timeout)

    # -- the producer --
    def _produce(self) -> None:
        try:
            conn = outbox.connect(self.producer_db)
            with contextlib.closing(conn):
                tick = 0.05
                while not self._halt.wait(tick):
                    batch = [self._next() for _ in range(max(1, int(self.rate * tick)))]
                    with outbox.transaction(conn):
                        for env in batch:
                            outbox.enqueue(conn, env)
                    self.written.extend(batch)
        except BaseException as exc:  # handed to finish()
            self.error = exc

    def _next(self) -> dict[str, Any]:
        a = sum(self._revision) % self.articles  # round robin over the articles
        self._revision[a] += 1
        revision = self._revision[a]
        return {
            "eventId": str(uuid.uuid4()),
            "type": "material.published",
            "articleId": f"article-{a}",
            "revision": revision,
            "occurredAt": "2026-12-06T10:00:00Z",
            "data": {"title": f"article {a} r{revision}", "url": f"https://example.org/a/{a}"},
        }

    # -- during the scenario --
    def mark(self, what: str) -> float:
        """Note the moment of a fault (or of the cluster whole again); that moment."""
        now = time.time()
        self.marks.append((what, now))
        return now

    def alive(self) -> None:
        """Fail, with its log, if any process exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}):\n{proc.output()[1][-4000:]}")

    def wait_caught_up(self, what: str, timeout: float = RESUME_BOUND) -> None:
        """Wait until every consumer has applied the newest event written by now (the whole path,
        producer to consumers, works again), every process alive meanwhile."""
        wait_until("the first event written", lambda: self.written, timeout=30)
        newest = self.written[-1]["eventId"]

        def caught_up() -> bool:
            self.alive()
            assert self.error is None, self.error
            return all(any(count_rows(db, "inbox", "event_id = ?", (newest,)) for db in self.dbs(c) if db.exists())
                       for c in CONSUMERS)

        try:
            wait_until(what, caught_up, timeout=timeout, ignoring=(sqlite3.OperationalError,), interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (whole logs: {self.save_logs()})\n{self.logs()}") from None

    def nacked(self) -> int:
        """Outbox rows not published yet whose last publish the broker nacked."""
        if not self.producer_db.exists():
            return 0
        with contextlib.closing(outbox.connect(self.producer_db, readonly=True)) as conn:
            return int(conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL"
                                    " AND last_error LIKE 'nacked%'").fetchone()[0])

    def save_logs(self) -> Path:
        """Every process's whole stderr, a file each in *workdir*/logs; that directory."""
        where = self.ns.workdir / "logs"
        where.mkdir(exist_ok=True)
        for name, proc in self.procs.items():
            (where / f"{name}.log").write_text(proc.output()[1])
        return where

    def logs(self, tail: int = 1500) -> str:
        """The end of every process's stderr."""
        return "\n".join(f"--- {name} ({'alive' if p.poll() is None else f'exit {p.returncode}'}):\n"
                         f"{p.output()[1][-tail:]}" for name, p in self.procs.items())

    # -- the end --
    def finish(self, scenario: str) -> Outcome:
        """Stop producing; wait until the outbox is published and every consumer has every event;
        check the ledger; stop every process (each must exit 0); what was measured."""
        self._halt.set()
        self._thread.join(30)
        assert self.error is None, f"the producer failed: {self.error!r}"
        self.alive()
        ids = {e["eventId"] for e in self.written}

        def published() -> bool:
            self.alive()
            with contextlib.closing(outbox.connect(self.producer_db, readonly=True)) as conn:
                return conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()[0] == 0

        wait_until("the outbox to be published", published, timeout=RESUME_BOUND, interval=0.2)
        for consumer in CONSUMERS:
            wait_until(f"{consumer} to have every event",
                       lambda c=consumer: (self.alive(), sum(count_rows(db, "inbox") for db in self.dbs(c)))[1]
                       >= len(ids), timeout=RESUME_BOUND, interval=0.2)
        self.check_ledger(ids)
        outcome = self.measure(scenario)
        self.stop()
        return outcome

    def check_ledger(self, ids: set[str]) -> None:
        """Every written event applied exactly once by each consumer; nothing dead-lettered or rejected."""
        for consumer in CONSUMERS:
            seen: list[str] = []
            for db in self.dbs(consumer):
                seen += [r[0] for r in read_rows(db, "inbox", "event_id")]
                assert read_rows(db, "rejected", "event_id, code, reason") == [], f"{consumer} rejected events"
            assert len(seen) == len(set(seen)), f"{consumer}: an event has two receipts"
            assert set(seen) == ids, f"{consumer}: {len(ids - set(seen))} missing, {len(set(seen) - ids)} unknown"
        per_article: dict[str, int] = {}
        for e in self.written:
            per_article[e["articleId"]] = per_article.get(e["articleId"], 0) + 1
        counted = dict(read_rows(self.ns.db("counter"), "counter", "article_id, events"))
        assert counted == per_article, "the counter applied an event twice or missed one"
        dead = [f"{self.ns.prefix}.counter.dead"]
        dead += ([f"{self.ns.prefix}.catalog.p{k}.dead" for k in range(self.partitions)] if self.partitions
                 else [f"{self.ns.prefix}.catalog.dead"])
        for queue in dead:
            assert self.ns.count(queue) == 0, f"{queue} holds dead-lettered events"

    def measure(self, scenario: str) -> Outcome:
        fault = min(t for _, t in self.marks)
        restored = dict(self.marks).get("restored", fault)  # a fault that needs the nodes back: from then
        gap: dict[str, float] = {}
        resumed: dict[str, float] = {}
        for consumer in CONSUMERS:
            times = sorted(_epoch(r[0]) for db in self.dbs(consumer) for r in read_rows(db, "inbox", "received_at"))
            window = [fault] + [t for t in times if t > fault]
            gap[consumer] = max((b - a for a, b in itertools.pairwise(window)), default=0.0)
            after = [t for t in times if t > restored]
            resumed[consumer] = after[0] - restored if after else float("inf")
        dispatch = self.procs.get("dispatch")
        storms = dispatch.output()[1].count(NACK_STORM) if dispatch is not None else 0
        return Outcome(scenario, len(self.written), gap, resumed, storms)

    def stop(self) -> None:
        """SIGTERM every process, the standbys first and alone (a standby stopped as its active
        one exits is tests/broker/test_standby_stop.py's subject, not these scenarios'); each
        must exit 0."""
        standbys = [n for n in self.procs if ".standby" in n]
        codes: dict[str, int] = {}
        for group in (standbys, [n for n in self.procs if n not in standbys]):
            for name in group:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            for name in group:
                proc = self.procs[name]
                try:
                    proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
                codes[name] = proc.returncode
        bad = {n: c for n, c in codes.items() if c != 0}
        assert not bad, f"processes did not exit 0 on SIGTERM: {bad}:\n" + "\n".join(
            f"--- {n}\n{self.procs[n].output()[1][-2000:]}" for n in bad)

    def kill_all(self) -> None:
        """Whatever is left, killed (a failed test's cleanup)."""
        self._halt.set()
        for proc in self.procs.values():
            if session_processes(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


def _iso(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when * 1000) % 1000:03d}Z"


# -- the scenarios ------------------------------------------------------------------------------------------

#: How long a scenario lets quorum stay lost: the outage itself, chosen by the scenario.
QUORUM_LOST_FOR = 8.0


def kill_client_node(cluster: RabbitCluster, traffic: Traffic) -> None:
    """SIGKILL the node the clients are connected to; consumption must resume on the other two;
    the node is started again and the cluster becomes whole."""
    node = cluster.busiest()
    traffic.mark("fault")
    node.kill()
    traffic.wait_caught_up(f"consumption to resume after the kill of {node}")
    node.launch()
    cluster.wait_whole()
    traffic.wait_caught_up("consumption with the node back")


def kill_queue_leader(cluster: RabbitCluster, traffic: Traffic) -> None:
    """SIGKILL the node that leads the catalog's quorum queue."""
    queue = f"{traffic.ns.prefix}.catalog" + (".p0" if traffic.partitions else "")
    node = cluster.leader(queue)
    traffic.mark("fault")
    node.kill()
    traffic.wait_caught_up(f"consumption to resume after the kill of {queue}'s leader {node}")
    node.launch()
    cluster.wait_whole()
    traffic.wait_caught_up("consumption with the node back")


def lose_quorum(cluster: RabbitCluster, traffic: Traffic) -> None:
    """Stop the RabbitMQ application on two of the three nodes (the clients' node stays up): no
    quorum queue has a majority; then start them again. Nothing may be lost or exit meanwhile."""
    keep = cluster.busiest()
    stopped = [n for n in cluster.nodes if n is not keep]
    traffic.mark("fault")
    _parallel([n.stop_app for n in stopped])
    time.sleep(QUORUM_LOST_FOR)  # the outage itself: how long quorum stays lost is the scenario's choice
    traffic.alive()
    _parallel([n.start_app for n in stopped])
    traffic.mark("restored")
    cluster.wait_whole()
    traffic.wait_caught_up("consumption to resume once quorum is back")


def rolling_restart(cluster: RabbitCluster, traffic: Traffic, *, drain: bool) -> None:
    """Restart every node in turn (``rabbitmqctl shutdown``, start), first draining it
    (``rabbitmq-upgrade drain``: clients disconnected, leaderships moved) when *drain*; the next
    node only once the cluster is whole and every queue's members are back online."""
    for node in cluster.nodes:
        traffic.mark(f"restart {node.name}")
        if drain:
            node.ctl_out("drain", timeout=120, tool="rabbitmq-upgrade")
        node.shutdown()
        node.launch()
        cluster.wait_whole()
        if drain:  # a drained node stays in maintenance mode until revived
            node.ctl_out("revive", timeout=120, tool="rabbitmq-upgrade")
        cluster.wait_queues_online(traffic.ns.prefix)
        traffic.wait_caught_up(f"consumption with {node} restarted")


#: name -> (scenario, Traffic's keywords)
SCENARIOS: dict[str, tuple[Callable[[RabbitCluster, Traffic], None], dict[str, int]]] = {
    "kill-clients-node": (kill_client_node, {}),
    "kill-leader": (kill_queue_leader, {}),
    "lose-quorum": (lose_quorum, {}),
    "rolling-restart-drain": (lambda c, t: rolling_restart(c, t, drain=True), {}),
    "rolling-restart-no-drain": (lambda c, t: rolling_restart(c, t, drain=False), {}),
    "partitioned-kill-node": (kill_client_node, {"partitions": 2, "standbys": 1}),
}


class ScenarioFailed(AssertionError):
    """A scenario's failure, with every process's whole stderr (:attr:`logs`, by process name) and
    the outbox rows left nacked."""

    def __init__(self, message: str, logs: dict[str, str], nacked: int) -> None:
        super().__init__(message)
        self.logs = logs
        #: Outbox rows still waiting whose last publish the broker nacked.
        self.nacked = nacked


def play(cluster: RabbitCluster, ns: ClusterNamespace, name: str) -> Outcome:
    """Run scenario *name* on *cluster* in namespace *ns*: traffic started, the fault, the ledger
    checked, every process stopped (killed on failure); the cluster whole again afterwards."""
    scenario, options = SCENARIOS[name]
    traffic = Traffic(ns, **options)
    try:
        traffic.start()
        scenario(cluster, traffic)
        return traffic.finish(name)
    except AssertionError as exc:
        raise ScenarioFailed(str(exc), {n: p.output()[1] for n, p in traffic.procs.items()},
                             traffic.nacked()) from exc
    finally:
        traffic.kill_all()
        cluster.heal()
        if traffic.partitions:
            PartitionedConsumer(ns, "catalog", traffic.partitions).delete()
