"""What tracing costs ``run``'s worker: events/s with an SDK tracer provider against tracing off.

    python bench/bench_tracing.py [--events 50000] [--batch 250] [--repeat 5]

The worker of ``run`` (service/worker.py: parse, apply, commit, ack) is
driven in this process with a connection that acks into the void, on a fresh
catalog database per run, so the figure is the worker's alone (the broker
and the pipe to the connection process would only add the same time to
both sides). Every event carries a producer context in ``meta.traceparent``.

* ``off`` -- no tracer provider: the hooks are a dict lookup;
* ``on`` -- the SDK's TracerProvider with a BatchSpanProcessor and an
  exporter that drops what it is given (what an OTLP exporter costs the
  process, minus the network): a span per batch, its four phases, a span per
  event;
* ``on-10%`` -- the same, with one producer trace in ten sampled (head
  sampling at the producer, ``traceparent`` flags ``00`` for the others):
  an event of an unsampled trace gets no span;
* ``links`` -- ``DELIVERY_TRACE_EVENTS=links``: every event a link of its
  batch's span (with its result and attempt) instead of a span.

Runs alternate; each ratio is on/off of the medians (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from delivery_consumer import tracing
from delivery_consumer.deliveries import Delivery, OutMessage
from delivery_consumer.service.config import RunConfig
from delivery_consumer.service.worker import Worker

GOAL = 0.9


class Drop(SpanExporter):
    """Takes every span and keeps none."""

    def __init__(self) -> None:
        self.count = 0

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self.count += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class VoidIO:
    """The connection of a worker whose acks go nowhere."""

    def pump(self, timeout: float) -> None:
        return None

    def ack(self, generation: int, tag: int, *, multiple: bool = True) -> None:
        return None

    def publish_copies(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]:
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def reconnect(self, why: str) -> None:
        return None

    def shutdown(self) -> None:
        return None


def deliveries(count: int, batch: int, sampled_every: int = 1) -> list[list[Delivery]]:
    """*count* deliveries in batches of *batch*; one producer trace in *sampled_every* is sampled."""
    out: list[Delivery] = []
    for i in range(count):
        flags = "01" if i % sampled_every == 0 else "00"
        traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-{flags}"
        event = {"eventId": str(uuid.uuid4()), "type": "material.published", "articleId": f"article-{i}",
                 "revision": 1, "occurredAt": "2026-11-29T10:00:00Z",
                 "data": {"title": f"Title {i}", "url": f"https://example.org/{i}"},
                 "meta": {"traceparent": traceparent}}
        out.append(Delivery(1, i + 1, orjson.dumps(event), "material.published", False, event["eventId"], {},
                            "application/json", "events"))
    return [out[i:i + batch] for i in range(0, len(out), batch)]


def one_run(batches: list[list[Delivery]], workdir: Path) -> tuple[float, float]:
    """Events per second of the worker over *batches* on a fresh database,
    and the CPU time of the worker's thread per event (microseconds: on a
    shared machine, less noisy than the wall clock; the exporter's thread is
    not in it)."""
    config = RunConfig(consumer="catalog", url="amqp://unused", db_path=workdir / f"{uuid.uuid4().hex}.db")
    worker = Worker(config)
    worker.io = VoidIO()
    assert worker.open(), worker.error
    worker.channel_opened(1)
    started, cpu = time.perf_counter(), time.thread_time()
    for items in batches:
        worker.process(items)
    elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu
    worker.close()
    count = sum(len(b) for b in batches)
    return count / elapsed, cpu / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=250)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    every = {"off": 1, "on": 1, "on-10%": 10, "links": 1}
    data = {mode: deliveries(args.events, args.batch, n) for mode, n in every.items()}
    exporter = Drop()
    provider = TracerProvider(span_limits=SpanLimits(max_links=args.batch))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    rates: dict[str, list[float]] = {mode: [] for mode in every}
    cpus: dict[str, list[float]] = {mode: [] for mode in every}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        one_run(data["off"][:4], Path(tmp))  # warm-up: imports, schema compilation
        for round_ in range(args.repeat):
            for mode in every:
                tracing.set_provider(None if mode == "off" else provider)
                tracing.events_as_links(mode == "links")
                rate, cpu = one_run(data[mode], Path(tmp))
                provider.force_flush()
                rates[mode].append(rate)
                cpus[mode].append(cpu)
                print(f"round {round_ + 1} {mode:>6}: {rate:,.0f} events/s, {cpu:.1f} us CPU/event", flush=True)
    tracing.set_provider(None)
    provider.shutdown()
    off, off_cpu = statistics.median(rates["off"]), statistics.median(cpus["off"])
    print(f"worker, {args.events} events in batches of {args.batch}, {exporter.count} spans exported")
    for mode, what in (("on", "span per event, every producer trace sampled"),
                       ("on-10%", "span per event, 1 producer trace in 10 sampled"),
                       ("links", "events as links of the batch span")):
        on, on_cpu = statistics.median(rates[mode]), statistics.median(cpus[mode])
        ratio = on / off
        print(f"tracing on ({what}) / off: {on:,.0f} / {off:,.0f} events/s = {ratio:.2f}x (goal >= {GOAL}x): "
              f"{'ok' if ratio >= GOAL else 'MISSED'}; CPU {on_cpu:.1f} / {off_cpu:.1f} us/event = "
              f"{off_cpu / on_cpu:.2f}x")

if __name__ == "__main__":
    main()
