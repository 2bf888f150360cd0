"""Prometheus metrics of ``run`` (``--metrics-port``).

Counters by consumer and outcome, by rejection code, retries and dead
letters; histograms of the apply-and-commit latency of a batch, of batch
sizes and of each event's age at commit; gauges for the time of the last commit, the connection state and the
database's health.
Each :class:`Metrics` has its own registry, so several consumers can run in
one process (tests) without clashing, and nothing is global.

``run`` keeps :class:`Metrics` in its worker process (where the work is) and
serves ``/metrics`` from its connection process (:class:`RunExposition`): the
connection process sets ``delivery_connected`` itself and adds the worker's
latest figures, which the worker sends about once a second with the time it
made them (``delivery_worker_heartbeat_timestamp_seconds``). A worker stuck in
a batch leaves that timestamp behind; the scrape still answers.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter as Tally
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ..model.contract import Outcome
from ..model.deliveries import Observer

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
#: An event's age at commit: tens of milliseconds when all is well, up to
#: hours behind a backlog (or a replay of old events).
_AGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0,
                21600.0, 86400.0)


class Metrics(Observer):
    """An :class:`deliveries.Observer` that keeps Prometheus metrics."""

    def __init__(self, consumer: str, partition: int | None = None, *, connection: bool = True) -> None:
        """*connection* False: no ``delivery_connected`` here (:class:`RunExposition` has it)."""
        self.consumer = consumer
        #: Label values every series starts with: the consumer, and the
        #: partition when the run serves one (label ``partition``).
        base = ["consumer"] if partition is None else ["consumer", "partition"]
        c = self._base = (consumer,) if partition is None else (consumer, str(partition))
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.events = Counter("delivery_events", "Events handled, by outcome (a result, a rejection code, "
                              "or transient:<code>).", [*base, "outcome"], registry=r)
        self.rejections = Counter("delivery_rejections", "Events rejected permanently, by code.",
                                  [*base, "code"], registry=r)
        self.retries = Counter("delivery_retries", "Copies sent to a retry tier.", base, registry=r)
        self.dead_letters = Counter("delivery_dead_letters", "Copies sent to the dead-letter queue, by code.",
                                    [*base, "code"], registry=r)
        self.forwarded = Counter("delivery_forwarded", "Events of another partition sent on to their partition's "
                                 "queue.", base, registry=r)
        self.apply_seconds = Histogram("delivery_apply_seconds", "Time to apply and commit one batch.",
                                       base, buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("delivery_batch_size", "Deliveries per transaction.", base,
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.event_age = Histogram("delivery_event_age_seconds", "Age of each event at its commit: since the "
                                   "producer wrote it (stamp=produced, header x-produced-ms) or, without that "
                                   "header, since its occurredAt (stamp=occurred).", [*base, "stamp"],
                                   buckets=_AGE_BUCKETS, registry=r)
        self.last_commit = Gauge("delivery_last_commit_timestamp_seconds", "Unix time of the last commit.",
                                 base, registry=r)
        self.connected = Gauge("delivery_connected", "1 while consuming from the broker, else 0.",
                               base, registry=r if connection else None)
        self.store_healthy = Gauge("delivery_store_healthy", "1 while the database works, 0 while it fails as "
                                   "a whole (disk full, I/O error, busy, read-only): deliveries are held.",
                                   base, registry=r)
        self.held = Gauge("delivery_held_deliveries", "Deliveries held unacked because the queue their copy goes "
                          "to (the dead queue, a retry tier) did not accept it yet; retried, no attempt spent.",
                          base, registry=r)
        self.connected.labels(*c).set(0)
        self.store_healthy.labels(*c).set(1)
        self.last_commit.labels(*c).set(0)
        self.held.labels(*c).set(0)

    def batch_committed(self, outcomes: Sequence[Outcome], seconds: float, committed_at: float = 0.0) -> None:
        c = self._base
        for status, n in Tally(o.status for o in outcomes).items():
            self.events.labels(*c, status).inc(n)
        for o in outcomes:
            if o.rejection is not None:
                self.rejections.labels(*c, o.rejection.code).inc()
        self.apply_seconds.labels(*c).observe(seconds)
        self.batch_size.labels(*c).observe(len(outcomes))
        if committed_at:
            self.last_commit.labels(*c).set(committed_at)

    wants_ages = True

    def event_ages(self, stamp: str, seconds: Sequence[float]) -> None:
        observe = self.event_age.labels(*self._base, stamp).observe
        for age in seconds:
            observe(age)

    def copy_published(self, kind: str, code: str) -> None:
        if kind == "retry":
            self.retries.labels(*self._base).inc()
        elif kind == "forward":
            self.forwarded.labels(*self._base).inc()
        else:
            self.dead_letters.labels(*self._base, code).inc()

    def connection_state(self, connected: bool) -> None:
        self.connected.labels(*self._base).set(1 if connected else 0)

    def store_health(self, healthy: bool) -> None:
        self.store_healthy.labels(*self._base).set(1 if healthy else 0)

    def copies_held(self, count: int) -> None:
        self.held.labels(*self._base).set(count)

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Expose ``/metrics`` on *addr*:*port* from a daemon thread."""
        return start_http_server(port, addr=addr, registry=self.registry)

    def text(self) -> str:
        """The exposition text (what a scrape returns)."""
        return generate_latest(self.registry).decode("utf-8")


class _QuietServer(ThreadingHTTPServer):
    """A scraper that gave up (its timeout passed while the queue depths were asked)
    closed its end: that is its business, not a traceback in run's log."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            return
        logging.getLogger("delivery_consumer.observability.metrics").warning(
            "a metrics scrape from %s failed: %s: %s", client_address[0] if client_address else "?",
            type(error).__name__, error)


class WriterCollector(Collector):
    """The writer of the run's database as its note says, asked at scrape time:
    ``delivery_writer_heartbeat_age_seconds{holder}`` (how long the holder has not
    touched its note) and ``delivery_writer_stopped{holder}`` (1 when that process
    is stopped: SIGSTOP, a debugger). What a standby reports of a frozen active."""

    def __init__(self, db_path: Path, labels: dict[str, str]) -> None:
        self.db_path = db_path
        self.labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from ..store import liveness
        from ..store.dbfile import read_note

        pid, _what, silent = read_note(self.db_path)
        if pid is None or silent is None:
            return
        names = [*self.labels, "holder"]
        values = [*self.labels.values(), str(pid)]
        age = GaugeMetricFamily("delivery_writer_heartbeat_age_seconds", "Seconds since the process that holds "
                                "the database last touched its note (<db>.lock, about every second).",
                                labels=names)
        age.add_metric(values, round(silent, 1))
        stopped = GaugeMetricFamily("delivery_writer_stopped", "1 when the process that holds the database is "
                                    "stopped (SIGSTOP, a debugger): frozen, it holds the database and acks nothing.",
                                    labels=names)
        stopped.add_metric(values, 1.0 if liveness.process_state(pid, None)[0] == liveness.STOPPED else 0.0)
        yield age
        yield stopped


class RunExposition:
    """``/metrics`` of ``run``, served by its connection process.

    Its own series -- ``delivery_connected`` (set by the connection process,
    which knows), ``delivery_active`` (0 until the worker says it holds the
    database: a partition's standby waits for it),
    ``delivery_worker_heartbeat_timestamp_seconds`` and whatever *collectors*
    add (queue depths) -- then the worker's latest exposition text as the
    worker sent it (:meth:`worker_vitals`).
    """

    def __init__(self, consumer: str, partition: int | None = None,
                 collectors: Sequence[Collector] = ()) -> None:
        base = ["consumer"] if partition is None else ["consumer", "partition"]
        self._labels = (consumer,) if partition is None else (consumer, str(partition))
        self.registry = CollectorRegistry()
        self.connected = Gauge("delivery_connected", "1 while consuming from the broker, else 0 (set by run's "
                               "connection process).", base, registry=self.registry)
        self.broker_node = Gauge("delivery_broker_connected", "1 for the broker node (host:port of its address) "
                                 "run consumes from, 0 for a node it consumed from before.",
                                 [*base, "node"], registry=self.registry)
        self._node: str | None = None
        self.heartbeat = Gauge("delivery_worker_heartbeat_timestamp_seconds",
                               "Unix time at which run's worker process last reported (about every second "
                               "while it is not inside a batch); behind: the worker is stuck.",
                               base, registry=self.registry)
        self.active_run = Gauge("delivery_active", "1 while this run holds its database, 0 while it is a "
                                "partition's standby waiting for it.", base, registry=self.registry)
        self.connected.labels(*self._labels).set(0)
        self.heartbeat.labels(*self._labels).set(0)
        self.active_run.labels(*self._labels).set(0)
        for collector in collectors:
            self.registry.register(collector)
        self._worker_text = b""
        self._server: ThreadingHTTPServer | None = None

    def connection_state(self, connected: bool, node: str | None = None) -> None:
        """Consuming or not; *node*: the ``host:port`` of the broker node in use."""
        self.connected.labels(*self._labels).set(1 if connected else 0)
        if self._node is not None and (not connected or node != self._node):
            self.broker_node.labels(*self._labels, self._node).set(0)
        if connected and node is not None:
            self.broker_node.labels(*self._labels, node).set(1)
            self._node = node

    def active(self, active: bool) -> None:
        self.active_run.labels(*self._labels).set(1 if active else 0)

    def worker_vitals(self, at: float, text: bytes) -> None:
        """The worker's exposition *text*, made at Unix time *at*."""
        self._worker_text = text
        self.heartbeat.labels(*self._labels).set(at)

    def text(self) -> bytes:
        """What a scrape returns."""
        return generate_latest(self.registry) + self._worker_text

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Listen on *addr*:*port* (OSError when it cannot) and serve from a daemon thread."""
        exposition = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a client that sends nothing does not hold a thread

            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/", "/metrics"):
                    self.send_error(404)
                    return
                body = exposition.text()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = _QuietServer((addr, port), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()

    def close(self) -> None:
        """Stop serving and free the port."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
