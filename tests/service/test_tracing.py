"""OpenTelemetry traces in one process: the producer's context in the outbox
row, the dispatcher's header, the worker's batch and event spans, the
fence's call and its ``traceparent`` header, with the SDK's
InMemorySpanExporter. The whole path through RabbitMQ and real processes is
tests/broker/test_tracing_broker.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
from support import body, new_event
from test_worker import Recorder, delivery, on_memory_link

from delivery_consumer import outbox
from delivery_consumer.amqp.topology import H_ATTEMPTS
from delivery_consumer.model.envelope import from_mapping
from delivery_consumer.observability import tracing
from delivery_consumer.service.settings import RunConfig
from delivery_consumer.service.worker import Worker

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["own", "run-immediate", "run-batched", "own-plain", "run-batched-plain"])
def spans(request: pytest.FixtureRequest) -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider (in-memory exporter) that the tracing hooks use, for this test only:
    a process's own (spans built when a batch ends), or run's (tracing.build_provider: built
    by the exporter, at once or in the batch processor's thread; read after tracing.flush);
    with the SDK's fast path, or ``-plain``: every span started and ended through the API."""
    exporter = InMemorySpanExporter()
    assert tracing.fast_path(not request.param.endswith("-plain")) or request.param.endswith("-plain")
    kind = request.param.removesuffix("-plain")
    if kind == "own":
        provider = sdk_trace.TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif kind == "run-immediate":
        provider = tracing.build_provider(immediate=[exporter])
    else:
        provider = tracing.build_provider(batched=[exporter])
    tracing.set_provider(provider)
    yield exporter
    tracing.set_provider(None)
    provider.shutdown()
    tracing.fast_path(True)


def producer_tracer() -> Any:
    """A tracer of its own provider: the producer's span need not be exported here."""
    return sdk_trace.TracerProvider().get_tracer("producer")


def traceparent(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def stored(conn: Any, event_id: str) -> dict[str, Any]:
    row = conn.execute("SELECT body FROM outbox WHERE event_id = ?", (event_id,)).fetchone()
    obj: dict[str, Any] = orjson.loads(row[0])
    return obj


def test_enqueue_records_the_current_span_in_meta_outside_the_fingerprint(tmp_path: Path) -> None:
    """Enqueued inside a span, the row's envelope carries that span as
    meta.traceparent, with the fingerprint of the envelope without it; the
    same event enqueued again from another trace is the same row (a no-op)."""
    conn = outbox.connect(tmp_path / "producer.db")
    event = new_event(article_id="a-1")
    tracer = producer_tracer()
    with tracer.start_as_current_span("request") as request, outbox.transaction(conn):
        assert outbox.enqueue(conn, event)
    assert {"traceparent": traceparent(request)} == stored(conn, event["eventId"])["meta"]
    fingerprint = conn.execute("SELECT fingerprint FROM outbox").fetchone()[0]
    assert from_mapping(event).fingerprint == fingerprint
    with tracer.start_as_current_span("another request"), outbox.transaction(conn):
        assert not outbox.enqueue(conn, event)
    assert traceparent(request) == stored(conn, event["eventId"])["meta"]["traceparent"]


def test_enqueue_keeps_a_traceparent_the_producer_set_and_its_other_meta(tmp_path: Path) -> None:
    """A producer's own meta.traceparent wins; correlationId is kept when the span's is added."""
    conn = outbox.connect(tmp_path / "producer.db")
    own = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    mine = new_event(meta={"traceparent": own})
    correlated = new_event(meta={"correlationId": "order-7"})
    with producer_tracer().start_as_current_span("request") as request, outbox.transaction(conn):
        outbox.enqueue(conn, mine)
        outbox.enqueue(conn, correlated)
    assert {"traceparent": own} == stored(conn, mine["eventId"])["meta"]
    assert {"correlationId": "order-7", "traceparent": traceparent(request)} == \
        stored(conn, correlated["eventId"])["meta"]


def test_without_a_current_span_the_row_is_the_envelope_as_given(tmp_path: Path) -> None:
    """No span is current: the stored bytes are the envelope's canonical bytes, no meta added."""
    conn = outbox.connect(tmp_path / "producer.db")
    event = new_event()
    with outbox.transaction(conn):
        outbox.enqueue(conn, event)
    row = conn.execute("SELECT body FROM outbox").fetchone()[0]
    assert from_mapping(event).canonical == row


def test_the_dispatcher_header_is_the_rows_traceparent() -> None:
    """message_headers adds the body's meta.traceparent to the slot headers; a body without one is left alone."""
    own = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    with_meta = from_mapping(new_event(meta={"traceparent": own})).canonical
    assert {"x": 1, "traceparent": own} == tracing.message_headers({"x": 1}, with_meta)
    assert {"x": 1} == tracing.message_headers({"x": 1}, from_mapping(new_event()).canonical)
    assert tracing.message_headers(None, b"not json \"traceparent\"") is None


def make_worker(tmp_path: Path, consumer: str = "catalog", **options: Any) -> tuple[Worker, Recorder]:
    config = RunConfig(consumer=consumer, url="memory:", db_path=tmp_path / f"{consumer}.db", **options)
    worker = Worker(config)
    assert worker.open(), worker.error
    return worker, on_memory_link(worker)


def finished(exporter: InMemorySpanExporter) -> list[Any]:
    """The spans exported so far, once what the provider holds is exported."""
    tracing.flush()
    return list(exporter.get_finished_spans())


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for span in finished(exporter):
        out.setdefault(span.name, []).append(span)
    return out


def test_a_batch_has_its_phases_and_each_event_is_a_child_of_its_producer(
        tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """One span per batch with consume/apply/commit/ack children; one span per
    event whose parent is the producer's span (from the body's meta or the
    traceparent header), linked to the batch, with result, consumer and attempt."""
    worker, io = make_worker(tmp_path)
    producer = producer_tracer()
    with producer.start_as_current_span("request") as request:
        in_meta = new_event(article_id="a-1", meta={"traceparent": traceparent(request)})
    with producer.start_as_current_span("other request") as other:
        in_header = new_event(article_id="a-2")
    plain = new_event(article_id="a-3")
    items = [delivery(1, body(in_meta)),
             delivery(2, body(in_header), headers={"traceparent": traceparent(other), H_ATTEMPTS: 1}),
             delivery(3, body(plain)), delivery(4, b"{broken")]
    worker.process(items)
    assert ["ack"] == io.kinds()[-1:]
    named = by_name(spans)
    (batch,) = named["catalog batch"]
    assert 4 == batch.attributes["messaging.batch.message_count"]
    for phase in ("consume", "apply", "commit", "ack"):
        (span,) = named[phase]
        assert batch.context.span_id == span.parent.span_id
    events = {s.attributes.get("messaging.message.id"): s for s in named["catalog apply material.published"]}
    first, second, third = events[in_meta["eventId"]], events[in_header["eventId"]], events[plain["eventId"]]
    assert (request.get_span_context().trace_id, request.get_span_context().span_id) == \
        (first.context.trace_id, first.parent.span_id)
    assert (other.get_span_context().trace_id, other.get_span_context().span_id) == \
        (second.context.trace_id, second.parent.span_id)
    assert third.parent is None  # no producer context: a root
    for span in (first, second, third):
        assert [batch.context.span_id] == [link.context.span_id for link in span.links]
        assert "catalog" == span.attributes["delivery_consumer.consumer"]
        assert "updated" == span.attributes["delivery_consumer.result"]
    assert (1, 2) == (first.attributes["delivery_consumer.attempt"], second.attributes["delivery_consumer.attempt"])
    (broken,) = named["catalog apply"]
    assert "malformed-json" == broken.attributes["delivery_consumer.result"]


def test_a_duplicate_and_a_stale_event_say_so(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """The event span's result is the outcome: duplicate:..., stale."""
    worker, _io = make_worker(tmp_path)
    newer = new_event(article_id="a-1", revision=2)
    worker.process([delivery(1, body(newer))])
    worker.process([delivery(2, body(newer)), delivery(3, body(new_event(article_id="a-1", revision=1)))])
    results = sorted(s.attributes["delivery_consumer.result"] for s in finished(spans)
                     if s.name.startswith("catalog apply"))
    assert 3 == len(results)
    assert "stale" in results and "updated" in results
    assert any(r.startswith("duplicate:") for r in results)


def test_no_provider_means_no_batch_and_no_span(tmp_path: Path) -> None:
    """Without an active tracer provider the worker's hooks are the shared no-op."""
    assert tracing.NO_BATCH is tracing.batch("catalog")
    worker, io = make_worker(tmp_path)
    worker.process([delivery(1)])
    assert ["ack"] == io.kinds()


class _Endpoint(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append(dict(self.headers.items()))
        answer = b'{"id": "p-1"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *_args: Any) -> None:
        return None


def test_the_fenced_call_is_a_child_of_its_event_and_sends_traceparent(
        tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """The webhook call is a CLIENT span under its event's span, and the
    endpoint receives that span's context as the traceparent header."""
    _Endpoint.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        worker, io = make_worker(tmp_path, "webhook", consumer_options={"webhook_url": url})
        event = new_event(article_id="a-9")
        with producer_tracer().start_as_current_span("request") as request:
            event["meta"] = {"traceparent": traceparent(request)}
        worker.process([delivery(1, body(event))])
        assert ["ack"] == io.kinds()[-1:]
    finally:
        server.shutdown()
        server.server_close()
    named = by_name(spans)
    (call,) = named["notify material.published"]
    (applied,) = named["webhook apply material.published"]
    assert applied.context.span_id == call.parent.span_id
    assert request.get_span_context().trace_id == call.context.trace_id
    assert 200 == call.attributes["http.response.status_code"]
    (sent,) = _Endpoint.seen
    headers = {k.lower(): v for k, v in sent.items()}
    assert traceparent(call) == headers["traceparent"]


def test_without_opentelemetry_nothing_is_imported_and_nothing_changes(tmp_path: Path) -> None:
    """With the API not importable, enqueue, dispatch headers and the worker's
    hooks work as before and never import opentelemetry."""
    script = f"""
import sys
sys.modules["opentelemetry"] = None  # as if not installed
sys.path.insert(0, {str(REPO / 'tests')!r})
from delivery_consumer import outbox
from delivery_consumer.observability import tracing
from support import new_event
conn = outbox.connect({str(tmp_path / 'p.db')!r})
with outbox.transaction(conn):
    outbox.enqueue(conn, new_event())
body = conn.execute("SELECT body FROM outbox").fetchone()[0]
assert b"meta" not in body
assert tracing.message_headers({{"x": 1}}, body) == {{"x": 1}}
assert tracing.batch("catalog") is tracing.NO_BATCH
assert tracing.http_headers({{}}) == {{}}
assert not tracing.configure()
assert not [m for m in sys.modules if m.startswith("opentelemetry") and sys.modules[m] is not None]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OTEL_TRACES_EXPORTER": "console"})
    assert "ok" == done.stdout.strip(), done.stderr
    assert "opentelemetry-sdk is not installed" in done.stderr


def test_events_as_links_put_each_event_on_the_batch_span(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """In links mode an event is no span: the batch span links to its producer's
    context with the event's id, attempt and result."""
    worker, _io = make_worker(tmp_path)
    with producer_tracer().start_as_current_span("request") as request:
        traced = new_event(article_id="a-1", meta={"traceparent": traceparent(request)})
    plain = new_event(article_id="a-2")
    tracing.events_as_links(True)
    try:
        worker.process([delivery(1, body(traced)), delivery(2, body(plain))])
    finally:
        tracing.events_as_links(False)
    named = by_name(spans)
    assert not [name for name in named if " apply" in name]
    (batch,) = named["catalog batch"]
    links = {link.attributes["messaging.message.id"]: link for link in batch.links}
    assert {traced["eventId"], plain["eventId"]} == set(links)
    first = links[traced["eventId"]]
    assert request.get_span_context().span_id == first.context.span_id
    assert ("updated", 1) == (first.attributes["delivery_consumer.result"],
                              first.attributes["delivery_consumer.attempt"])
    assert not links[plain["eventId"]].context.is_valid


def test_an_event_of_an_unsampled_producer_trace_gets_no_span(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """A producer context whose sampled flag is off gives no event span; the batch span is still there."""
    worker, _io = make_worker(tmp_path)
    unsampled = "00-" + "c" * 32 + "-" + "d" * 16 + "-00"
    worker.process([delivery(1, body(new_event(meta={"traceparent": unsampled})))])
    named = by_name(spans)
    assert "catalog batch" in named
    assert not [name for name in named if " apply" in name]


def test_a_partitioned_runs_spans_name_the_partition(spans: InMemorySpanExporter) -> None:
    """The batch span and each event span carry the partition of the run."""
    from delivery_consumer.amqp.partitions import Identity
    from delivery_consumer.model.contract import Outcome

    event = new_event(article_id="a-1")
    trace_of_batch = tracing.batch("catalog", Identity(3, 8))
    trace_of_batch.parsed([delivery(1, body(event))], [from_mapping(event)])
    trace_of_batch.committed([Outcome(event["eventId"], result="updated")])
    trace_of_batch.end()
    named = by_name(spans)
    (batch,) = named["catalog batch"]
    (applied,) = named["catalog apply material.published"]
    assert 3 == batch.attributes["delivery_consumer.partition"] == applied.attributes["delivery_consumer.partition"]
    assert 1 == batch.attributes["delivery_consumer.results.updated"]


def test_a_batch_cut_short_ends_abandoned_with_its_events_unresolved(spans: InMemorySpanExporter) -> None:
    """A batch that never reached its ack ends when the next one begins: its span
    has an error status and says abandoned; its event's span has no result."""
    event = new_event(article_id="a-1")
    cut_short = tracing.batch("catalog")
    cut_short.parsed([delivery(1, body(event))], [from_mapping(event)])
    tracing.batch("catalog").end()
    batches = by_name(spans)["catalog batch"]
    (abandoned,) = [b for b in batches if b.attributes.get("delivery_consumer.batch.abandoned")]
    assert trace.StatusCode.ERROR == abandoned.status.status_code
    (applied,) = by_name(spans)["catalog apply material.published"]
    assert "delivery_consumer.result" not in applied.attributes
    assert event["eventId"] == applied.attributes["messaging.message.id"]


def test_the_producers_tracestate_header_is_the_event_spans(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """A traceparent header with a tracestate: the event's span is in that trace,
    under that span, and carries the tracestate on."""
    worker, _io = make_worker(tmp_path)
    parent = "00-" + "3" * 32 + "-" + "4" * 16 + "-01"
    worker.process([delivery(1, body(new_event()), headers={"traceparent": parent, "tracestate": "shop=7"})])
    (applied,) = by_name(spans)["catalog apply material.published"]
    assert (int("3" * 32, 16), int("4" * 16, 16)) == (applied.context.trace_id, applied.parent.span_id)
    assert applied.parent.is_remote
    assert "shop=7" == applied.context.trace_state.to_header()


@pytest.mark.parametrize("run_provider", [False, True])
def test_the_providers_sampler_decides_roots_and_a_sampled_producer_decides_its_events(
        tmp_path: Path, run_provider: bool) -> None:
    """With a parent-based sampler that drops roots, the batch (a root) and an event
    without a producer context get no span; an event of a sampled producer trace
    does, linked to the batch's context. A sampler that drops everything leaves nothing."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    worker, _io = make_worker(tmp_path)
    sampled = "00-" + "5" * 32 + "-" + "6" * 16 + "-01"
    for sampler, expected in ((ParentBased(ALWAYS_OFF), ["catalog apply material.published"]), (ALWAYS_OFF, [])):
        exporter = InMemorySpanExporter()
        if run_provider:
            provider = tracing.build_provider(immediate=[exporter], sampler=sampler)
        else:
            provider = sdk_trace.TracerProvider(sampler=sampler)
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracing.set_provider(provider)
        try:
            worker.process([delivery(1, body(new_event(meta={"traceparent": sampled}))),
                            delivery(2, body(new_event()))])
            tracing.flush()
        finally:
            tracing.set_provider(None)
        got = exporter.get_finished_spans()
        assert expected == [s.name for s in got]
        for span in got:
            assert int("5" * 32, 16) == span.context.trace_id
            (link,) = span.links
            assert link.context.is_valid and link.context.trace_id != span.context.trace_id


class _ApiOnlyProvider(trace.TracerProvider):
    """An implementation of the API that is not the SDK's (its tracers expose
    nothing but the API), delegating to an SDK provider."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return _ApiOnlyTracer(self.inner.get_tracer(*args, **kwargs))


class _ApiOnlyTracer(trace.Tracer):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.start_as_current_span(*args, **kwargs)


def test_another_api_implementation_gets_the_same_spans_through_the_api(tmp_path: Path) -> None:
    """A provider that is not the SDK's: the batch, its phases and each event's
    span (a child of its producer, linked to the batch, with its result) are
    started and ended through the API."""
    exporter = InMemorySpanExporter()
    inner = sdk_trace.TracerProvider()
    inner.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_provider(_ApiOnlyProvider(inner))
    try:
        worker, _io = make_worker(tmp_path)
        parent = "00-" + "7" * 32 + "-" + "8" * 16 + "-01"
        worker.process([delivery(1, body(new_event(meta={"traceparent": parent}))), delivery(2, b"{broken")])
    finally:
        tracing.set_provider(None)
    named = by_name(exporter)
    (batch,) = named["catalog batch"]
    assert {"consume", "apply", "commit", "ack"} <= set(named)
    (applied,) = named["catalog apply material.published"]
    assert int("8" * 16, 16) == applied.parent.span_id
    assert [batch.context.span_id] == [link.context.span_id for link in applied.links]
    assert "updated" == applied.attributes["delivery_consumer.result"]
    (broken,) = named["catalog apply"]
    assert trace.StatusCode.ERROR == broken.status.status_code
    assert 1 == batch.attributes["delivery_consumer.results.malformed-json"]


def test_a_header_that_is_no_traceparent_leaves_the_producer_context_of_the_body(
        tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """A garbled traceparent header (and its tracestate) is ignored: the event's
    span is a child of the context in the body's meta; a header equal to it is that context."""
    worker, _io = make_worker(tmp_path)
    own = "00-" + "7" * 32 + "-" + "8" * 16 + "-01"
    garbled = new_event(article_id="a-1", meta={"traceparent": own})
    same = new_event(article_id="a-2", meta={"traceparent": own})
    worker.process([delivery(1, body(garbled), headers={"traceparent": b"00-XYZ-01", "tracestate": "shop=7"}),
                    delivery(2, body(same), headers={"traceparent": own})])
    applied = by_name(spans)["catalog apply material.published"]
    assert 2 == len(applied)
    for span in applied:
        assert (int("7" * 32, 16), int("8" * 16, 16)) == (span.context.trace_id, span.parent.span_id)
        assert "" == span.context.trace_state.to_header()


def test_an_event_span_is_a_readable_span_as_exporters_take_it(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    """An event's span is a ReadableSpan: it serializes with to_json (the jsonl
    exporter), and two spans are two objects (equal only to themselves, hashable)."""
    worker, _io = make_worker(tmp_path)
    worker.process([delivery(1, body(new_event(article_id="a-1"))), delivery(2, body(new_event(article_id="a-2")))])
    first, second = by_name(spans)["catalog apply material.published"]
    assert isinstance(first, sdk_trace.ReadableSpan)
    dumped = orjson.loads(first.to_json())
    assert ("catalog apply material.published", "SpanKind.CONSUMER") == (dumped["name"], dumped["kind"])
    assert "updated" == dumped["attributes"]["delivery_consumer.result"]
    assert first == first and first != second and 2 == len({first, second})
    assert first.context != second.context



def test_run_providers_exporter_gets_a_big_batchs_spans_in_bounded_chunks(tmp_path: Path) -> None:
    """A batch of 600 events reaches run's exporter whole, in calls of at most 512 spans."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    class Sizes(InMemorySpanExporter):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[int] = []

        def export(self, spans: Any) -> SpanExportResult:
            self.calls.append(len(spans))
            return super().export(spans)

    exporter = Sizes()
    provider = tracing.build_provider(batched=[exporter])
    tracing.set_provider(provider)
    try:
        worker, _io = make_worker(tmp_path)
        worker.process([delivery(i, body(new_event(article_id=f"a-{i}"))) for i in range(1, 601)])
        tracing.flush()
    finally:
        tracing.set_provider(None)
        provider.shutdown()
    assert 600 + 5 == sum(exporter.calls)  # the events, the four phases and the batch
    assert 2 <= len(exporter.calls) and max(exporter.calls) <= 512
