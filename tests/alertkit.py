"""Alert rules checked against real scrapes.

:class:`PrivateBroker` is a RabbitMQ node of the test's own (own node name,
ports, data directory and enabled-plugins file) with the ``rabbitmq_prometheus``
plugin, which the shared broker does not have and which a test may stop.
:func:`scrape` reads targets as Prometheus does (adding ``job``, ``instance``
and ``up``); a :class:`Timeline` turns the scrapes into ``promtool test rules``
input series, one step a minute.

Only the clock is modelled. A scrape stands for one minute (or, held, for
several: nothing changes meanwhile but time). Values that are instants
(``*_timestamp_seconds``) or ages (``*_age_seconds``) are moved onto promtool's
clock, which starts at 0: an instant keeps its distance to the scrape that
first saw it, and keeps its place afterwards (the same commit is the same
instant in every later scrape); an age is the distance to such an instant (a
row's birth), so it grows with promtool's clock while the row waits.
Heartbeats (:data:`HEARTBEATS`) are the exception: a live worker sends one
every second, so what one tells is its real age at the scrape, and that age
is kept; moved as an instant, a worker that waited a few real seconds on a
busy database would look stuck for minutes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
from brokerkit import node_env
from prometheus_client.parser import text_string_to_metric_families
from support import wait_until
from webhook_server import free_port

#: Instants that a live process renews every second: kept at their real age (see the module's docstring).
HEARTBEATS = frozenset({"delivery_worker_heartbeat_timestamp_seconds"})
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
#: The broker's per-queue figures, without the cost of every per-object metric.
DETAILED = "/metrics/detailed?family=queue_coarse_metrics&family=queue_consumer_count"


def prometheus_plugin_missing() -> str | None:
    """Why a private node with the Prometheus plugin cannot be started here, or None."""
    if not (RABBITMQ_BIN / "rabbitmq-server").exists():
        return "RabbitMQ is not installed (apt-get install rabbitmq-server)"
    if not list(Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*/plugins/rabbitmq_prometheus-*")):
        return "RabbitMQ's rabbitmq_prometheus plugin is not installed"
    return None


class PrivateBroker:
    """A RabbitMQ node in *directory*, on free loopback ports, with rabbitmq_prometheus."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.node = f"dc-alerts-{uuid.uuid4().hex[:8]}@localhost"
        self.amqp_port, self.metrics_port, self.dist_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{DETAILED}"

    def env(self) -> dict[str, str]:
        return node_env(self.directory, self.node, self.amqp_port, self.dist_port)

    def start(self) -> None:
        d = self.directory
        (d / "home").mkdir(parents=True, exist_ok=True)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text("[rabbitmq_prometheus].\n")
        (d / "rabbitmq.conf").write_text("\n".join([
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}",
            f"prometheus.tcp.port = {self.metrics_port}",
            "prometheus.tcp.ip = 127.0.0.1",
            "collect_statistics_interval = 500",  # queue figures fresh within half a second
            "",
        ]))
        log = (d / "server.log").open("wb")
        self.proc = subprocess.Popen([str(RABBITMQ_BIN / "rabbitmq-server")], env=self.env(), cwd=d,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.wait_up()

    def wait_up(self) -> None:
        def answers() -> bool:
            pika.BlockingConnection(pika.URLParameters(self.url)).close()
            with urllib.request.urlopen(self.metrics_url, timeout=5):
                return True

        wait_until(f"the private RabbitMQ node {self.node}", answers, timeout=180,
                   procs=[self.proc] if self.proc else [], ignoring=(pika.exceptions.AMQPError, OSError), interval=0.25)

    def ctl(self, *args: str) -> None:
        done = subprocess.run([str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node, *args], env=self.env(),
                              capture_output=True, text=True, timeout=180)
        assert 0 == done.returncode, done.stdout + done.stderr

    def stop_app(self) -> None:
        """The broker down (its Erlang VM stays, so it starts again at once)."""
        self.ctl("stop_app")

    def start_app(self) -> None:
        self.ctl("start_app")
        self.wait_up()

    def stop(self) -> None:
        """Shut the node down; whatever is left of its session is killed."""
        if self.proc is None:
            return
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            self.ctl("shutdown")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


@dataclass(frozen=True)
class Target:
    """A scrape target, as Prometheus's configuration names it."""

    job: str
    instance: str
    url: str


def target(job: str, port: int, path: str = "/metrics") -> Target:
    return Target(job, f"127.0.0.1:{port}", f"http://127.0.0.1:{port}{path}")


#: A series: its metric name and its sorted labels.
Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Scrape:
    """One round over every target: what Prometheus would store at one instant."""

    wall: float
    samples: dict[Key, float]
    #: Every name the targets declared, a labelled counter not yet incremented (no sample) too.
    declared: set[str] = field(default_factory=set)

    def values(self, name: str, **labels: str) -> list[float]:
        """The values of *name*'s series that carry *labels*."""
        return [v for (n, ls), v in self.samples.items() if n == name and set(labels.items()) <= set(ls)]

    def value(self, name: str, **labels: str) -> float | None:
        """The one value of *name* with *labels*; None when there is none (or several)."""
        found = self.values(name, **labels)
        return found[0] if len(found) == 1 else None


def scrape(targets: Iterable[Target]) -> Scrape:
    """Scrape every target once: its samples with ``job`` and ``instance`` added, and
    ``up`` (1 when it answered, 0 when it did not), as Prometheus records them."""
    wall = time.time()
    samples: dict[Key, float] = {}
    declared: set[str] = set()
    for t in targets:
        ident = {"job": t.job, "instance": t.instance}
        try:
            with urllib.request.urlopen(t.url, timeout=10) as answer:
                text = answer.read().decode()
        except OSError:
            samples[("up", tuple(sorted(ident.items())))] = 0.0
            continue
        samples[("up", tuple(sorted(ident.items())))] = 1.0
        for family in text_string_to_metric_families(text):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            declared.update(family.name + suffix for suffix in suffixes)
            for sample in family.samples:
                samples[(sample.name, tuple(sorted({**sample.labels, **ident}.items())))] = float(sample.value)
    return Scrape(wall, samples, declared)


def _format(value: float) -> str:
    return repr(round(value, 3)) if value != int(value) else str(int(value))


@dataclass
class Timeline:
    """Scrapes one minute apart on promtool's clock (see the module's docstring)."""

    steps: list[Scrape] = field(default_factory=list)
    _instants: list[tuple[float, float]] = field(default_factory=list)

    def add(self, s: Scrape, minutes: int = 1) -> None:
        """*s* stands for the next *minutes* minutes."""
        self.steps.extend([s] * minutes)

    @property
    def end(self) -> str:
        """promtool's time of the last step."""
        return f"{len(self.steps) - 1}m"

    def _instant(self, real: float, s: Scrape, t: float) -> float:
        for seen, moved in self._instants:
            if abs(seen - real) <= 1.0:
                return moved
        moved = t - (s.wall - real)
        self._instants.append((real, moved))
        return moved

    def _value(self, name: str, value: float, s: Scrape, t: float) -> float:
        if value == 0 or not name.endswith(("_timestamp_seconds", "_age_seconds")):
            return value  # 0 is "never" or "none": no instant to move
        if name in HEARTBEATS:
            return t - (s.wall - value)
        if name.endswith("_timestamp_seconds"):
            return self._instant(value, s, t)
        return t - self._instant(s.wall - value, s, t)

    def input_series(self, names: set[str]) -> list[dict[str, str]]:
        """promtool ``input_series`` of every recorded series named in *names* (and ``up``):
        a value per step, ``stale`` where a series disappeared, ``_`` while it is absent."""
        keys = sorted({key for s in self.steps for key in s.samples if key[0] in names or key[0] == "up"})
        out = []
        for key in keys:
            values: list[str] = []
            for i, s in enumerate(self.steps):
                if key in s.samples:
                    values.append(_format(self._value(key[0], s.samples[key], s, 60.0 * i)))
                else:
                    values.append("stale" if values and values[-1] not in ("stale", "_") else "_")
            labels = ",".join(f'{k}="{v}"' for k, v in key[1])
            out.append({"series": f"{key[0]}{{{labels}}}", "values": " ".join(values)})
        return out


def promtool_test(timeline: Timeline, names: set[str], alerts: Iterable[str],
                  firing: Mapping[str, list[dict[str, str]]],
                  exprs: Iterable[tuple[str, list[dict[str, Any]]]] = ()) -> dict[str, Any]:
    """One promtool test: *timeline*'s series; at its last step every alert of *alerts*
    fires with exactly the label sets of *firing* (none when absent), and each expression
    of *exprs* gives exactly its samples."""
    return {
        "interval": "1m",
        "input_series": timeline.input_series(names),
        "alert_rule_test": [
            {"eval_time": timeline.end, "alertname": name,
             "exp_alerts": [{"exp_labels": labels} for labels in firing.get(name, [])]}
            for name in sorted(alerts)
        ],
        "promql_expr_test": [
            {"expr": expr, "eval_time": timeline.end, "exp_samples": samples} for expr, samples in exprs
        ],
    }
