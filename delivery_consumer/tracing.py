"""OpenTelemetry traces: the only module that imports ``opentelemetry``.

Everything here is a no-op unless the OpenTelemetry API is installed (the
``[otel]`` extra) *and* in use in the process: the hooks look at
``sys.modules`` before importing anything, so a process that never set up
tracing pays one dict lookup per hook. What is traced (docs/tracing.md):

* :func:`stamp` -- ``outbox.enqueue`` writes the current span's context into
  the envelope's ``meta.traceparent`` (outside the fingerprint: the same fact
  enqueued from another trace is still the same row);
* :func:`message_headers` -- the dispatcher publishes it as the W3C
  ``traceparent`` AMQP header;
* :func:`batch` -- ``run``: one span per batch with its phases (consume,
  apply, commit, ack) as children, and, when a tracer provider is active,
  one span per event, a child of its producer's context and linked to the
  batch, with the result, consumer, partition and attempt as attributes;
* :func:`external_call` and :func:`http_headers` -- the fenced external call
  is a child span of its event's span and sends ``traceparent`` to the endpoint.

:func:`configure` sets up the SDK for ``run`` and ``dispatch`` from the
standard ``OTEL_*`` variables when ``OTEL_TRACES_EXPORTER`` names exporters.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import orjson

from .envelope import Envelope, canonical_bytes
from .errors import Rejection

if TYPE_CHECKING:
    from .contract import Outcome
    from .deliveries import Delivery
    from .inbox.fence import CallResult
    from .partitions import Identity

log = logging.getLogger("delivery_consumer.tracing")

#: ``OTEL_TRACES_EXPORTER`` value for finished spans written as JSON lines to
#: the file named by :data:`FILE_ENV` (one span a line; any process may append).
JSONL_EXPORTER: Final = "jsonl"
FILE_ENV: Final = "DELIVERY_TRACES_FILE"
#: ``spans`` (default): one span per event; ``links``: each event a link of its batch's span.
EVENTS_ENV: Final = "DELIVERY_TRACE_EVENTS"
#: The W3C header names (AMQP headers and HTTP headers alike).
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_API: Final = "opentelemetry.trace"
_SCOPE: Final = "delivery_consumer"

_installed: bool | None = None
#: Events as links of the batch span rather than spans (:func:`events_as_links`).
_links_only = False
#: A provider given with :func:`set_provider` (else the global one).
_provider: Any = None
_local = threading.local()


def installed() -> bool:
    """Whether the OpenTelemetry API can be imported (looked up once)."""
    global _installed
    if _installed is None:
        try:
            _installed = importlib.util.find_spec(_API) is not None
        except (ImportError, ValueError):  # a parent package that is not there (or blocked)
            _installed = False
    return _installed


def _api() -> Any:
    """The ``opentelemetry.trace`` module if this process imported it, else None."""
    return sys.modules.get(_API)


def set_provider(provider: Any) -> None:
    """Trace with *provider* instead of the global tracer provider (None: the
    global one again); for embedding a worker in a process that has its own."""
    global _provider
    _provider = provider


def _active_tracer() -> Any:
    """A tracer of an active (SDK) tracer provider, or None."""
    api = _api()
    if api is None:
        return None
    provider = _provider if _provider is not None else api.get_tracer_provider()
    if isinstance(provider, api.ProxyTracerProvider | api.NoOpTracerProvider):
        return None
    tracer = getattr(_local, "tracer", None)
    if tracer is None or _local.provider is not provider:
        tracer = provider.get_tracer(_SCOPE)
        _local.tracer, _local.provider = tracer, provider
    return tracer


# -- set-up of the SDK (run, dispatch) ---------------------------------------------


def configure() -> bool:
    """Install an SDK tracer provider from the ``OTEL_*`` environment when
    ``OTEL_TRACES_EXPORTER`` names exporters (comma-separated: ``jsonl``, or
    any name of the ``opentelemetry_traces_exporter`` entry points, such as
    ``console`` or ``otlp``). Resource (``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES``), sampler (``OTEL_TRACES_SAMPLER``) and batch
    processor settings (``OTEL_BSP_*``) are the SDK's. Nothing happens when
    the variable is unset or ``none``, or when a provider is already set.
    Returns whether tracing is now on; a missing SDK or exporter is one
    warning line, never a failure."""
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names or names == ["none"]:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER is set but opentelemetry-sdk is not installed: tracing is off")
        return False
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return True  # the host process set its own
    links = os.environ.get(EVENTS_ENV, "spans").strip().lower() == "links"
    events_as_links(links)
    # a batch span links each of its events (run's --batch is at most 10k); an explicit limit wins
    limits = SpanLimits(max_links=None if "OTEL_SPAN_LINK_COUNT_LIMIT" in os.environ or not links else 10_000)
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get(
        "OTEL_SERVICE_NAME", "delivery-consumer")}), span_limits=limits)
    for name in names:
        if name == JSONL_EXPORTER:
            path = os.environ.get(FILE_ENV)
            if not path:
                log.warning("OTEL_TRACES_EXPORTER=jsonl needs %s (the file to append spans to)", FILE_ENV)
                continue
            out = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the process's life
            lines = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
            provider.add_span_processor(SimpleSpanProcessor(lines))  # written at once: survives a kill -9
            continue
        try:
            factory = _exporter_factory(name)
            exporter = None if factory is None else factory()
        except Exception as exc:  # an exporter's own configuration error: one line, no traceback
            log.warning("OTEL_TRACES_EXPORTER: exporter %r cannot start (%s: %s); skipped", name,
                        type(exc).__name__, exc)
            continue
        if exporter is None:
            log.warning("OTEL_TRACES_EXPORTER: no exporter named %r is installed; skipped", name)
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    return True


def _exporter_factory(name: str) -> Callable[[], Any] | None:
    from importlib.metadata import entry_points

    for entry in entry_points(group="opentelemetry_traces_exporter", name=name):
        factory: Callable[[], Any] = entry.load()
        return factory
    return None


def flush() -> None:
    """Export what the tracer provider still holds (a process about to ``_exit``)."""
    api = _api()
    if api is None:
        return
    provider = _provider if _provider is not None else api.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        force_flush()


# -- the producer ----------------------------------------------------------------


def _current_traceparent() -> str | None:
    api = _api()
    if api is None:
        return None
    ctx = api.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def stamp(env: Envelope) -> Envelope:
    """*env* with the current span's context in ``meta.traceparent``, unless
    it has one or no span is current. The fingerprint leaves ``meta`` out,
    so it is unchanged."""
    if _API not in sys.modules:
        return env
    meta = env.meta
    if meta is not None and TRACEPARENT in meta:
        return env
    traceparent = _current_traceparent()
    if traceparent is None:
        return env
    fields = dict(env.fields)
    fields["meta"] = {**(meta or {}), TRACEPARENT: traceparent}
    return env._replace(fields=fields, canonical=canonical_bytes(fields))


def traceparent_of(body: bytes) -> str | None:
    """The ``meta.traceparent`` of an envelope's JSON *body*, if it has a valid one."""
    if b'"traceparent"' not in body:
        return None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    meta = obj.get("meta") if isinstance(obj, dict) else None
    value = meta.get(TRACEPARENT) if isinstance(meta, dict) else None
    return value if isinstance(value, str) and _TRACEPARENT.fullmatch(value) else None


def message_headers(headers: dict[str, Any] | None, body: bytes) -> dict[str, Any] | None:
    """*headers* plus ``traceparent`` from the body's ``meta`` (the dispatcher's
    AMQP headers), when the OpenTelemetry API is installed."""
    if not installed():
        return headers
    traceparent = traceparent_of(body)
    if traceparent is None:
        return headers
    return {**(headers or {}), TRACEPARENT: traceparent}


def http_headers(headers: dict[str, str]) -> dict[str, str]:
    """*headers* plus the current span's ``traceparent`` (and ``tracestate``),
    for an outgoing HTTP request."""
    if _API not in sys.modules:
        return headers
    from opentelemetry import propagate

    propagate.inject(headers)
    return headers


# -- the consumer ------------------------------------------------------------------


def _header(headers: Mapping[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value if isinstance(value, str) else None


def parent_traceparent(headers: Mapping[str, Any], parsed: Envelope | Rejection) -> str | None:
    """The producer's context of a delivery: its ``traceparent`` header, else
    the envelope's ``meta.traceparent`` (which survives any copy of the body)."""
    value = _header(headers, TRACEPARENT)
    if value is not None and _TRACEPARENT.fullmatch(value):
        return value
    meta = parsed.meta if isinstance(parsed, Envelope) else None
    value = meta.get(TRACEPARENT) if meta is not None else None
    return value if isinstance(value, str) and _TRACEPARENT.fullmatch(value) else None


def _remote(api: Any, traceparent: str, tracestate: str | None) -> Any:
    """A context whose span is the remote one *traceparent* names."""
    if tracestate:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent, TRACESTATE: tracestate})
    ctx = api.SpanContext(int(traceparent[3:35], 16), int(traceparent[36:52], 16), True,
                          api.TraceFlags(int(traceparent[53:55], 16)))
    return api.set_span_in_context(api.NonRecordingSpan(ctx))


class NoBatch:
    """The batch of a process that does not trace: every hook does nothing."""

    __slots__ = ()

    def parsed(self, items: Sequence[Delivery], parsed: Sequence[Envelope | Rejection]) -> None:
        """The deliveries were parsed: applying begins."""

    def committed(self, outcomes: Sequence[Outcome]) -> None:
        """The batch's transaction committed."""

    def end(self) -> None:
        """The batch was acked."""


NO_BATCH: Final = NoBatch()


class Batch(NoBatch):
    """One batch of ``run``: its span, its phases' times and its events' spans."""

    __slots__ = ("_api", "_commit", "_committed", "_consumer", "_events", "_outcomes", "_parsed",
                 "_partition", "_span", "_start", "_tracer", "by_event")

    def __init__(self, api: Any, tracer: Any, consumer: str, partition: int | None) -> None:
        self._api, self._tracer = api, tracer
        self._consumer, self._partition = consumer, partition
        self._start = time.time_ns()
        self._parsed = self._commit = self._committed = 0
        self._events: list[Any] = []
        self._outcomes: Sequence[Outcome] = ()
        #: eventId -> its span, for the fence's call.
        self.by_event: dict[str, Any] = {}
        attributes: dict[str, Any] = {"messaging.system": "rabbitmq", "delivery_consumer.consumer": consumer}
        if partition is not None:
            attributes["delivery_consumer.partition"] = partition
        self._span = tracer.start_span(f"{consumer} batch", kind=api.SpanKind.CONSUMER, attributes=attributes,
                                       start_time=self._start)

    @property
    def span(self) -> Any:
        return self._span

    def parsed(self, items: Sequence[Delivery], parsed: Sequence[Envelope | Rejection]) -> None:
        from .retry import attempts_done

        self._parsed = time.time_ns()
        api, tracer, batch = self._api, self._tracer, self._span
        self._span.set_attribute("messaging.batch.message_count", len(items))
        link = [api.Link(batch.get_span_context())]
        kind = api.SpanKind.CONSUMER
        base: dict[str, Any] = {"delivery_consumer.consumer": self._consumer}
        if self._partition is not None:
            base["delivery_consumer.partition"] = self._partition
        remote: dict[str, Any] = {}  # a producer's request often enqueues several events
        for d, p in zip(items, parsed, strict=True):
            traceparent = parent_traceparent(d.headers, p)
            if traceparent is None:
                context = None
            elif traceparent.endswith(("0", "2", "4", "6", "8", "a", "c", "e")):
                self._events.append(None)  # the producer's trace is not sampled: no span to record
                continue
            else:
                context = remote.get(traceparent)
                if context is None:
                    context = remote[traceparent] = _remote(api, traceparent, _header(d.headers, TRACESTATE))
            if _links_only:
                self._events.append((traceparent, attempts_done(d.headers) + 1, p.event_id))
                continue
            attributes = dict(base)
            attributes["delivery_consumer.attempt"] = attempts_done(d.headers) + 1
            if d.redelivered:
                attributes["delivery_consumer.redelivered"] = True
            if p.event_id is not None:
                attributes["messaging.message.id"] = p.event_id
            name = f"{self._consumer} apply {p.type}" if isinstance(p, Envelope) else f"{self._consumer} apply"
            span = tracer.start_span(name, context=context, kind=kind, attributes=attributes, links=link,
                                     start_time=self._start)
            self._events.append(span)
            if p.event_id is not None:
                self.by_event.setdefault(p.event_id, span)

    def mark_commit(self) -> None:
        self._commit = time.time_ns()

    def committed(self, outcomes: Sequence[Outcome]) -> None:
        self._committed = time.time_ns()
        self._outcomes = outcomes

    def end(self, abandoned: bool = False) -> None:
        if getattr(_local, "batch", None) is self:
            _local.batch = None
        now = time.time_ns()
        span, api, tracer = self._span, self._api, self._tracer
        if abandoned:
            span.set_attribute("delivery_consumer.batch.abandoned", True)
            span.set_status(api.Status(api.StatusCode.ERROR, "abandoned before its ack"))
        if _links_only:
            self._link_events(span, api)
        for span_of_event, outcome in zip(self._events, self._outcomes, strict=False):
            if span_of_event is None or isinstance(span_of_event, tuple):
                continue
            span_of_event.set_attribute("delivery_consumer.result", outcome.status)
            if outcome.rejection is not None:
                span_of_event.set_status(api.Status(api.StatusCode.ERROR, outcome.rejection.code))
        for span_of_event in self._events:
            if span_of_event is not None and not isinstance(span_of_event, tuple):
                span_of_event.end(now)
        parent = api.set_span_in_context(span)
        parsed = self._parsed or now
        committed = self._committed or now
        phases = [("consume", self._start, parsed)]
        if self._commit:
            phases += [("apply", parsed, self._commit), ("commit", self._commit, committed)]
        else:
            phases.append(("apply", parsed, committed))
        if self._committed:
            phases.append(("ack", committed, now))
        for name, begin, finish in phases:
            tracer.start_span(name, context=parent, start_time=begin).end(finish)
        if self._outcomes:
            counts: dict[str, int] = {}
            for outcome in self._outcomes:
                counts[outcome.status] = counts.get(outcome.status, 0) + 1
            for status, n in counts.items():
                span.set_attribute(f"delivery_consumer.results.{status}", n)
        span.end(now)


    def _link_events(self, span: Any, api: Any) -> None:
        """Links mode: each event a link of the batch span to its producer's context."""
        for noted, outcome in zip(self._events, self._outcomes, strict=False):
            if noted is None:
                continue
            traceparent, attempt, event_id = noted
            attributes: dict[str, Any] = {"delivery_consumer.attempt": attempt,
                                          "delivery_consumer.result": outcome.status}
            if event_id is not None:
                attributes["messaging.message.id"] = event_id
            if traceparent is None:
                span.add_link(api.INVALID_SPAN_CONTEXT, attributes)  # kept: it has attributes
            else:
                span.add_link(api.SpanContext(int(traceparent[3:35], 16), int(traceparent[36:52], 16), True,
                                              api.TraceFlags(int(traceparent[53:55], 16))), attributes)


def events_as_links(enabled: bool) -> None:
    """Record each event of a batch as a link of the batch span (to its
    producer's context, with the result and attempt) instead of a span of
    its own: a fraction of the cost, but the events' work is then not in the
    producers' traces. ``DELIVERY_TRACE_EVENTS=links`` for :func:`configure`."""
    global _links_only
    _links_only = enabled


def batch(consumer: str, partition: Identity | None = None) -> NoBatch:
    """The tracing of one batch of ``run`` (:data:`NO_BATCH` when no tracer
    provider is active). A batch left unfinished by the previous one (a
    channel given up, a poison message) ends now, marked abandoned."""
    tracer = _active_tracer() if _API in sys.modules else None
    previous = getattr(_local, "batch", None)
    if previous is not None:
        previous.end(abandoned=True)
    if tracer is None:
        return NO_BATCH
    current = _local.batch = Batch(_api(), tracer, consumer, None if partition is None else partition.partition)
    return current


def mark_commit() -> None:
    """The current batch's transaction is about to commit."""
    current = getattr(_local, "batch", None)
    if current is not None:
        current.mark_commit()


class _NoCall:
    __slots__ = ()

    def __enter__(self) -> Callable[[CallResult], None]:
        return _ignore

    def __exit__(self, *_exc: object) -> None:
        return None


def _ignore(_result: CallResult) -> None:
    return None


_NO_CALL: Final = _NoCall()


class _Call:
    __slots__ = ("_scope", "_span")

    def __init__(self, span: Any, scope: Any) -> None:
        self._span, self._scope = span, scope

    def __enter__(self) -> Callable[[CallResult], None]:
        self._scope.__enter__()
        return self._result

    def _result(self, result: CallResult) -> None:
        span = self._span
        if result.status is not None:
            span.set_attribute("http.response.status_code", result.status)
        if result.provider_id is not None:
            span.set_attribute("delivery_consumer.provider_id", result.provider_id)
        failure = result.failure
        if failure is not None:
            code = failure.code
            span.set_attribute("delivery_consumer.result", code)
            span.set_attribute("delivery_consumer.ambiguous", result.ambiguous)
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, code))
        else:
            span.set_attribute("delivery_consumer.result", "done")

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)


def external_call(step: str, key: str, env: Envelope) -> _NoCall | _Call:
    """Trace one fenced external call as a child of its event's span (made
    current, so :func:`http_headers` sends its context); ``with`` it, and call
    what it gives with the CallResult."""
    current = getattr(_local, "batch", None)
    if current is None:
        return _NO_CALL
    api = current._api
    parent = current.by_event.get(env.event_id, current.span)
    span = current._tracer.start_span(f"{step} {env.type}", context=api.set_span_in_context(parent),
                                      kind=api.SpanKind.CLIENT, attributes={"delivery_consumer.fence_key": key})
    return _Call(span, api.use_span(span, end_on_exit=True))


__all__ = [
    "EVENTS_ENV",
    "FILE_ENV",
    "JSONL_EXPORTER",
    "NO_BATCH",
    "TRACEPARENT",
    "TRACESTATE",
    "Batch",
    "NoBatch",
    "batch",
    "configure",
    "events_as_links",
    "external_call",
    "flush",
    "http_headers",
    "installed",
    "mark_commit",
    "message_headers",
    "parent_traceparent",
    "set_provider",
    "stamp",
    "traceparent_of",
]
