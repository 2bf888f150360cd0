"""Helpers for tests against the real RabbitMQ broker.

Each test gets its own namespace (exchange ``<prefix>.events`` and queues
``<prefix>.<consumer>...``) so tests never see each other's messages; the
namespace is deleted afterwards. Tests that need the broker skip with a
reason when it is unreachable, unless ``DELIVERY_REQUIRE_BROKER`` is set (as
``.ci/run`` does), in which case they fail.

``tests/conftest.py`` loads this module as a plugin, so the fixtures
``amqp_url`` and ``ns`` are available to every test.

On the shared broker a test only declares, publishes and consumes under its
own names. A test that restarts, stops or kills a broker uses
``private_ns`` / ``private_broker`` instead: a RabbitMQ node of the test
session's own (:class:`RabbitNode`), started from the installed
``rabbitmq-server`` on free ports, stopped when the session ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import orjson
import pika
import pytest
from support import wait_until

from delivery_consumer import consumers
from delivery_consumer.amqp.partitions import slot_headers
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.amqp.topology import DEFAULT_URL, Topology
from delivery_consumer.model.deliveries import OutMessage

TESTS_DIR = Path(__file__).resolve().parent


def broker_url() -> str:
    return os.environ.get("DELIVERY_AMQP_URL", DEFAULT_URL)


def broker_reachable(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 5672), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The broker URL; skips (or fails under DELIVERY_REQUIRE_BROKER) when it is down."""
    url = broker_url()
    if not broker_reachable(url):
        if os.environ.get("DELIVERY_REQUIRE_BROKER"):
            pytest.fail(f"RabbitMQ is required (DELIVERY_REQUIRE_BROKER) but unreachable at {url}")
        pytest.skip(f"RabbitMQ unreachable at {url}; set DELIVERY_REQUIRE_BROKER=1 to fail instead")
    return url


class RunProcess(subprocess.Popen[str]):
    """A child process whose stdout and stderr are read continuously by two
    threads, so that a chatty process never blocks on a full pipe (a consumer
    logging a line per batch fills 64 KiB in a few thousand events);
    :meth:`communicate` returns everything it wrote, as usual."""

    def __init__(self, cmd: Sequence[str], *, cwd: Path, env: dict[str, str]) -> None:
        super().__init__(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
        self._chunks: dict[str, list[str]] = {"out": [], "err": []}
        self._readers = [
            threading.Thread(target=self._drain, args=(stream, self._chunks[name]), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(stream: Any, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def output(self) -> tuple[str, str]:
        """What the process wrote so far (stdout, stderr)."""
        return "".join(self._chunks["out"]), "".join(self._chunks["err"])

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        for reader in self._readers:
            reader.join()
        return self.output()

    def wait_for_log(self, text: str, timeout: float = 60.0) -> str:
        """Wait until the process has written *text* on stderr; its stderr so far.
        Fails with the log if the process exits first."""
        wait_until(f"{text!r} on stderr", lambda: text in self.output()[1], timeout=timeout, procs=[self])
        return self.output()[1]

    def until_idle(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """The result of a ``run --exit-when-idle``; its group killed, and the
        test failed with its log, when it has not gone idle within *timeout*."""
        try:
            out, err = self.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            out, err = self.communicate()
            raise AssertionError(f"run did not go idle within {timeout}s:\n{err[-3000:]}") from None
        return subprocess.CompletedProcess(self.args, self.returncode, out, err)


@dataclass
class Namespace:
    """An isolated exchange + queue prefix on the shared broker."""

    url: str
    prefix: str
    workdir: Path
    #: Every run started here; the fixture kills what is left of them.
    started: list[RunProcess] = field(default_factory=list)

    @property
    def exchange(self) -> str:
        return f"{self.prefix}.events"

    def topology(self, consumer: str, **kwargs: Any) -> Topology:
        spec = consumers.get(consumer)
        return Topology(consumer=consumer, binding_keys=tuple(spec.binding_keys), exchange=self.exchange,
                        prefix=self.prefix, **kwargs)

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a CLI subprocess bound to this namespace."""
        env = dict(os.environ)
        env.update({
            "DELIVERY_AMQP_URL": self.url,
            "DELIVERY_EXCHANGE": self.exchange,
            "DELIVERY_QUEUE_PREFIX": self.prefix,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")])),
        })
        env.pop("DELIVERY_CRASH_AT", None)
        env.update(extra)
        return env

    def db(self, consumer: str) -> Path:
        return self.workdir / consumer / "inbox.db"

    # -- talking to the broker directly --
    def channel(self) -> Any:
        conn = pika.BlockingConnection(pika.URLParameters(self.url))
        return conn, conn.channel()

    def publish(self, bodies: Sequence[bytes], *, routing_key: str | None = None,
                message_ids: Sequence[str | None] | None = None, declare: Sequence[str] = ()) -> None:
        """Publish raw bodies (valid or not) with confirms; routing key = type when parseable."""
        messages = []
        for i, body in enumerate(bodies):
            key = routing_key
            mid = message_ids[i] if message_ids is not None else None
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                obj = {}
            obj = obj if isinstance(obj, dict) else {}
            key = key or str(obj.get("type") or "material.published")
            if message_ids is None:
                mid = obj.get("eventId") if isinstance(obj.get("eventId"), str) else None
            article = obj.get("articleId")
            headers = slot_headers(article) if isinstance(article, str) else None  # for partitioned consumers
            messages.append(OutMessage(routing_key=key, body=body, exchange=self.exchange, message_id=mid,
                                       headers=headers))
        with Publisher(self.url, topologies=[self.topology(c) for c in declare], exchanges=[self.exchange]) as pub:
            results = pub.publish(messages)
        bad = [r for r in results if not r.ok]
        assert not bad, f"test publish failed: {bad[:3]}"

    def count(self, queue: str) -> int:
        """Ready messages in *queue* (0 when it does not exist)."""
        conn, ch = self.channel()
        try:
            return int(ch.queue_declare(queue, passive=True).method.message_count)
        except pika.exceptions.ChannelClosedByBroker:
            return 0
        finally:
            if conn.is_open:
                conn.close()

    def drain(self, queue: str, *, timeout: float = 60.0) -> list[tuple[Any, bytes]]:
        """Take every message from *queue* (acking them): (properties, body) pairs, in order."""
        out: list[tuple[Any, bytes]] = []
        conn, ch = self.channel()
        def emptied() -> bool:
            while True:
                method, props, body = ch.basic_get(queue, auto_ack=False)
                if method is None:  # none ready now; done when none is left at all
                    return self.count(queue) == 0
                out.append((props, body))
                ch.basic_ack(method.delivery_tag)

        try:
            wait_until(f"{queue} to be drained", emptied, timeout=timeout)
        finally:
            if conn.is_open:
                conn.close()
        return out

    def peek(self, queue: str) -> list[tuple[Any, bytes]]:
        """Read every message of *queue* without removing it (nack with requeue)."""
        out: list[tuple[Any, bytes]] = []
        conn, ch = self.channel()
        try:
            tags = []
            while True:
                method, props, body = ch.basic_get(queue, auto_ack=False)
                if method is None:
                    break
                out.append((props, body))
                tags.append(method.delivery_tag)
            if tags:
                ch.basic_nack(tags[-1], multiple=True, requeue=True)
        finally:
            if conn.is_open:
                conn.close()
        return out

    def delete(self) -> None:
        conn, ch = self.channel()
        try:
            for consumer in ("catalog", "audit", *consumers.names()):
                for queue, _ in self.topology(consumer).queues():
                    ch.queue_delete(queue)
            for extra in ("1ms", "50ms", "100ms", "200ms", "300ms", "500ms"):
                for consumer in consumers.names():
                    ch.queue_delete(f"{self.prefix}.{consumer}.retry.{extra}")
            ch.exchange_delete(self.exchange)
        finally:
            if conn.is_open:
                conn.close()

    # -- the CLI as a real process --
    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
            input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "delivery_consumer", *args], cwd=self.workdir, env=env or self.env(),
            capture_output=True, text=True, timeout=timeout, input=input.decode() if input else None,
        )

    def start_run(self, consumer: str, *args: str, env: dict[str, str] | None = None) -> RunProcess:
        """Start ``delivery-consumer run`` as a real process (its own session, for SIGKILL)."""
        cmd = [sys.executable, "-m", "delivery_consumer", "run", "--consumer", consumer,
               "--db", str(self.db(consumer)), *args]
        proc = RunProcess(cmd, cwd=self.workdir, env=env or self.env())
        self.started.append(proc)
        return proc

    def run_until_idle(self, consumer: str, *args: str, idle: float = 1.5, timeout: float = 120,
                       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``run`` until no delivery arrived for *idle* seconds; the process's result."""
        return self.start_run(consumer, "--exit-when-idle", str(idle), *args, env=env).until_idle(timeout)


@pytest.fixture(scope="session")
def swept_prefixes(amqp_url: str) -> Iterator[set[str]]:
    """The prefixes of this session's namespaces on the shared broker. A namespace deletes the
    names it knows; whatever else a test declared under its prefix (a partition's queues, a
    retry tier of its own) is found at the session's end by one ``rabbitmqctl list_queues``
    on the local node and deleted, so that no run of the suite leaves queues behind."""
    prefixes: set[str] = set()
    yield prefixes
    if prefixes:
        sweep_queues(amqp_url, prefixes)


def sweep_queues(url: str, prefixes: set[str]) -> None:
    """Delete the queues and exchanges under *prefixes* that the local node lists."""
    left: dict[str, list[str]] = {}
    for kind in ("queue", "exchange"):
        try:
            listed = subprocess.run(["rabbitmqctl", f"list_{kind}s", "name", "--quiet"], capture_output=True,
                                    text=True, timeout=60).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return
        left[kind] = [name for name in listed if name.split(".", 1)[0] in prefixes]
    if left["queue"] or left["exchange"]:
        conn = pika.BlockingConnection(pika.URLParameters(url))
        try:
            ch = conn.channel()
            for name in left["queue"]:
                ch.queue_delete(name)
            for name in left["exchange"]:
                ch.exchange_delete(name)
        finally:
            if conn.is_open:
                conn.close()


@pytest.fixture
def ns(amqp_url: str, tmp_path: Path, swept_prefixes: set[str]) -> Iterator[Namespace]:
    """A fresh broker namespace and working directory, deleted afterwards."""
    space = Namespace(amqp_url, f"t{uuid.uuid4().hex[:10]}", tmp_path)
    swept_prefixes.add(space.prefix)
    yield space
    for proc in space.started:  # whatever a test left running, worker processes included
        if session_processes(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    space.delete()


def session_processes(sid: int) -> list[int]:
    """Live processes (zombies excluded) of session *sid*: a run started by
    :meth:`Namespace.start_run` leads its own session, its worker included."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_bytes().rpartition(b")")[2].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def freeze_session(sid: int, timeout: float = 30.0) -> None:
    """SIGSTOP every process of session *sid* and return once each one is stopped
    (state ``T`` in ``/proc``): the signal is only queued when ``killpg`` returns,
    and a process running on the other core goes on until it takes it."""
    os.killpg(sid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for pid in session_processes(sid):
            try:
                states.append(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0])
            except OSError:
                continue
        return all(state in (b"T", b"t") for state in states)

    wait_until(f"session {sid} stopped", stopped, timeout=timeout)


def wait_session_gone(sid: int, timeout: float) -> list[int]:
    """Wait until no process of session *sid* lives; what is still alive after *timeout*."""
    try:
        wait_until(f"session {sid} to end", lambda: not session_processes(sid), timeout=timeout)
    except AssertionError:
        return session_processes(sid)
    return []


def kill(proc: RunProcess, *, main_only: bool = False, within: float = 5.0) -> None:
    """SIGKILL a process started by :meth:`Namespace.start_run` and reap it:
    the whole process group (systemd, a container stop), or with *main_only*
    its main PID alone (supervisord, ``kill -9 PID``), after which every
    process of that run must be gone *within* seconds."""
    if not main_only:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = wait_session_gone(proc.pid, within)
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"processes {left} of run {proc.pid} still alive {within}s after kill -9 of its main PID")
    proc.communicate()


def wait_for_broker(url: str, timeout: float = 60.0) -> None:
    """Block until the broker accepts an AMQP connection."""
    def answers() -> bool:
        pika.BlockingConnection(pika.URLParameters(url)).close()
        return True

    wait_until(f"the broker at {url} to accept a connection", answers, timeout=timeout,
               ignoring=(pika.exceptions.AMQPError,), interval=0.25)


#: Where rabbitmq-server and rabbitmqctl are taken from for a private node: the
#: scripts themselves, not /usr/sbin's wrappers (which switch to the rabbitmq user).
RABBITMQ_SBIN_DIRS = ("/usr/lib/rabbitmq/bin", "/usr/local/sbin", "/usr/sbin", "/opt/homebrew/sbin")


def rabbitmq_sbin() -> Path | None:
    """The directory of rabbitmq-server and rabbitmqctl (``DELIVERY_RABBITMQ_SBIN`` first), or None."""
    given = os.environ.get("DELIVERY_RABBITMQ_SBIN")
    for candidate in ([given] if given else list(RABBITMQ_SBIN_DIRS)):
        path = Path(candidate)
        if (path / "rabbitmq-server").exists() and (path / "rabbitmqctl").exists():
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_env(base: Path, name: str, port: int, dist_port: int, *, home: Path | None = None) -> dict[str, str]:
    """The environment of a private RabbitMQ node (and of ``rabbitmqctl`` for it)
    named *name* on loopback *port* and *dist_port*, its every file in *base*:
    none of the caller's ``RABBITMQ_``/``ERL_`` settings and none of the
    system's files, and its own Erlang cookie (``HOME`` = *base*/home, or
    *home*: the nodes of one cluster share theirs). The
    caller makes *base*/home and writes ``rabbitmq-env.conf`` (empty: not the
    system's NODENAME and ports), ``rabbitmq.conf`` and ``enabled_plugins``."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_", "DELIVERY_"))},
        "HOME": str(home or base / "home"),
        "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
        "RABBITMQ_NODENAME": name,
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
        "RABBITMQ_LOG_BASE": str(base / "log"),
        "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
        "RABBITMQ_PID_FILE": str(base / "rabbitmq.pid"),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
    }


class RabbitNode:
    """A RabbitMQ node of the test run's own: its own node name, AMQP and
    distribution ports (free ones, chosen now), data, log and config files in
    *base*, no plugin (no management or Prometheus listener), and its own
    Erlang cookie (``HOME`` = *base*/home, shared with ``rabbitmqctl``). A test
    may stop, restart or kill it; the shared broker is never touched."""

    def __init__(self, sbin: Path, base: Path, *, name: str | None = None, home: Path | None = None,
                 conf: str = "") -> None:
        self.sbin = sbin
        self.base = base
        self.name = name or f"delivery-test-{os.getpid()}-{uuid.uuid4().hex[:6]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        (base / "home").mkdir(parents=True, exist_ok=True)
        (base / "rabbitmq-env.conf").write_text("")
        (base / "rabbitmq.conf").write_text(conf)
        (base / "enabled_plugins").write_text("[].\n")
        self.env = node_env(base, self.name, self.port, self.dist_port, home=home)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def start(self, timeout: float = 120.0) -> None:
        """Start the node as a child process (its own session) and wait until it takes AMQP connections."""
        with open(self.base / "server.out", "ab") as out:
            self.proc = subprocess.Popen([str(self.sbin / "rabbitmq-server")], env=self.env, cwd=self.base,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = (self.base / "server.out").read_text(errors="replace")[-3000:]
                raise AssertionError(f"the private RabbitMQ node exited ({self.proc.returncode}):\n{log}")
            pika.BlockingConnection(pika.URLParameters(self.url)).close()
            return True

        wait_until(f"the private RabbitMQ node on port {self.port}", answers, timeout=timeout,
                   ignoring=(pika.exceptions.AMQPError, OSError), interval=0.25)

    def ctl(self, *args: str, timeout: float = 120.0) -> None:
        subprocess.run([str(self.sbin / "rabbitmqctl"), "-n", self.name, *args], env=self.env, check=True,
                       capture_output=True, timeout=timeout)

    def restart(self, *, down_for: float = 1.0) -> None:
        """Stop the RabbitMQ application of this node and start it again (every
        connection drops), then wait until it answers."""
        self.ctl("stop_app")
        time.sleep(down_for)  # the outage itself: how long the broker stays down is what the caller tests
        self.ctl("start_app")
        wait_for_broker(self.url)

    def stop(self) -> None:
        """Stop the node (gracefully, else kill its process group); nothing of it is left running."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.ctl("stop", timeout=60)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the node started (erl_child_setup, inet_gethost)
        proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def private_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    """A RabbitMQ node started for this test session alone (for tests that restart
    or kill a broker); stopped at the end. Skips when RabbitMQ is not installed
    (fails under DELIVERY_REQUIRE_BROKER)."""
    sbin = rabbitmq_sbin()
    if sbin is None:
        if os.environ.get("DELIVERY_REQUIRE_BROKER"):
            pytest.fail("a private RabbitMQ node is required but rabbitmq-server is not installed "
                        "(set DELIVERY_RABBITMQ_SBIN to its directory)")
        pytest.skip("rabbitmq-server not installed; set DELIVERY_RABBITMQ_SBIN to its directory")
    node = RabbitNode(sbin, tmp_path_factory.mktemp("rabbitmq"))
    try:
        node.start()
        yield node
    finally:
        node.stop()


@pytest.fixture
def private_ns(private_broker: RabbitNode, tmp_path: Path) -> Iterator[Namespace]:
    """Like ``ns``, on the session's private RabbitMQ node (``private_broker``)."""
    space = Namespace(private_broker.url, f"t{uuid.uuid4().hex[:10]}", tmp_path)
    yield space
    for proc in space.started:
        if session_processes(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    wait_for_broker(space.url)  # a test may leave it restarting
    space.delete()
