"""Prometheus metrics of ``dispatch`` (``--metrics-port``).

Gauges read from the outbox at each scrape (so they are right whichever
dispatcher did the work): rows by state -- ``due``, ``leased``,
``retrying``, ``held``, ``quarantined``, ``published``, ``dropped`` -- and the
age of the oldest pending row (quarantined rows wait for a person: their
count is the ``quarantined`` state). Counters of this process: publication
results by status, rows quarantined, broker outages; whether it is connected, and whether an
outage is open.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from .db import open_db
from .dispatcher import DispatchStats
from .queries import stats

ROW_STATES = ("due", "leased", "retrying", "held", "quarantined", "published", "dropped")


class OutboxCollector(Collector):
    """Reads the outbox (read-only, its own connection) at every scrape."""

    def __init__(self, path: Path | str, dispatch: DispatchStats | None = None) -> None:
        self.path = path
        self.dispatch = dispatch

    def collect(self) -> Iterator[Any]:
        with closing(open_db(self.path, readonly=True)) as conn:
            now = stats(conn)
        rows = GaugeMetricFamily("outbox_rows", "Rows of the outbox by state (quarantined: a person must act).",
                                 labels=["state"])
        for state in ROW_STATES:
            rows.add_metric([state], now[state])
        yield rows
        yield GaugeMetricFamily("outbox_oldest_pending_age_seconds",
                                "Age of the oldest row waiting for dispatch, quarantined ones aside (0: none).",
                                value=now["oldestPendingAgeSeconds"] or 0.0)
        if self.dispatch is not None:
            results = CounterMetricFamily("outbox_dispatch_results", "Publications by this process, by result.",
                                          labels=["result"])
            for result, n in sorted(self.dispatch.results.items()):
                results.add_metric([result], n)
            yield results
            yield CounterMetricFamily("outbox_dispatch_quarantined", "Rows this process quarantined.",
                                      value=self.dispatch.quarantined)
            yield CounterMetricFamily("outbox_dispatch_outages", "Broker outages this process waited out.",
                                      value=self.dispatch.outages)
            yield GaugeMetricFamily("outbox_dispatch_connected", "1 while this process is connected to the "
                                    "broker, 0 while it waits for it.", value=1 if self.dispatch.online else 0)
            yield GaugeMetricFamily("outbox_dispatch_outage", "1 while this process waits out a broker outage: no "
                                    "connection, confirms lost, or a destination that nacks every message.",
                                    value=1 if self.dispatch.in_outage else 0)


def registry(path: Path | str, dispatch: DispatchStats | None = None) -> CollectorRegistry:
    """A registry with the outbox's metrics and the process collector."""
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    reg.register(OutboxCollector(path, dispatch))
    return reg


def serve(reg: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` from a daemon thread."""
    return start_http_server(port, addr=addr, registry=reg)


__all__ = ["ROW_STATES", "OutboxCollector", "registry", "serve"]
