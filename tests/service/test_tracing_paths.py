"""The SDK's fast path (delivery_consumer/observability/tracing/_sdk.py) makes the spans the
plain path makes through the OpenTelemetry API, and is used only where it
is known to: an SDK version it is tested with, internals that pass its
checks, a tracer whose limits and metrics it does not bypass. Outside
that, every span is made through the API, said in one log line.

The comparison drives one batch of ``run``'s tracing (``tracing.batch`` and
its hooks, as the worker calls them) twice, once by each path, on the same
kind of provider, with the same clock, and compares what the exporter got:
every span's name, kind, times, attributes, status, events, flags, trace
state, its parent and its links (by what they point at: a producer's
context, or another span by its own description), and whose trace it is in.
Only the random ids differ.
"""

from __future__ import annotations

import functools
import itertools
import logging
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from orders_consumer import TYPES

from delivery_consumer.amqp.partitions import Identity
from delivery_consumer.amqp.topology import H_ATTEMPTS
from delivery_consumer.inbox.fence import CallResult
from delivery_consumer.model.contract import Outcome
from delivery_consumer.model.deliveries import Delivery
from delivery_consumer.model.envelope import Envelope
from delivery_consumer.model.errors import Rejection, TransientError
from delivery_consumer.observability import tracing
from delivery_consumer.observability.tracing import _plain

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import (  # noqa: E402
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)

_sdk = pytest.importorskip("delivery_consumer.observability.tracing._sdk")

TRACE_IDS = ("4bf92f3577b34da6a3ce929d0e0e4736", "0af7651916cd43dd8448eb211c80319c", "00000000000000000000000000000001")
SPAN_IDS = ("00f067aa0ba902b7", "b7ad6b7169203331")
EVENT_IDS = tuple(str(uuid.UUID(int=n)) for n in range(1, 6))


class Tagging(Sampler):
    """A sampler of the user's own: samples a span unless its name ends in
    ``commit``, and says so in an attribute of the spans it samples."""

    def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                      attributes: Any = None, links: Any = None, trace_state: Any = None) -> SamplingResult:
        if name.endswith("commit"):
            return SamplingResult(Decision.DROP)
        parent = trace.get_current_span(parent_context).get_span_context()
        return SamplingResult(Decision.RECORD_AND_SAMPLE, {**(attributes or {}), "sampler.tagged": name},
                              parent.trace_state if parent.is_valid else None)

    def get_description(self) -> str:
        return "Tagging"


SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "default": lambda: ParentBased(ALWAYS_ON),
    "always-on": lambda: ALWAYS_ON,
    "roots-off": lambda: ParentBased(ALWAYS_OFF),
    "always-off": lambda: ALWAYS_OFF,
    "half-the-producers": lambda: ParentBased(ALWAYS_ON, remote_parent_sampled=TraceIdRatioBased(0.5)),
    "users-own": Tagging,
}


@dataclass(frozen=True)
class Event:
    """One delivery of a batch and what became of it."""

    event_id: str | None
    parsed: bool  # an envelope, else a rejected body
    meta: str | None  # the envelope's meta.traceparent
    header: str | bytes | None  # the traceparent header
    tracestate: str | None
    attempts: int | str | None
    redelivered: bool
    outcome: str  # updated, duplicate:updated, stale, rejected, transient
    call: str | None  # a fenced call of this event: done, refused, ambiguous


@dataclass(frozen=True)
class Case:
    events: tuple[Event, ...]
    links_only: bool
    partition: int | None
    commit_marked: bool
    acked: bool  # else abandoned when the next batch begins
    sampler: str
    provider: str


traceparents = st.builds(lambda t, s, f: f"00-{t}-{s}-{f}", st.sampled_from(TRACE_IDS), st.sampled_from(SPAN_IDS),
                         st.sampled_from(("00", "01", "02", "03")))


@st.composite
def events(draw: st.DrawFn) -> Event:
    parsed = draw(st.booleans()) or draw(st.booleans())
    meta = draw(st.none() | traceparents) if parsed else None
    header = draw(st.none() | st.just(meta) | traceparents | st.just(b"00-XYZ-01")
                  | traceparents.map(lambda t: t.encode()))
    return Event(
        event_id=draw(st.sampled_from(EVENT_IDS)) if parsed else draw(st.none() | st.sampled_from(EVENT_IDS)),
        parsed=parsed, meta=meta, header=header,
        tracestate=draw(st.none() | st.sampled_from(("shop=7", "shop=7,cart=2"))) if header is not None else None,
        attempts=draw(st.none() | st.integers(0, 3) | st.just("2")),
        redelivered=draw(st.booleans()),
        outcome=draw(st.sampled_from(("updated", "duplicate:updated", "stale", "rejected", "transient")))
        if parsed else "rejected",
        call=draw(st.none() | st.sampled_from(("done", "refused", "ambiguous"))) if parsed else None,
    )


cases = st.builds(Case, events=st.lists(events(), min_size=1, max_size=12).map(tuple), links_only=st.booleans(),
                  partition=st.none() | st.integers(0, 7), commit_marked=st.booleans(), acked=st.booleans(),
                  sampler=st.sampled_from(sorted(SAMPLERS)),
                  provider=st.sampled_from(("own", "run-immediate", "run-batched")))


def delivery_and_parsed(tag: int, e: Event) -> tuple[Delivery, Envelope | Rejection]:
    headers: dict[str, Any] = {}
    if e.header is not None:
        headers["traceparent"] = e.header
    if e.tracestate is not None:
        headers["tracestate"] = e.tracestate
    if e.attempts is not None:
        headers[H_ATTEMPTS] = e.attempts
    if not e.parsed:
        parsed: Envelope | Rejection = Rejection("malformed-json", "not JSON", event_id=e.event_id)
        body = b"{broken"
    else:
        obj: dict[str, Any] = {"eventId": e.event_id, "type": "order.placed", "orderId": f"o-{tag}", "revision": 1,
                               "occurredAt": "2026-11-29T10:00:00Z", "data": {"status": "placed", "totalCents": 100}}
        if e.meta is not None:
            obj["meta"] = {"traceparent": e.meta}
        parsed = TYPES.from_mapping(obj)
        body = orjson.dumps(obj)
    return Delivery(1, tag, body, "order.placed", e.redelivered, e.event_id, headers, "application/json",
                    "events"), parsed


def outcome_of(e: Event) -> Outcome:
    if e.outcome == "rejected":
        return Outcome(e.event_id, rejection=Rejection("invalid-envelope" if e.parsed else "malformed-json", "bad"))
    if e.outcome == "transient":
        return Outcome(e.event_id, transient=TransientError("down", code="dependency-down"))
    return Outcome(e.event_id, result=e.outcome)


CALLS = {"done": CallResult(provider_id="p-1", status=200),
         "refused": CallResult(status=422, failure=Rejection("webhook-refused", "422")),
         "ambiguous": CallResult(failure=TransientError("timed out", code="webhook-timeout"), ambiguous=True)}


def provider_of(kind: str, exporter: InMemorySpanExporter, sampler: Sampler) -> Any:
    if kind == "own":
        provider = sdk_trace.TracerProvider(sampler=sampler, shutdown_on_exit=False)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider
    if kind == "run-immediate":
        return tracing.build_provider(immediate=[exporter], sampler=sampler, shutdown_on_exit=False)
    return tracing.build_provider(batched=[exporter], sampler=sampler, shutdown_on_exit=False)


def spans_of(case: Case, fast: bool) -> list[Any]:
    """The spans one path makes of *case*'s batch (and of the batch after it, when it is abandoned)."""
    assert fast == tracing.fast_path(fast)
    exporter = InMemorySpanExporter()
    provider = provider_of(case.provider, exporter, SAMPLERS[case.sampler]())
    clock = itertools.count(1_700_000_000_000_000_000, 1_000)
    tracing.set_provider(provider)
    tracing.events_as_links(case.links_only)
    try:
        with mock.patch.object(_plain, "time", types.SimpleNamespace(time_ns=lambda: next(clock))):
            made = [delivery_and_parsed(tag, e) for tag, e in enumerate(case.events, 1)]
            items, parsed = [d for d, _ in made], [p for _, p in made]
            batch = tracing.batch("orders", None if case.partition is None else Identity(case.partition, 8))
            batch.parsed(items, parsed)
            for e, p in zip(case.events, parsed, strict=True):
                if e.call is not None and isinstance(p, Envelope):
                    with tracing.external_call("notify", f"key-{e.event_id}", p) as done:
                        done(CALLS[e.call])
            if case.commit_marked:
                tracing.mark_commit()
            if case.acked:
                batch.committed([outcome_of(e) for e in case.events])
                batch.end()
            else:
                tracing.batch("orders").end()  # the next batch begins: this one ends, abandoned
        tracing.flush()
        return list(exporter.get_finished_spans())
    finally:
        tracing.set_provider(None)
        tracing.events_as_links(False)
        provider.shutdown()
        tracing.fast_path(True)


def shape(spans: Sequence[Any], case: Case) -> list[str]:
    """What a list of spans says, without its random ids: each span described
    by its own fields and by what its parent, its links and its trace are."""
    remote = {(int(t, 16), int(s, 16)) for t in TRACE_IDS for s in SPAN_IDS}
    by_id = {span.context.span_id: span for span in spans}

    def own(span: Any) -> tuple[Any, ...]:
        return (span.name, sorted(span.attributes.items()), span.context.trace_flags, span.start_time)

    def points_at(context: Any) -> Any:
        if context is None:
            return None
        if (context.trace_id, context.span_id) in remote:
            return ("producer", context.trace_id, context.span_id, int(context.trace_flags), context.is_remote)
        if context.span_id in by_id:
            return ("span", own(by_id[context.span_id]))
        return ("not exported", context.is_valid, int(context.trace_flags), context.trace_state.to_header())

    def trace_of(span: Any) -> Any:
        if any(span.context.trace_id == t for t, _ in remote):
            return ("producer's", span.context.trace_id)
        root = span
        while root.parent is not None and root.parent.span_id in by_id:
            root = by_id[root.parent.span_id]
        return ("of", own(root) if root.parent is None else points_at(root.parent))

    described = []
    for span in spans:
        client = span.kind == trace.SpanKind.CLIENT  # the fenced call: started by the tracer, on its own clock
        described.append(repr((
            span.name, span.kind, sorted(span.attributes.items()), span.status.status_code, span.status.description,
            None if client else (span.start_time, span.end_time), list(span.events),
            int(span.context.trace_flags), span.context.trace_state.to_header(), span.context.is_remote,
            points_at(span.parent), span.parent is not None and span.parent.is_remote,
            sorted(repr((points_at(link.context), sorted((link.attributes or {}).items()))) for link in span.links),
            trace_of(span), dict(span.resource.attributes),
            (span.instrumentation_scope.name, span.instrumentation_scope.version),
        )))
    return sorted(described)


def tracers_get_the_fast_path() -> bool:
    """Whether this SDK's tracers get the fast path (not in 1.40 and 1.41, which count every span in metrics)."""
    return _sdk.check() is None and _sdk.unusable(
        sdk_trace.TracerProvider(shutdown_on_exit=False).get_tracer("probe")) is None


FAST = tracers_get_the_fast_path()
needs_the_fast_path = pytest.mark.skipif(not FAST, reason="this SDK counts every span in metrics: no fast path")


@pytest.fixture(autouse=True)
def fast_path_checked() -> Iterator[None]:
    """Each test starts and ends with the fast path in use (this SDK is one it is tested with)."""
    assert tracing.fast_path(True), _sdk.check()
    yield
    assert tracing.fast_path(True)


@needs_the_fast_path
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_the_fast_path_makes_the_spans_the_api_makes(case: Case) -> None:
    """For any batch -- producer contexts in the body or a header (sampled or
    not, with the random-trace-id flag, with a tracestate, garbled), retries,
    redeliveries, rejections, duplicate eventIds, fenced calls, a partition,
    links mode, an abandoned batch -- under any of the SDK's samplers or a
    user's own, and with each kind of provider, the fast path and the plain
    path export the same spans."""
    fast, plain = spans_of(case, fast=True), spans_of(case, fast=False)
    expected, got = shape(plain, case), shape(fast, case)
    assert expected == got, (sorted(set(expected) - set(got)), sorted(set(got) - set(expected)))


@needs_the_fast_path
def test_the_comparison_sees_a_difference() -> None:
    """A fast path that got one flag wrong (the random-trace-id bit a recent
    SDK gives a root) is told from the plain path: the comparison is not vacuous."""
    case = Case(events=(Event(EVENT_IDS[0], True, None, None, None, None, False, "updated", None),),
                links_only=False, partition=None, commit_marked=True, acked=True, sampler="default", provider="own")
    plain = spans_of(case, fast=False)
    assert shape(plain, case) == shape(spans_of(case, fast=True), case)
    made = _sdk.Sdk.__init__

    def one_bit_off(self: Any, *args: Any) -> None:
        made(self, *args)
        self.root_flags = trace.TraceFlags(self.root_flags ^ 0x02)

    with mock.patch.object(_sdk.Sdk, "__init__", one_bit_off):
        wrong = spans_of(case, fast=True)
    assert shape(plain, case) != shape(wrong, case)


def one_batch_of_spans() -> list[Any]:
    """The spans of one traced batch of one event through the SDK (whichever path makes them)."""
    case = Case(events=(Event(EVENT_IDS[0], True, f"00-{TRACE_IDS[0]}-{SPAN_IDS[0]}-01", None, None, None, False,
                              "updated", "done"),),
                links_only=False, partition=None, commit_marked=True, acked=True, sampler="default", provider="own")
    exporter = InMemorySpanExporter()
    provider = provider_of("own", exporter, ParentBased(ALWAYS_ON))
    tracing.set_provider(provider)
    try:
        d, p = delivery_and_parsed(1, case.events[0])
        batch = tracing.batch("orders")
        batch.parsed([d], [p])
        assert isinstance(p, Envelope)
        with tracing.external_call("notify", "k", p) as done:
            done(CALLS["done"])
        batch.committed([outcome_of(case.events[0])])
        batch.end()
    finally:
        tracing.set_provider(None)
        provider.shutdown()
    return list(exporter.get_finished_spans())


def used_fast_path(spans: Sequence[Any]) -> bool:
    """Whether the batch's event span was built by the fast path (its own class) rather than started by the SDK."""
    (applied,) = [s for s in spans if s.name == "orders apply order.placed"]
    return type(applied) is _sdk.EventSpan


@pytest.mark.parametrize(("version", "supported"), [("1.24.0", False), ("1.25.0", True), ("1.45.2", True),
                                                    ("1.46.0", False), ("2.0.0", False), ("1.46.0rc1", False)])
def test_an_sdk_outside_the_tested_versions_gets_the_plain_path_and_one_log_line(
        caplog: pytest.LogCaptureFixture, version: str, supported: bool) -> None:
    """With an SDK version outside SUPPORTED, spans are made through the API
    (the same spans), and one warning line says why, however many batches follow."""
    with mock.patch.object(_sdk, "version", lambda: version), caplog.at_level(logging.WARNING, "delivery_consumer"):
        assert supported == tracing.fast_path(True)
        spans = one_batch_of_spans() + one_batch_of_spans()
    assert (supported and FAST) == used_fast_path(spans[:len(spans) // 2])
    lines = [r.getMessage() for r in caplog.records]
    if supported and FAST:
        assert [] == lines
    elif supported:
        (line,) = lines
        assert "the SDK counts every span in its own metrics" in line
    else:
        (line,) = lines
        assert f"opentelemetry-sdk {version} is outside the versions the fast path is tested with" in line
        assert "spans are made through the OpenTelemetry API" in line
    assert {"orders batch", "orders apply order.placed", "notify order.placed", "consume", "apply",
            "ack"} == {s.name for s in spans}


def test_internals_of_another_shape_get_the_plain_path_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """An SDK whose ReadableSpan keeps a field the fast path does not know (or
    whose SpanContext is no longer the tuple it makes) fails its check at start:
    the plain path, and one line naming what differs."""
    original = sdk_trace.ReadableSpan.__init__

    @functools.wraps(original)
    def with_a_new_field(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._new_field = None

    with caplog.at_level(logging.WARNING, "delivery_consumer"):
        with mock.patch.object(sdk_trace.ReadableSpan, "__init__", with_a_new_field):
            assert not tracing.fast_path(True)
            assert not used_fast_path(one_batch_of_spans())
        with mock.patch.object(_sdk, "_probe_context", lambda: "SpanContext is not the tuple of six fields it was"):
            assert not tracing.fast_path(True)
    first, second = (r.getMessage() for r in caplog.records)
    assert "ReadableSpan keeps fields" in first and "_new_field" in first
    assert "SpanContext is not the tuple" in second


def test_the_sdks_own_flags_are_probed(caplog: pytest.LogCaptureFixture) -> None:
    """When the flags the SDK gives a root or a child differ from those the
    fast path would give (a later SDK changing them), the check fails."""
    with caplog.at_level(logging.WARNING, "delivery_consumer"), \
            mock.patch.object(_sdk, "flags", lambda ids, parent, sampled=True: trace.TraceFlags(0x81)):
        assert not tracing.fast_path(True)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "the SDK's flags of a root and two children are" in line


def test_a_tracer_whose_limits_would_cut_its_spans_gets_the_plain_path(caplog: pytest.LogCaptureFixture) -> None:
    """A provider with span limits that cut attributes (the SDK's own spans would
    be cut; the fast path's would not) is traced through the API, said once."""
    exporter = InMemorySpanExporter()
    limits = sdk_trace.SpanLimits(max_attribute_length=8)
    provider = sdk_trace.TracerProvider(span_limits=limits, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_provider(provider)
    try:
        with caplog.at_level(logging.WARNING, "delivery_consumer"):
            for _ in range(2):
                tracing.batch("orders").end()
    finally:
        tracing.set_provider(None)
        provider.shutdown()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "span limits (max_attribute_length=8)" in line
    (batch, *_) = [s for s in exporter.get_finished_spans() if s.name == "orders batch"]
    assert "rabbitmq" == batch.attributes["messaging.system"]
    assert "orders" == batch.attributes["delivery_consumer.consumer"][:8]


def test_a_disabled_tracer_gets_no_spans_from_the_fast_path() -> None:
    """An SDK tracer turned off (by the SDK's tracer configurator, where it has
    one) records nothing: the fast path does not build spans behind its back."""
    config = getattr(sdk_trace, "_TracerConfig", None)
    if config is None:
        pytest.skip("this SDK has no tracer configurator")
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_provider(provider)
    event = Event(EVENT_IDS[0], True, None, None, None, None, False, "updated", None)
    try:
        for enabled in (True, False):
            provider._set_tracer_configurator(tracer_configurator=lambda _scope, on=enabled: config(is_enabled=on))
            d, p = delivery_and_parsed(1, event)
            batch = tracing.batch("orders")
            batch.parsed([d], [p])
            batch.committed([outcome_of(event)])
            batch.end()
            assert enabled == bool(exporter.get_finished_spans())
            exporter.clear()
    finally:
        tracing.set_provider(None)
        provider.shutdown()


def test_delivery_trace_fast_0_turns_the_fast_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """DELIVERY_TRACE_FAST=0 in the environment: every span through the API, the same spans."""
    monkeypatch.setenv(tracing.FAST_ENV, "0")
    monkeypatch.setattr(tracing, "_fast_wanted", None)
    monkeypatch.setattr(tracing, "_fast", None)
    spans = one_batch_of_spans()
    assert not used_fast_path(spans)
    monkeypatch.setattr(tracing, "_fast_wanted", None)
    monkeypatch.setattr(tracing, "_fast", None)
    monkeypatch.delenv(tracing.FAST_ENV)
    assert FAST == used_fast_path(one_batch_of_spans())
