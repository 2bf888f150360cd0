"""What tracing costs ``run``'s worker: events/s with an SDK tracer provider against tracing off.

    python bench/bench_tracing.py [--events 20000] [--batch 250] [--repeat 7]

The worker of ``run`` (service/worker.py: parse, apply, commit, ack) is
driven in this process with a connection that acks into the void, on a fresh
catalog database per run, so the figure is the worker's alone (the broker
and the pipe to the connection process would only add the same time to
both sides). Every event carries a producer context in ``meta.traceparent``.
The exporter takes every span and keeps none (what an OTLP exporter costs
the process, minus its encoding and the network).

* ``off`` -- no tracer provider: the hooks are a dict lookup;
* ``on`` -- what ``run`` sets up from ``OTEL_TRACES_EXPORTER``
  (``tracing.build_provider``: a BatchSpanProcessor): a span per batch, its
  four phases, a span per event, built in the export thread;
* ``on-own`` -- a TracerProvider the process built itself with a
  BatchSpanProcessor (``tracing.set_provider``): the same spans, built
  in the worker's thread when the batch ends;
* ``on-10%`` -- ``on`` with one producer trace in ten sampled (head
  sampling at the producer, ``traceparent`` flags ``00`` for the others):
  an event of an unsampled trace gets no span;
* ``links`` -- ``on`` with ``DELIVERY_TRACE_EVENTS=links``: every event a
  link of its batch's span (with its result and attempt) instead of a span;
* ``plain`` -- ``on`` with the SDK's fast path off (``DELIVERY_TRACE_FAST=0``,
  as with an SDK outside the tested versions): the same spans, each started
  and ended through the API.

The modes alternate within a round; each round's ratio is the mode's figure
over the ``off`` figure of the same round (paired), and the median and the
range of the rounds' ratios are printed (goal >= 0.9). Three figures: events
per second (wall clock), the CPU time of the worker's thread, and the CPU
time of the whole process (the export thread included) per event.

On a loaded machine, count instructions instead (load-independent; both
threads; the difference of two sizes leaves out start-up)::

    for n in 1000 3000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python bench/bench_tracing.py --only on --events $n 2>&1 | grep Collected; done
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
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from delivery_consumer.model.deliveries import Delivery, OutMessage
from delivery_consumer.observability import tracing
from delivery_consumer.service.settings import RunConfig
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


def one_run(batches: list[list[Delivery]], workdir: Path) -> tuple[float, float, float]:
    """Events per second of the worker over *batches* on a fresh database,
    the CPU time of the worker's thread per event and that of the process
    per event (microseconds; the export thread's work on these events is in
    the latter: the run ends with a flush)."""
    config = RunConfig(consumer="catalog", url="amqp://unused", db_path=workdir / f"{uuid.uuid4().hex}.db")
    worker = Worker(config)
    worker.io = VoidIO()
    assert worker.open(), worker.error
    worker.channel_opened(1)
    tracing.flush()
    started, cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
    for items in batches:
        worker.process(items)
    tracing.flush()
    elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu
    process_cpu = time.process_time() - process_cpu
    worker.close()
    count = sum(len(b) for b in batches)
    return count / elapsed, cpu / count * 1e6, process_cpu / count * 1e6


MODES = {
    "on": "span per event, run's provider (built in the export thread)",
    "on-own": "span per event, a provider of the process's own (built at the batch's end)",
    "on-10%": "span per event, 1 producer trace in 10 sampled",
    "links": "events as links of the batch span",
    "plain": "span per event, run's provider, every span through the API (the fast path off)",
}


def only(mode: str, sampled_every: int, events: int, batch: int) -> None:
    """One pass of *mode* over *events* (after a warm-up of two batches), the
    data made beforehand from a fixed number of events: under
    ``valgrind --tool=callgrind``, the difference between two counts of
    *events* is the instructions those events cost, both threads included."""
    data = deliveries(max(events, 10_000) + 2 * batch, batch, sampled_every)
    exporter = Drop()
    if mode == "on-own":
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    else:
        provider = tracing.build_provider([exporter])
    tracing.set_provider(None if mode == "off" else provider)
    tracing.events_as_links(mode == "links")
    tracing.fast_path(mode != "plain")
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        one_run(data[:2], Path(tmp))
        one_run(data[2:2 + events // batch], Path(tmp))
    tracing.set_provider(None)
    provider.shutdown()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=250)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--only", choices=["off", *MODES],
                        help="one pass of this mode over --events, nothing printed: for a count of instructions")
    args = parser.parse_args()
    every = {"off": 1, "on": 1, "on-own": 1, "on-10%": 10, "links": 1, "plain": 1}
    if args.only:
        only(args.only, every[args.only], args.events, args.batch)
        return
    data = {mode: deliveries(args.events, args.batch, n) for mode, n in every.items()}
    exporter = Drop()
    ours = tracing.build_provider([exporter])
    own = TracerProvider()
    own.add_span_processor(BatchSpanProcessor(exporter))
    figures: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in every}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        for mode in every:  # warm-up: imports, schema compilation, each path once
            tracing.set_provider({"off": None, "on-own": own}.get(mode, ours))
            tracing.events_as_links(mode == "links")
            tracing.fast_path(mode != "plain")
            one_run(data[mode][:4], Path(tmp))
        for round_ in range(args.repeat):
            for mode in every:
                tracing.set_provider({"off": None, "on-own": own}.get(mode, ours))
                tracing.events_as_links(mode == "links")
                tracing.fast_path(mode != "plain")
                figures[mode].append(one_run(data[mode], Path(tmp)))
                rate, cpu, process_cpu = figures[mode][-1]
                print(f"round {round_ + 1} {mode:>6}: {rate:,.0f} events/s, CPU/event {cpu:.1f} us (thread), "
                      f"{process_cpu:.1f} us (process)", flush=True)
    tracing.set_provider(None)
    tracing.events_as_links(False)
    tracing.fast_path(True)
    ours.shutdown()
    own.shutdown()
    off = figures["off"]
    print(f"worker, {args.events} events in batches of {args.batch}, {args.repeat} rounds, "
          f"{exporter.count} spans exported; ratios on/off per round: median [min-max]")
    print(f"tracing off: {statistics.median(f[0] for f in off):,.0f} events/s, "
          f"{statistics.median(f[1] for f in off):.1f} us thread CPU/event, "
          f"{statistics.median(f[2] for f in off):.1f} us process CPU/event")
    for mode, what in MODES.items():
        on = figures[mode]
        rate = [o[0] / f[0] for o, f in zip(on, off, strict=True)]
        thread = [f[1] / o[1] for o, f in zip(on, off, strict=True)]
        process = [f[2] / o[2] for o, f in zip(on, off, strict=True)]
        verdict = "ok" if statistics.median(rate) >= GOAL else "MISSED"
        print(f"{mode:>6} ({what}): {statistics.median(o[0] for o in on):,.0f} events/s = {spread(rate)} of off "
              f"(goal >= {GOAL}x: {verdict}); thread CPU {spread(thread)}; process CPU {spread(process)}")


if __name__ == "__main__":
    main()
