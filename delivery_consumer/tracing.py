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
  batch, with the result, consumer, partition and attempt as attributes,
  all built when the batch ends (:class:`Batch`);
* :func:`external_call` and :func:`http_headers` -- the fenced external call
  is a child span of its event's span and sends ``traceparent`` to the endpoint.

:func:`configure` sets up the SDK for ``run`` and ``dispatch`` from the
standard ``OTEL_*`` variables when ``OTEL_TRACES_EXPORTER`` names exporters,
with :func:`build_provider`, whose exporters build a batch's spans in the
export thread.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import operator
import os
import random
import re
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson

from .envelope import Envelope, canonical_bytes
from .errors import Rejection, TransientError
from .retry import attempts_done
from .topology import H_ATTEMPTS

if TYPE_CHECKING:
    from .contract import Outcome
    from .deliveries import Delivery
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
        _local.tracer, _local.provider, _local.sdk = tracer, provider, _sdk_of(api, provider, tracer)
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
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER is set but opentelemetry-sdk is not installed: tracing is off")
        return False
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return True  # the host process set its own
    links = os.environ.get(EVENTS_ENV, "spans").strip().lower() == "links"
    events_as_links(links)
    batched: list[Any] = []
    immediate: list[Any] = []
    for name in names:
        if name == JSONL_EXPORTER:
            path = os.environ.get(FILE_ENV)
            if not path:
                log.warning("OTEL_TRACES_EXPORTER=jsonl needs %s (the file to append spans to)", FILE_ENV)
                continue
            out = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the process's life
            immediate.append(ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"))
            continue  # written at once: survives a kill -9
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
        batched.append(exporter)
    provider = build_provider(batched, immediate, resource=Resource.create({"service.name": os.environ.get(
        "OTEL_SERVICE_NAME", "delivery-consumer")}))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    return True


#: The batch processor's queue counts batches (each carries its spans), not spans: a
#: flush every 64 batches (16,000 spans at 250 events a batch, a few hundred at 1),
#: at most 512 batches held while the exporter lags. The OTEL_BSP_* variables win.
_QUEUE: Final = (("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "max_export_batch_size", 64),
                 ("OTEL_BSP_MAX_QUEUE_SIZE", "max_queue_size", 512))


def build_provider(batched: Sequence[Any] = (), immediate: Sequence[Any] = (), **options: Any) -> Any:
    """An SDK TracerProvider (*options* are its own: ``resource``,
    ``sampler``, ...) that exports to each of the *batched* exporters behind a
    BatchSpanProcessor and to each of the *immediate* ones at once. ``run``'s
    batches hand it one span each, from which its exporters build the
    batch's other spans in the export thread (:class:`Batch`); a span
    processor added to it later sees only the batches' spans."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    global _deferring
    building = _sdk_types()[1]
    provider = TracerProvider(**options)
    queue: dict[str, Any] = {name: size for variable, name, size in _QUEUE if variable not in os.environ}
    for exporter in batched:
        provider.add_span_processor(BatchSpanProcessor(building(exporter), **queue))
    for exporter in immediate:
        provider.add_span_processor(SimpleSpanProcessor(building(exporter)))
    if _deferring is None:
        _deferring = weakref.WeakSet()
    _deferring.add(provider)
    return provider


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
    """The remote span context *traceparent* (with *tracestate*) names."""
    state = api.TraceState.from_header([tracestate]) if tracestate else None
    return api.SpanContext(int(traceparent[3:35], 16), int(traceparent[36:52], 16), True,
                           api.TraceFlags(int(traceparent[53:55], 16)), state)


#: A ParentBased sampler whose remote and local parents decide (the SDK's default delegates).
_PARENT_DECIDES: Final = (",remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler,"
                          "localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}")
#: Spans handed to an exporter at a time (at most) when a batch's spans are built in the export thread.
_EXPORT_CHUNK: Final = 512
#: Built spans are exported as soon as there are this many: the fewer alive at once, the fewer
#: the garbage collector moves to its oldest generation, whose collections walk the whole heap.
_EXPORT_SOON: Final = 128


class _Sdk:
    """The parts of an SDK tracer that a batch builds its finished spans
    with: its processors (each span is handed to ``on_end`` once, finished),
    its resource, id generator and sampler. The sampler is asked only when
    its answer is not known from its description (the default, parent-based
    one follows the producer's sampled flag and samples a root)."""

    __slots__ = ("api", "carrier", "context_type", "default_flags", "deferred", "ids", "new_context", "new_span",
                 "on_end", "parent_decides", "random_ids", "readable", "resource", "root_on", "sampled", "sampler",
                 "scope")

    def __init__(self, api: Any, tracer: Any, deferred: bool) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.api = api
        self.readable = ReadableSpan
        self.carrier, _, event_span = _sdk_types()
        #: An event's span from its fields (:data:`_EVENT_FIELDS`).
        self.new_span: Callable[[tuple[Any, ...]], Any] = event_span or _readable_span
        #: The provider's exporters build a batch's spans in their thread (:func:`build_provider`).
        self.deferred = deferred
        self.on_end = tracer.span_processor.on_end
        self.resource = tracer.resource
        self.ids = tracer.id_generator
        #: The SDK's random ids: its generator calls ``random.getrandbits``, less a Python frame here.
        self.random_ids = type(self.ids) is RandomIdGenerator
        self.new_context, self.context_type = _context_maker(api)
        self.sampler = tracer.sampler
        self.scope = InstrumentationScope(_SCOPE)
        self.sampled, self.default_flags = api.TraceFlags(api.TraceFlags.SAMPLED), api.TraceFlags(0)
        description = str(self.sampler.get_description())
        always = description == "AlwaysOnSampler"
        self.parent_decides = always or (description.startswith("ParentBased{")
                                         and description.endswith(_PARENT_DECIDES))
        self.root_on = always or (self.parent_decides and description.startswith("ParentBased{root:AlwaysOnSampler,"))

    def context(self, parent: Any, name: str, kind: Any,
                attributes: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        """The context of a new span under *parent* (a SpanContext, or None
        for a root) and its attributes, or None when it is not recorded."""
        api, ids = self.api, self.ids
        if parent is None:
            trace_id = ids.generate_trace_id()
            if self.root_on:
                return api.SpanContext(trace_id, ids.generate_span_id(), False, self.sampled), attributes
        elif self.parent_decides:
            if not parent.trace_flags.sampled:
                return None
            return api.SpanContext(parent.trace_id, ids.generate_span_id(), False, self.sampled,
                                   parent.trace_state), attributes
        else:
            trace_id = parent.trace_id
        context = None if parent is None else api.set_span_in_context(api.NonRecordingSpan(parent))
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes)
        if not result.decision.is_recording():
            return None
        if result.attributes:
            attributes = {**attributes, **result.attributes}
        flags = self.sampled if result.decision.is_sampled() else self.default_flags
        return api.SpanContext(trace_id, ids.generate_span_id(), False, flags, result.trace_state), attributes


def _context_maker(api: Any) -> tuple[Callable[[Any, tuple[int, int, bool, Any, Any, bool]], Any], Any]:
    """What makes a SpanContext from its six fields when they are known to be
    valid, called with SpanContext and them: ``tuple.__new__`` when
    SpanContext is still the tuple it was (its ``__new__`` is a Python
    function that checks what we checked), else its constructor."""
    context = api.SpanContext
    probe = context(1, 2, False, api.TraceFlags(1))
    fields = (1, 2, False, probe.trace_flags, probe.trace_state, True)
    if (issubclass(context, tuple) and tuple(probe) == fields
            and (probe.trace_id, probe.span_id, probe.is_valid) == (1, 2, True)):
        return tuple.__new__, context
    return lambda cls, fields: cls(*fields[:5]), context


#: The fields of an event's span, in the order :func:`_spans` gives them (:class:`EventSpan`).
_EVENT_FIELDS: Final = ("_name", "_context", "_parent", "_attributes", "_links", "_status", "_start_time",
                        "_end_time", "_resource", "_instrumentation_scope")


def _readable_span(fields: tuple[Any, ...]) -> Any:
    """An event's span as the SDK's ReadableSpan (when :class:`EventSpan` cannot be one)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanKind

    name, context, parent, attributes, links, status, start, end, resource, scope = fields
    return ReadableSpan(name, context, parent, resource, attributes, (), links, SpanKind.CONSUMER, None, status,
                        start, end, scope)


#: Providers whose every exporter builds the batches' spans itself (:func:`build_provider`).
_deferring: Any = None


def _sdk_of(api: Any, provider: Any, tracer: Any) -> _Sdk | None:
    """The SDK parts of *tracer*, None for another implementation of the API
    (its spans are then started and ended through the API)."""
    if not all(hasattr(tracer, name) for name in ("span_processor", "resource", "id_generator", "sampler")):
        return None
    try:
        return _Sdk(api, tracer, _deferring is not None and provider in _deferring)
    except ImportError:
        return None


def _sdk_types() -> tuple[Any, Any, Any]:
    """The classes that need the SDK: a batch's span carrying what its
    other spans are built from, the exporter wrapper that builds them, and
    an event's span (None when the SDK's ReadableSpan keeps other fields
    than it knows)."""
    global _types
    if _types is None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
        from opentelemetry.trace import SpanKind

        class BatchSpan(ReadableSpan):
            """A batch's span (a complete one: an exporter that knows nothing
            more exports it as it is) with the record its phases' and events'
            spans are built from (:meth:`spans`)."""

            def __init__(self, record: _Record, *args: Any) -> None:
                super().__init__(*args)
                self.record: _Record | None = record

            def spans(self, sink: Callable[[list[Any]], None] | None = None) -> list[Any]:
                """The batch's spans: its own, its phases', its events' (once);
                those given to *sink* as they are built are not in the list."""
                record, self.record = self.record, None
                return [] if record is None else _spans(record, self, sink)

        class Building(SpanExporter):
            """An exporter that builds each batch's spans from its record, in
            the export thread, and hands them to *exporter* in chunks."""

            def __init__(self, exporter: Any) -> None:
                self.exporter = exporter

            def export(self, spans: Sequence[Any]) -> Any:
                failed = False

                def send(built: list[Any]) -> None:
                    nonlocal failed
                    for i in range(0, len(built), _EXPORT_CHUNK):
                        failed |= self.exporter.export(built[i:i + _EXPORT_CHUNK]) != SpanExportResult.SUCCESS

                out: list[Any] = []
                for span in spans:
                    if isinstance(span, BatchSpan):
                        out.extend(span.spans(send))
                    else:
                        out.append(span)
                    if len(out) >= _EXPORT_SOON:
                        send(out)
                        out = []
                if out:
                    send(out)
                return SpanExportResult.FAILURE if failed else SpanExportResult.SUCCESS

            def shutdown(self) -> None:
                self.exporter.shutdown()

            def force_flush(self, timeout_millis: int = 30_000) -> bool:
                flushed: bool = self.exporter.force_flush(timeout_millis)
                return flushed

        class EventSpan(tuple[Any, ...], ReadableSpan):
            """An event's span: a ReadableSpan whose fields are a tuple's
            items, so that it is made in one call (``tuple.__new__``, no
            ``__init__`` in Python); an object as any other span (compared
            and hashed by identity)."""

            __slots__ = ()
            __init__ = object.__init__
            _kind, _events, _instrumentation_info = SpanKind.CONSUMER, (), None
            __eq__, __ne__, __hash__, __repr__ = object.__eq__, object.__ne__, object.__hash__, object.__repr__

        for i, field in enumerate(_EVENT_FIELDS):
            setattr(EventSpan, field, property(operator.itemgetter(i)))
        known = {*_EVENT_FIELDS, "_kind", "_events", "_instrumentation_info"}
        _types = (BatchSpan, Building, EventSpan if set(vars(ReadableSpan("probe"))) <= known else None)
    return _types


_types: tuple[Any, Any, Any] | None = None


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


class _Record:
    """What a batch's spans are built from, kept from its end until they are
    built: a tuple per field of its events (their headers, redelivered
    flags, eventIds, types and ``meta``, not their bodies) and of their
    outcomes (statuses, rejections). A few tuples of strings and untracked
    dicts, not objects per event: records wait for the export thread long
    enough to reach the collector's oldest generation, whose every
    collection walks the whole heap of the process."""

    __slots__ = ("attributes", "batch", "consumer", "end", "event_ids", "headers", "links_only", "metas", "opened",
                 "partition", "phases", "redelivered", "rejections", "sdk", "start", "status", "statuses", "types")

    def __init__(self, sdk: _Sdk, batch: Any, consumer: str, partition: int | None, start: int, end: int) -> None:
        self.sdk, self.batch, self.consumer, self.partition = sdk, batch, consumer, partition
        self.start, self.end = start, end
        self.headers: tuple[dict[str, Any] | None, ...] = ()
        self.redelivered: tuple[bool, ...] = ()
        self.event_ids: tuple[str | None, ...] = ()
        self.types: tuple[str | None, ...] = ()
        self.metas: tuple[dict[str, Any] | None, ...] = ()
        self.statuses: tuple[str, ...] = ()
        self.rejections: tuple[Rejection | None, ...] = ()
        self.opened: dict[str, Any] = {}
        self.phases: tuple[tuple[str, int, int], ...] = ()
        self.attributes: dict[str, Any] = {}
        self.status: Any = None
        self.links_only = False


def _traceparent_of(headers: Mapping[str, Any] | None, meta: Any) -> tuple[str | None, str | None]:
    """The producer's ``traceparent`` (header, else ``meta``) and its header
    ``tracestate``: :func:`parent_traceparent` on what a record keeps."""
    own = meta.get(TRACEPARENT) if meta else None
    return _from_headers(headers, own)[:2] if headers else (own, None)


def _from_headers(headers: Mapping[str, Any], own: str | None) -> tuple[str | None, str | None, int]:
    """The ``traceparent`` of a delivery with *headers* whose envelope's
    ``meta`` has *own* (which its schema checked, with :data:`_TRACEPARENT`'s
    pattern): the header's when it is one (checked unless it is the same),
    and then its ``tracestate``; and the delivery's attempt."""
    attempt = attempts_done(headers) + 1 if H_ATTEMPTS in headers else 1
    value = headers.get(TRACEPARENT)
    if value is None:
        return own, None, attempt
    if type(value) is bytes:
        value = value.decode("ascii", "replace")
    if value == own or (type(value) is str and _TRACEPARENT.fullmatch(value)):
        return value, _header(headers, TRACESTATE), attempt
    return own, None, attempt


def _count_results(attributes: dict[str, Any], statuses: Sequence[str | None]) -> None:
    """The batch span's ``delivery_consumer.results.<result>`` counts."""
    for result, n in Counter(statuses).items():
        attributes[f"delivery_consumer.results.{result}"] = n


_ID64: Final = (1 << 64) - 1
#: Not a key of any event's producer context (:func:`_spans`).
_NO_KEY: Final = object()


def _spans(record: _Record, carrier: Any, sink: Callable[[list[Any]], None] | None = None) -> list[Any]:
    """Build a batch's spans from its *record*: one per event (a child of its
    producer's context, linked to the batch; or, in links mode, a link of
    the batch's span), its phases and the batch's own (*carrier*, unless it
    gets the events as links). Every event's span is built here, so this
    loop is written for speed: locals, one dict display and two tuples per
    span, the batch's span ids at once, a producer's context parsed once
    for the events in a row that it enqueued. With a *sink*, the events'
    spans are given to it as soon as :data:`_EXPORT_SOON` are built, and the
    rest returned."""
    sdk = record.sdk
    api, sampled, new_context, context_type = sdk.api, sdk.sampled, sdk.new_context, sdk.context_type
    new_span, resource, scope = sdk.new_span, sdk.resource, sdk.scope
    from_bytes, fromhex = int.from_bytes, bytes.fromhex
    new_id, new_trace = sdk.ids.generate_span_id, sdk.ids.generate_trace_id
    batch, consumer, partition, start, now = record.batch, record.consumer, record.partition, record.start, record.end
    kind = api.SpanKind.CONSUMER
    unset = api.Status(api.StatusCode.UNSET)
    links_only, opened, count = record.links_only, record.opened, len(record.event_ids)
    _count_results(record.attributes, record.statuses)
    statuses: tuple[str | None, ...] = record.statuses
    rejections = record.rejections
    missing = count - len(statuses)  # an abandoned batch: no outcome for any event
    if missing > 0:
        statuses += (None,) * missing
        rejections += (None,) * missing
    # The SDK's random ids are random.getrandbits(64): the batch's all at once (0, the invalid id, is replaced).
    span_ids: Sequence[int] = (memoryview(random.randbytes(8 * count)).cast("Q").tolist() if sdk.random_ids
                               else [new_id() for _ in range(count)])
    columns = (record.headers, record.redelivered, record.event_ids, record.types, record.metas, statuses, rejections,
               span_ids)
    fast_root = sdk.root_on and not opened
    fast_child = sdk.parent_decides and not opened
    link = (api.Link(batch, {}),)
    no_state = api.DEFAULT_TRACE_STATE
    out: list[Any] = []
    links: list[Any] = []
    errors: dict[str, Any] = {}
    names: dict[str | None, str] = {}
    last: Any = _NO_KEY
    parent: Any = None
    trace_id, state = 0, no_state
    for low in range(0, count, _EXPORT_SOON):  # slices, for the sink
        high = low + _EXPORT_SOON
        for headers, redelivered, event_id, type_, meta, result, rejection, span_id in zip(
                *[column[low:high] for column in columns], strict=True):
            traceparent = meta.get(TRACEPARENT) if meta else None  # checked by the envelope's schema
            if headers:  # the dispatcher's traceparent (most often the same), a tracestate, a retry's attempts
                traceparent, tracestate, attempt = _from_headers(headers, traceparent)
                key = traceparent if tracestate is None else (traceparent, tracestate)
            else:
                key, tracestate, attempt = traceparent, None, 1
            if key != last:  # else the producer's context of the event before
                last, parent = key, None
                if traceparent is not None:
                    try:  # version 00, trace id, parent id and flags: 26 bytes, one int
                        whole = from_bytes(fromhex(traceparent.replace("-", " ")))
                    except ValueError:  # an envelope made without its schema: no parent rather than no spans
                        pass
                    else:
                        if not whole & 1:  # the sampled flag
                            parent = False
                        else:
                            trace_id, flags = whole >> 72, whole & 0xFF
                            state = no_state if tracestate is None else api.TraceState.from_header([tracestate])
                            fields = (trace_id, (whole >> 8) & _ID64, True,
                                      sampled if flags == 1 else api.TraceFlags(flags), state, True)
                            parent = new_context(context_type, fields)
            if parent is False:
                continue  # the producer's trace is not sampled: no span to record
            attributes: dict[str, Any] = {"delivery_consumer.consumer": consumer,
                                          "delivery_consumer.attempt": attempt, "messaging.message.id": event_id,
                                          "delivery_consumer.result": result}
            if event_id is None:
                del attributes["messaging.message.id"]
            if result is None:
                del attributes["delivery_consumer.result"]
            if partition is not None:
                attributes["delivery_consumer.partition"] = partition
            if redelivered:
                attributes["delivery_consumer.redelivered"] = True
            status = unset
            if rejection is not None:
                status = errors.get(rejection.code)
                if status is None:
                    status = errors[rejection.code] = api.Status(api.StatusCode.ERROR, rejection.code)
            if links_only:
                del attributes["delivery_consumer.consumer"]
                attributes.pop("delivery_consumer.partition", None)
                links.append(api.Link(api.INVALID_SPAN_CONTEXT if parent is None else parent, attributes))
                continue
            name = names.get(type_)
            if name is None:
                name = names[type_] = f"{consumer} apply" if type_ is None else f"{consumer} apply {type_}"
            if parent is None:
                if fast_root:
                    context = new_context(context_type, (new_trace(), span_id or new_id(), False, sampled, no_state,
                                                         True))
                else:
                    context = _slow_context(sdk, opened, event_id, None, name, attributes)
            elif fast_child:
                context = new_context(context_type, (trace_id, span_id or new_id(), False, sampled, state, True))
            else:
                context = _slow_context(sdk, opened, event_id, parent, name, attributes)
            if context is not None:
                out.append(new_span((name, context, parent, attributes, link, status, start, now, resource, scope)))
        if sink is not None and len(out) >= _EXPORT_SOON:
            sink(out)
            out = []
    if batch.trace_flags.sampled:
        readable, internal = sdk.readable, api.SpanKind.INTERNAL
        for name, begin, finish in record.phases:
            context = new_context(context_type, (batch.trace_id, new_id(), False, batch.trace_flags,
                                                 batch.trace_state, True))
            out.append(readable(name, context, batch, resource, {}, (), (), internal, None, unset, begin, finish,
                                scope))
        out.append(carrier if not links else readable(
            f"{consumer} batch", batch, None, resource, record.attributes, (), links, kind, None, record.status,
            start, now, scope))
    return out


def _slow_context(sdk: _Sdk, opened: dict[str, Any], event_id: str | None, parent: Any, name: str,
                  attributes: dict[str, Any]) -> Any:
    """An event span's context when it is not the plain case: begun for a
    fenced call, or a sampler that must be asked (its attributes join the
    span's)."""
    if opened and event_id is not None:
        context = opened.pop(event_id, None)
        if context is not None:
            return context
    decided = sdk.context(parent, name, sdk.api.SpanKind.CONSUMER, attributes)
    if decided is None:
        return None
    context, extra = decided
    attributes.update(extra)
    return context


class Batch(NoBatch):
    """One batch of ``run``: its span, its phases' times and its events.

    Applying a batch notes times and keeps references to the deliveries,
    their parsed envelopes and their outcomes; the spans are built when the
    batch ends (acked or abandoned), with their own start and end times, in
    one pass over the events. With the SDK a span is built finished (no live
    span, no lock, no validation of our own attributes) and handed to the
    processors; with a provider of :func:`provider`, the batch's span alone
    is handed over, carrying the record its other spans are built from in
    the export thread. With another implementation of the API, spans are
    started and ended through it with explicit times.
    """

    __slots__ = ("_api", "_attributes", "_commit", "_committed", "_consumer", "_context", "_items", "_open",
                 "_outcomes", "_parsed", "_parsed_at", "_partition", "_recorded", "_sdk", "_span", "_start",
                 "_tracer")

    def __init__(self, api: Any, tracer: Any, sdk: _Sdk | None, consumer: str, partition: int | None) -> None:
        self._api, self._tracer, self._sdk = api, tracer, sdk
        self._consumer, self._partition = consumer, partition
        self._start = time.time_ns()
        self._parsed_at = self._commit = self._committed = 0
        self._items: Sequence[Delivery] = ()
        self._parsed: Sequence[Envelope | Rejection] = ()
        self._outcomes: Sequence[Outcome] = ()
        #: eventId -> the context (SDK) or the started span (API) of an event whose fenced call began.
        self._open: dict[str, Any] = {}
        attributes: dict[str, Any] = {"messaging.system": "rabbitmq", "delivery_consumer.consumer": consumer}
        if partition is not None:
            attributes["delivery_consumer.partition"] = partition
        name, kind = f"{consumer} batch", api.SpanKind.CONSUMER
        if sdk is None:
            self._span = tracer.start_span(name, kind=kind, attributes=attributes, start_time=self._start)
            self._context = self._span.get_span_context()
        else:
            decided = sdk.context(None, name, kind, attributes)
            if decided is None:  # not recorded: its context is still the events' link and the calls' parent
                ids = sdk.ids
                self._context = api.SpanContext(ids.generate_trace_id(), ids.generate_span_id(), False)
            else:
                self._context, attributes = decided
            self._span = api.NonRecordingSpan(self._context)
        self._attributes = attributes

    @property
    def span(self) -> Any:
        """The batch's span (with the SDK, a non-recording one with its context)."""
        return self._span

    def parsed(self, items: Sequence[Delivery], parsed: Sequence[Envelope | Rejection]) -> None:
        self._parsed_at = time.time_ns()
        self._items, self._parsed = items, parsed
        self._attributes["messaging.batch.message_count"] = len(items)

    def mark_commit(self) -> None:
        self._commit = time.time_ns()

    def committed(self, outcomes: Sequence[Outcome]) -> None:
        self._committed = time.time_ns()
        self._outcomes = outcomes

    def parent_of(self, event_id: str | None) -> Any:
        """The span a fenced call of event *event_id* is a child of: the event's
        (begun now: its context is needed before the batch ends), else the batch's."""
        opened = self._open.get(event_id) if event_id is not None else None
        if opened is None and event_id is not None and not _links_only:
            for d, p in zip(self._items, self._parsed, strict=False):
                if p.event_id == event_id:
                    opened = self._begin(d, p)
                    break
            if opened is not None:
                self._open[event_id] = opened
        if opened is None:
            return self._span
        return self._api.NonRecordingSpan(opened) if self._sdk is not None else opened

    def _begin(self, d: Delivery, p: Envelope | Rejection) -> Any:
        """An event's span begun ahead of the batch's end (its context, with
        the SDK), or None when it is not recorded."""
        api = self._api
        traceparent, tracestate = _traceparent_of(d.headers, p.meta if isinstance(p, Envelope) else None)
        parent = None if traceparent is None else _remote(api, traceparent, tracestate)
        if parent is not None and not parent.trace_flags.sampled:
            return None
        name = f"{self._consumer} apply {p.type}" if isinstance(p, Envelope) else f"{self._consumer} apply"
        kind = api.SpanKind.CONSUMER
        if self._sdk is not None:
            decided = self._sdk.context(parent, name, kind, {})
            return None if decided is None else decided[0]
        context = None if parent is None else api.set_span_in_context(api.NonRecordingSpan(parent))
        return self._tracer.start_span(name, context=context, kind=kind, links=[api.Link(self._context)],
                                       start_time=self._start)

    def end(self, abandoned: bool = False) -> None:
        if getattr(_local, "batch", None) is self:
            _local.batch = None
        now = time.time_ns()
        api = self._api
        status = api.Status(api.StatusCode.UNSET)
        if abandoned:
            self._attributes["delivery_consumer.batch.abandoned"] = True
            status = api.Status(api.StatusCode.ERROR, "abandoned before its ack")
        parsed = self._parsed_at or now
        committed = self._committed or now
        phases = [("consume", self._start, parsed)]
        if self._commit:
            phases += [("apply", parsed, self._commit), ("commit", self._commit, committed)]
        else:
            phases.append(("apply", parsed, committed))
        if self._committed:
            phases.append(("ack", committed, now))
        sdk = self._sdk
        if sdk is None:
            _count_results(self._attributes, [outcome.status for outcome in self._outcomes])
            self._end_through_api(phases, status, now)
            return
        record = _Record(sdk, self._context, self._consumer, self._partition, self._start, now)
        # Tuples: the collector stops walking one once it has seen that it holds no container it tracks.
        items, envelopes = self._items, self._parsed
        record.headers = tuple([d.headers for d in items])
        record.redelivered = tuple([d.redelivered for d in items])
        record.event_ids = tuple([p.event_id for p in envelopes])
        record.types = tuple([p.type if type(p) is Envelope else None for p in envelopes])
        record.metas = tuple([p.fields.get("meta") if type(p) is Envelope else None for p in envelopes])
        outcomes = self._outcomes
        record.statuses = tuple([o.result if o.result is not None else o.status for o in outcomes])
        record.rejections = tuple([o.rejection for o in outcomes])
        record.opened, record.phases = self._open, tuple(phases)
        record.attributes, record.status, record.links_only = self._attributes, status, _links_only
        carrier = sdk.carrier(record, f"{self._consumer} batch", self._context, None, sdk.resource,
                              self._attributes, (), (), api.SpanKind.CONSUMER, None, status, self._start, now,
                              sdk.scope)
        if sdk.deferred and self._context.trace_flags.sampled:
            sdk.on_end(carrier)  # its exporters build the other spans in their thread
            return
        try:
            for span in carrier.spans():
                sdk.on_end(span)
        except Exception:  # tracing never stops a batch; the batch processor's thread logs the same way
            log.exception("tracing: the spans of a batch of %s could not be built", self._consumer)

    def _end_through_api(self, phases: list[tuple[str, int, int]], status: Any, now: int) -> None:
        """The spans of a batch traced by another implementation of the API."""
        api, tracer, span = self._api, self._tracer, self._span
        kind, link = api.SpanKind.CONSUMER, [api.Link(self._context)]
        base: dict[str, Any] = {"delivery_consumer.consumer": self._consumer}
        if self._partition is not None:
            base["delivery_consumer.partition"] = self._partition
        outcomes = self._outcomes
        for i, (d, p) in enumerate(zip(self._items, self._parsed, strict=False)):
            traceparent, tracestate = _traceparent_of(d.headers, p.meta if isinstance(p, Envelope) else None)
            parent = None if traceparent is None else _remote(api, traceparent, tracestate)
            if parent is not None and not parent.trace_flags.sampled:
                continue
            attributes = dict(base, **{"delivery_consumer.attempt": attempts_done(d.headers) + 1})
            if d.redelivered:
                attributes["delivery_consumer.redelivered"] = True
            if p.event_id is not None:
                attributes["messaging.message.id"] = p.event_id
            outcome = outcomes[i] if i < len(outcomes) else None
            if outcome is not None:
                attributes["delivery_consumer.result"] = outcome.status
            if _links_only:
                del attributes["delivery_consumer.consumer"]
                attributes.pop("delivery_consumer.partition", None)
                span.add_link(api.INVALID_SPAN_CONTEXT if parent is None else parent, attributes)
                continue
            begun = self._open.pop(p.event_id, None) if p.event_id is not None else None
            if begun is None:
                name = f"{self._consumer} apply {p.type}" if isinstance(p, Envelope) else f"{self._consumer} apply"
                context = None if parent is None else api.set_span_in_context(api.NonRecordingSpan(parent))
                begun = tracer.start_span(name, context=context, kind=kind, links=link, start_time=self._start)
            begun.set_attributes(attributes)
            if outcome is not None and outcome.rejection is not None:
                begun.set_status(api.Status(api.StatusCode.ERROR, outcome.rejection.code))
            begun.end(now)
        parent_context = api.set_span_in_context(span)
        for name, begin, finish in phases:
            tracer.start_span(name, context=parent_context, start_time=begin).end(finish)
        span.set_attributes(self._attributes)
        if status.status_code != api.StatusCode.UNSET:
            span.set_status(status)
        span.end(now)


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
    current = _local.batch = Batch(_api(), tracer, _local.sdk, consumer,
                                   None if partition is None else partition.partition)
    return current


def mark_commit() -> None:
    """The current batch's transaction is about to commit."""
    current = getattr(_local, "batch", None)
    if current is not None:
        current.mark_commit()


class CallOutcome(Protocol):
    """What a fenced call came back with, as its span records it (the
    fence's CallResult is one)."""

    @property
    def provider_id(self) -> str | None: ...
    @property
    def status(self) -> int | None: ...
    @property
    def failure(self) -> Rejection | TransientError | None: ...
    @property
    def ambiguous(self) -> bool: ...


class _NoCall:
    __slots__ = ()

    def __enter__(self) -> Callable[[CallOutcome], None]:
        return _ignore

    def __exit__(self, *_exc: object) -> None:
        return None


def _ignore(_result: CallOutcome) -> None:
    return None


_NO_CALL: Final = _NoCall()


class _Call:
    __slots__ = ("_scope", "_span")

    def __init__(self, span: Any, scope: Any) -> None:
        self._span, self._scope = span, scope

    def __enter__(self) -> Callable[[CallOutcome], None]:
        self._scope.__enter__()
        return self._result

    def _result(self, result: CallOutcome) -> None:
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
    what it gives with the call's outcome (a :class:`CallOutcome`)."""
    current = getattr(_local, "batch", None)
    if current is None:
        return _NO_CALL
    api = current._api
    parent = current.parent_of(env.event_id)
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
    "CallOutcome",
    "NoBatch",
    "batch",
    "build_provider",
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
