"""The two places ``run``'s scenarios run (tests/service/test_worker_scenarios.py): the worker in
this process on :class:`~delivery_consumer.service.memory_link.MemoryLink` (milliseconds),
and ``delivery-consumer run`` against RabbitMQ (the broker suite).

Both drive the test-only ``flaky`` consumer (flaky_consumer.py) and answer in the same
terms: what is in the database, the dead queue and the main queue, and whether a run
crashed. A crash in memory ends the emulated process the way SIGKILL ends a real one:
its transaction rolled back, its note in ``in_flight`` left behind, nothing else done.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import flaky_consumer
import orjson
import pytest
from brokerkit import Namespace
from support import read_rows, wait_until
from tcpproxy import Proxy

from delivery_consumer.amqp.topology import DEFAULT_EXCHANGE, Topology
from delivery_consumer.inbox import InFlight
from delivery_consumer.model import faults
from delivery_consumer.model.deliveries import OutMessage, delivery_key
from delivery_consumer.model.envelope import body_digest
from delivery_consumer.service import worker as worker_module
from delivery_consumer.service.memory_link import MemoryLink, MemoryQueues
from delivery_consumer.service.messages import Ack, ToConnection
from delivery_consumer.service.settings import RunConfig
from delivery_consumer.service.worker import Worker

CONSUMER = "flaky"


@dataclass
class Ended:
    """How a run ended: ``crashed`` (SIGKILL, or its emulation) or on its own; its log."""

    crashed: bool
    log: str = ""


class Control(Protocol):
    """What a scenario does while a run is under way."""

    def publish(self, bodies: Sequence[bytes]) -> None: ...

    def refuse_next_copy(self) -> None:
        """The next dead-letter copy the run publishes is not confirmed."""

    def lose_channel(self) -> None:
        """The run's connection dies now."""

    def stalled(self) -> None:
        """Wait until a ``stall`` event is inside its transaction."""

    def release(self) -> None:
        """Let the stalled event go on."""


class Backend(Protocol):
    name: str
    #: The consumer's database.
    db: Path

    def publish(self, bodies: Sequence[bytes]) -> None: ...

    def run(self, *, crash_at: str | None = None, during: Callable[[Control], None] | None = None,
            **options: Any) -> Ended:
        """``run`` until nothing is left to do (or it crashes); *options* are RunConfig fields;
        *crash_at* a crash point (faults.py); *during* acts while it runs."""

    def dead(self) -> list[tuple[dict[str, Any], bytes]]:
        """Take the dead queue's messages: (headers, body)."""

    def left(self) -> int:
        """Messages still waiting in the main queue."""


def routing_key_of(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "material.published"
    return str(obj.get("type") or "material.published") if isinstance(obj, dict) else "material.published"


def message_id_of(body: bytes) -> str | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    value = obj.get("eventId") if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None


@dataclass
class Hands:
    """What both places do alike while a run is under way (the rest is each place's :class:`Control`)."""

    backend: MemoryBackend | RabbitBackend

    def publish(self, bodies: Sequence[bytes]) -> None:
        self.backend.publish(bodies)

    def stalled(self) -> None:
        flaky_dir = self.backend.flaky_dir
        wait_until("the stall event in its transaction", lambda: (flaky_dir / "stalled").exists())

    def release(self) -> None:
        (self.backend.flaky_dir / "release").touch()


# -- in memory ------------------------------------------------------------------------------------------


class Crash(BaseException):
    """The emulated process dies here (a BaseException: nothing of the worker catches it as a failure)."""


@dataclass
class MemoryBackend:
    """The worker in this process, one emulated process per :meth:`run`, on shared in-memory queues.

    Every request of every run is checked as it is made: an ack only covers deliveries whose
    outcome is committed, and no rejection is recorded before its dead copy is confirmed."""

    workdir: Path
    monkeypatch: pytest.MonkeyPatch
    name: str = "memory"
    queues: MemoryQueues = field(init=False)
    violations: list[str] = field(default_factory=list)
    runs: int = 0
    #: Dead copies taken out by :meth:`dead` so far.
    taken: int = 0

    def __post_init__(self) -> None:
        self.db = self.workdir / CONSUMER / "inbox.db"
        self.flaky_dir = self.workdir / "flaky"
        self.queues = MemoryQueues(RunConfig(consumer=CONSUMER, url="memory:").topology())
        self.monkeypatch.setenv("FLAKY_DIR", str(self.flaky_dir))

        def die() -> None:
            raise Crash

        self.monkeypatch.setattr(flaky_consumer, "die", die)

    @property
    def topology(self) -> Topology:
        return self.queues.topology

    def publish(self, bodies: Sequence[bytes]) -> None:
        for body in bodies:
            assert self.queues.publish(OutMessage(routing_key_of(body), body, DEFAULT_EXCHANGE, message_id_of(body)))

    def run(self, *, crash_at: str | None = None, during: Callable[[Control], None] | None = None,
            **options: Any) -> Ended:
        self.runs += 1
        owner = f"memory:{self.runs}:-"  # a process name no live process has: dead once this run ends
        config = RunConfig(consumer=CONSUMER, url="memory:", db_path=self.db, **options)
        backend = self

        class Incarnation(Worker):
            def open(self) -> bool:
                opened = super().open()
                if opened:
                    assert self.db is not None
                    self.in_flight = InFlight(self.db, owner=owner)
                return opened

            def close(self) -> None:
                if isinstance(self.error, Crash):  # what SIGKILL leaves: no exit code runs
                    if self.db is not None:
                        self.db.close()
                    link.close()
                    return
                super().close()

        def crashpoint(name: str) -> None:
            if name == crash_at:
                raise Crash

        self.monkeypatch.setattr(worker_module, "crashpoint", crashpoint if crash_at else faults.crashpoint)
        worker = Incarnation(config)
        link = MemoryLink(self.queues, worker, prefetch=config.prefetch,
                          on_request=lambda request: backend._check(link, request))
        worker.io = link
        worker.start()
        if during is not None:
            during(MemoryControl(self, link))
        with self.queues.changed:
            link.stop_when_drained = True
            self.queues.changed.notify_all()
        worker.join(60)
        assert not worker.is_alive(), "the worker did not stop"
        crashed = isinstance(worker.error, Crash)
        assert crashed or worker.error is None, worker.error
        assert [] == self.violations
        return Ended(crashed)

    def _check(self, link: MemoryLink, request: ToConnection) -> None:
        """The invariants of ack-after-commit, looked at when each request is made."""
        rejected = read_rows(self.db, "rejected", "event_id, body_sha256")
        confirmed = self.taken + len(self.queues.dead)
        if len(rejected) > confirmed:
            self.violations.append(f"{type(request).__name__}: {len(rejected)} rejections recorded, "
                                   f"{confirmed} dead copies confirmed")
        if not isinstance(request, Ack) or request.generation != link.generation:
            return
        receipts = {r[0] for r in read_rows(self.db, "inbox", "event_id")}
        counted = {r[0] for r in read_rows(self.db, "deliveries", "key")}
        refused = {r[0] for r in rejected} | {r[1] for r in rejected}
        for tag, held in list(link.unacked.items()):
            m = held.message
            if tag <= request.tag and not (m.message_id in receipts or delivery_key(m) in counted
                                           or m.message_id in refused or body_digest(m.body) in refused):
                self.violations.append(f"ack of tag {request.tag} before the outcome of {m.message_id} committed")

    def dead(self) -> list[tuple[dict[str, Any], bytes]]:
        with self.queues.changed:
            taken, self.queues.dead = self.queues.dead, []
        self.taken += len(taken)
        return [(m.headers or {}, m.body) for m in taken]

    def left(self) -> int:
        return len(self.queues.ready) + len(self.queues.delayed)


@dataclass
class MemoryControl(Hands):
    link: MemoryLink

    def refuse_next_copy(self) -> None:
        self.link.refuse_copies(1)

    def lose_channel(self) -> None:
        self.link.lose_channel("connection reset by peer")


# -- RabbitMQ --------------------------------------------------------------------------------------------

#: RunConfig fields -> run's options.
_FLAGS = {"max_attempts": "--max-attempts", "max_crashes": "--max-crashes", "batch": "--batch",
          "prefetch": "--prefetch", "retry_delays_ms": "--retry-delays"}


def _flags(options: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for name, value in options.items():
        text = ",".join(f"{v}ms" for v in value) if name == "retry_delays_ms" else str(value)
        args += [_FLAGS[name], text]
    return args


@dataclass
class RabbitBackend:
    """``delivery-consumer run`` as a real process against RabbitMQ, through a TCP proxy
    (so that a scenario can cut its connection)."""

    ns: Namespace
    proxy: Proxy
    name: str = "rabbitmq"

    def __post_init__(self) -> None:
        self.db = self.ns.db(CONSUMER)
        self.flaky_dir = self.ns.workdir / "flaky"
        self.topology = self.ns.topology(CONSUMER)

    def env(self, crash_at: str | None) -> dict[str, str]:
        extra = {"DELIVERY_PLUGINS": "flaky_consumer", "FLAKY_DIR": str(self.flaky_dir),
                 "DELIVERY_AMQP_URL": self.proxy.url}
        if crash_at:
            extra["DELIVERY_CRASH_AT"] = crash_at
        return self.ns.env(**extra)

    def publish(self, bodies: Sequence[bytes]) -> None:
        self.ns.publish(bodies, declare=[CONSUMER])

    def run(self, *, crash_at: str | None = None, during: Callable[[Control], None] | None = None,
            **options: Any) -> Ended:
        args = _flags(options)
        if "retry_delays_ms" in options:  # the tiers' queues are named by their delays
            self.topology = self.ns.topology(CONSUMER, retry_delays_ms=tuple(options["retry_delays_ms"]))
        proc = self.ns.start_run(CONSUMER, "--exit-when-idle", "2", *args, env=self.env(crash_at))
        if during is not None:
            proc.wait_for_log("consuming")
            during(RabbitControl(self, self))
        done: subprocess.CompletedProcess[str] = proc.until_idle(120)
        assert done.returncode in (0, -signal.SIGKILL), done.stderr
        return Ended(done.returncode == -signal.SIGKILL, done.stderr)

    def dead(self) -> list[tuple[dict[str, Any], bytes]]:
        return [(props.headers or {}, body) for props, body in self.ns.drain(self.topology.dead_queue)]

    def left(self) -> int:
        return self.ns.count(self.topology.queue)


@dataclass
class RabbitControl(Hands):
    rabbit: RabbitBackend

    def refuse_next_copy(self) -> None:
        # Gone from under the running run, the dead queue makes the next dead copy unroutable
        # (mandatory: returned, not confirmed); run declares it again when it reconnects.
        conn, ch = self.rabbit.ns.channel()
        try:
            ch.queue_delete(self.rabbit.topology.dead_queue)
        finally:
            conn.close()

    def lose_channel(self) -> None:
        self.rabbit.proxy("reset")


@pytest.fixture
def memory_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MemoryBackend:
    """The scenarios' in-memory place: the worker in this process on MemoryLink."""
    import flaky_consumer as registered  # noqa: F401  (registers the consumer)

    return MemoryBackend(tmp_path, monkeypatch)


@pytest.fixture
def rabbit_backend(ns: Namespace) -> Iterator[RabbitBackend]:
    """The scenarios against RabbitMQ: real run processes through a TCP proxy."""
    proxy = Proxy(ns.url)
    try:
        yield RabbitBackend(ns, proxy)
    finally:
        proxy.close()


def threads_left() -> list[str]:
    """Worker threads still alive (none may outlive a scenario)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("delivery-worker-")]
