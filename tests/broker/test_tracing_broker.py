"""One trace from a producer's span to every consumer's apply, through the
outbox, ``dispatch``, RabbitMQ, a retry tier and a dead letter requeued by
hand, with real processes.

The producer's span is this test's (an SDK tracer with the in-memory
exporter); ``run`` exports its spans with ``OTEL_TRACES_EXPORTER=jsonl``
to one file that every process appends to, and the test reads the parent
and link structure from it. ``TRACING_TEST_KEEP=path`` keeps that file
(bench/render_trace.py draws the picture of docs/tracing.md from it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import flaky_consumer  # noqa: F401  (registers the "flaky" consumer here too)
import orjson
import pytest
from brokerkit import Namespace
from support import new_event

from delivery_consumer import outbox

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

FAST_RETRY = ("--retry-delays", "100ms,200ms,300ms", "--max-attempts", "2")


def spans_of(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def test_one_trace_from_the_producer_to_each_consumer_across_a_retry_and_a_requeue(ns: Namespace) -> None:
    """Every apply of every event, in both consumers, retry attempts and the
    apply after a hand requeue included, is a span of the producer's trace
    whose parent is the producer's span, linked to its consumer's batch span;
    the dispatcher published the producer's context as the traceparent header."""
    spans_file = ns.workdir / "spans.jsonl"
    env = ns.env(OTEL_TRACES_EXPORTER="jsonl", DELIVERY_TRACES_FILE=str(spans_file), OTEL_SERVICE_NAME="run",
                 DELIVERY_PLUGINS="flaky_consumer", FLAKY_DIR=str(ns.workdir / "flaky"))
    provider = sdk_trace.TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    events = [new_event(article_id="fine", title="fine"), new_event(article_id="once", title="transient:1"),
              new_event(article_id="twice", title="transient:2")]
    conn = outbox.connect(ns.workdir / "producer.db")
    try:
        with provider.get_tracer("shop").start_as_current_span("POST /articles") as request, \
                outbox.transaction(conn):
            for event in events:
                outbox.enqueue(conn, event)
    finally:
        conn.close()
    producer = request.get_span_context()
    traceparent = f"00-{producer.trace_id:032x}-{producer.span_id:016x}-{int(producer.trace_flags):02x}"

    dispatched = ns.cli("dispatch", "--db", str(ns.workdir / "producer.db"), "--consumer", "catalog",
                        "--consumer", "flaky", "--exit-when-idle", "1s", "--poll", "100ms", env=env)
    assert 0 == dispatched.returncode, dispatched.stderr
    queued = ns.peek(ns.topology("catalog").queue)
    assert [traceparent] * 3 == [props.headers["traceparent"] for props, _ in queued]

    for consumer, args in (("catalog", ()), ("flaky", FAST_RETRY)):
        done = ns.run_until_idle(consumer, *args, idle=2, env=env)
        assert 0 == done.returncode, done.stderr
    assert 1 == ns.count(ns.topology("flaky").dead_queue)  # transient:2 ran out of its 2 attempts
    requeued = ns.cli("dead", "requeue", "--consumer", "flaky", "--db", str(ns.db("flaky")), "--all", env=env)
    assert 0 == requeued.returncode, requeued.stderr
    done = ns.run_until_idle("flaky", *FAST_RETRY, idle=2, env=env)
    assert 0 == done.returncode, done.stderr

    for span in exporter.get_finished_spans():  # the producer's span joins the file: one trace to read
        with spans_file.open("a", encoding="utf-8") as out:
            out.write(span.to_json(indent=None) + "\n")
    if os.environ.get("TRACING_TEST_KEEP"):
        shutil.copyfile(spans_file, os.environ["TRACING_TEST_KEEP"])

    spans = spans_of(spans_file)
    batches = {s["context"]["span_id"]: s for s in spans if s["name"].endswith(" batch")}
    applies: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for span in spans:
        if " apply" in span["name"]:
            attributes = span["attributes"]
            applies.setdefault((attributes["delivery_consumer.consumer"], attributes["messaging.message.id"]),
                               []).append(span)
    assert {(c, e["eventId"]) for c in ("catalog", "flaky") for e in events} == set(applies)
    for found in applies.values():
        for span in found:
            assert f"0x{producer.trace_id:032x}" == span["context"]["trace_id"]
            assert f"0x{producer.span_id:016x}" == span["parent_id"]
            (link,) = span["links"]
            batch = batches[link["context"]["span_id"]]
            assert span["attributes"]["delivery_consumer.consumer"] == batch["attributes"]["delivery_consumer.consumer"]

    def results(consumer: str, event: dict[str, Any]) -> list[tuple[int, str]]:
        found = applies[(consumer, event["eventId"])]
        return sorted((s["attributes"]["delivery_consumer.attempt"], s["attributes"]["delivery_consumer.result"])
                      for s in found)

    assert [[(1, "updated")]] * 3 == [results("catalog", e) for e in events]
    assert [(1, "recorded")] == results("flaky", events[0])
    assert [(1, "transient:dependency-down"), (2, "recorded")] == results("flaky", events[1])
    # two attempts, dead-lettered; requeued by hand it starts again at attempt 1, and is applied
    assert [(1, "recorded"), (1, "transient:dependency-down"), (2, "transient:dependency-down")] == \
        results("flaky", events[2])
    for batch in batches.values():
        phases = {s["name"] for s in spans if s["parent_id"] == batch["context"]["span_id"]}
        assert {"consume", "apply", "ack"} <= phases
