"""The SDK's fast path: a batch's spans built finished, through SDK internals.

The only module that relies on how ``opentelemetry-sdk`` is made inside:
an event's span is a subclass of ``ReadableSpan`` whose private fields are
a tuple's items (made by ``tuple.__new__``, as is a ``SpanContext`` whose
checks were already made here), built in one pass with no live span, no
lock and no call of the sampler when its description says what it would
answer; with a provider of ``build_provider``, the batch's span carries a
record its exporters build the other spans from, in the export thread.
It makes the spans the plain path (``_plain.py``) makes through the API --
tests/service/test_tracing_paths.py holds both to that -- and is used
only with an SDK in :data:`SUPPORTED` whose internals pass :func:`check`;
the hooks fall back to the plain path otherwise, with one log line.
"""

from __future__ import annotations

import inspect
import operator
import os
import random
from collections.abc import Callable, Sequence
from typing import Any, Final

from opentelemetry import trace as api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, StaticSampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from ...model.envelope import Envelope
from ...model.errors import Rejection
from ._plain import SCOPE, TRACEPARENT, Batch, count_results, event_span_name, from_headers, log

#: The versions of opentelemetry-sdk the fast path is tested with (tests/service/test_tracing_paths.py
#: on each; docs/tracing.md): from the first, up to but not including the second.
SUPPORTED: Final = ((1, 25), (1, 46))

#: A ParentBased sampler whose remote and local parents decide (the SDK's default delegates).
_PARENT_DECIDES: Final = (",remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler,"
                          "localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}")
#: Spans handed to an exporter at a time (at most) when a batch's spans are built in the export thread.
_EXPORT_CHUNK: Final = 512
#: Built spans are exported as soon as there are this many: the fewer alive at once, the fewer
#: the garbage collector moves to its oldest generation, whose collections walk the whole heap.
EXPORT_SOON: Final = 128
#: ReadableSpan's constructor, as its fields are given to it here (by keyword) and kept (by name).
_CONSTRUCTOR: Final = ("name", "context", "parent", "resource", "attributes", "events", "links", "kind",
                       "instrumentation_info", "status", "start_time", "end_time", "instrumentation_scope")
#: The fields of an event's span, in the order :func:`spans` gives them (:class:`EventSpan`).
_EVENT_FIELDS: Final = ("_name", "_context", "_parent", "_attributes", "_links", "_status", "_start_time",
                        "_end_time", "_resource", "_instrumentation_scope")
#: The span limits the spans built here stay within (the SDK's own spans are cut to the tracer's limits).
_LEAST_ATTRIBUTES: Final = 32
_ID64: Final = (1 << 64) - 1
#: Not a key of any event's producer context (:func:`spans`).
_NO_KEY: Final = object()
_RANDOM: Final = int(getattr(api.TraceFlags, "RANDOM_TRACE_ID", 0))


def version() -> str:
    """The installed opentelemetry-sdk's version."""
    from opentelemetry.sdk.version import __version__

    return str(__version__)


def _release(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check() -> str | None:
    """Why the fast path cannot be used with the installed SDK (one line), or
    None: its version is in :data:`SUPPORTED` and the internals the fast path
    builds spans with have the shape it knows, as probes of them show."""
    found = version()
    low, high = SUPPORTED
    if not low <= _release(found) < high:
        return (f"opentelemetry-sdk {found} is outside the versions the fast path is tested with "
                f"(>={low[0]}.{low[1]}, <{high[0]}.{high[1]})")
    if os.environ.get("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "").strip().lower() == "true":
        return "the SDK's own span metrics are on (OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED)"
    for probe in (_probe_context, _probe_readable_span, _probe_event_span, _probe_flags, _probe_samplers):
        try:
            reason = probe()
        except Exception as exc:  # a shape this module does not know fails its probe in any way
            reason = f"{probe.__name__[7:].replace('_', ' ')}: {type(exc).__name__}: {exc}"
        if reason is not None:
            return f"opentelemetry-sdk {found}: {reason}"
    return None


def _probe_context() -> str | None:
    """SpanContext is still the tuple of its six fields that ``tuple.__new__`` can make."""
    probe = api.SpanContext(1, 2, False, api.TraceFlags(1))
    fields = (1, 2, False, probe.trace_flags, probe.trace_state, True)
    made = tuple.__new__(api.SpanContext, fields)
    read = (made.trace_id, made.span_id, made.is_remote, made.trace_flags, made.is_valid)
    if not (issubclass(api.SpanContext, tuple) and tuple(probe) == fields and read == (1, 2, False, 1, True)):
        return "SpanContext is not the tuple of six fields it was"
    return None


def _probe_readable_span() -> str | None:
    """ReadableSpan takes the fields named in :data:`_CONSTRUCTOR` and gives them back."""
    parameters = list(inspect.signature(ReadableSpan.__init__).parameters)[1:]
    if parameters[:len(_CONSTRUCTOR)] != list(_CONSTRUCTOR):
        return f"ReadableSpan's constructor takes {', '.join(parameters)}"
    if set(vars(ReadableSpan("probe"))) - {*_EVENT_FIELDS, "_kind", "_events", "_instrumentation_info"}:
        return f"ReadableSpan keeps fields {sorted(vars(ReadableSpan('probe')))}"
    return None


def _probe_event_span() -> str | None:
    """An :class:`EventSpan` answers as the ReadableSpan of the same fields does."""
    context = api.SpanContext(3, 4, False, api.TraceFlags(1))
    parent = api.SpanContext(5, 6, True, api.TraceFlags(1))
    link = (api.Link(parent, {"a": 1}),)
    status = api.Status(api.StatusCode.ERROR, "probe")
    scope = InstrumentationScope(SCOPE)
    resource = Resource({"service.name": "probe"})
    event = EventSpan(("probe", context, parent, {"k": "v"}, link, status, 7, 8, resource, scope))
    readable = ReadableSpan(name="probe", context=context, parent=parent, resource=resource, attributes={"k": "v"},
                            links=link, kind=api.SpanKind.CONSUMER, status=status, start_time=7, end_time=8,
                            instrumentation_scope=scope)
    if event.to_json() != readable.to_json() or dict(event.attributes) != {"k": "v"}:
        return "an event's span does not read as the ReadableSpan of its fields"
    return None


def _probe_flags() -> str | None:
    """The flags the SDK gives a sampled root and a sampled child of a remote
    parent are those :func:`flags` computes."""
    provider = TracerProvider(sampler=ALWAYS_ON, id_generator=RandomIdGenerator(), shutdown_on_exit=False)
    tracer = provider.get_tracer("probe")
    ids = RandomIdGenerator()
    got = [int(tracer.start_span("root").get_span_context().trace_flags)]
    want = [int(flags(ids, None))]
    for bits in (1, 1 | _RANDOM):
        parent = api.SpanContext(7, 8, True, api.TraceFlags(bits))
        context = api.set_span_in_context(api.NonRecordingSpan(parent))
        got.append(int(tracer.start_span("child", context=context).get_span_context().trace_flags))
        want.append(int(flags(ids, parent)))
    if got != want:
        return f"the SDK's flags of a root and two children are {got}, not {want}"
    return None


def _probe_samplers() -> str | None:
    """The SDK's default samplers describe themselves as :class:`Sdk` reads them."""
    parent_based: Any = ParentBased(ALWAYS_ON)
    always: Any = ALWAYS_ON
    default = str(parent_based.get_description())
    if str(always.get_description()) != "AlwaysOnSampler" or \
            default != "ParentBased{root:AlwaysOnSampler" + _PARENT_DECIDES:
        return f"the default sampler describes itself as {default}"
    return None


def flags(ids: Any, parent: Any, sampled: bool = True) -> Any:
    """The trace flags the SDK gives a span under *parent* (None: a root):
    sampled or not, and, where the SDK marks it (W3C level 2), the random
    trace id flag of a root from a random id generator or of its parent."""
    bits = 1 if sampled else 0
    if _RANDOM:
        if parent is None:
            random_trace_id = getattr(ids, "is_trace_id_random", None)
            bits |= _RANDOM if random_trace_id is not None and random_trace_id() else 0
        else:
            bits |= int(parent.trace_flags) & _RANDOM
    return api.TraceFlags(bits)


def unusable(tracer: Any) -> str | None:
    """Why the spans of *tracer* (an SDK tracer) cannot be built here (one
    line), or None: its span limits would cut what the SDK's spans hold,
    or it counts its spans in metrics."""
    limits = getattr(tracer, "_span_limits", None)
    if limits is None:
        return "an SDK tracer without span limits"
    for name, least in (("max_span_attributes", _LEAST_ATTRIBUTES), ("max_link_attributes", _LEAST_ATTRIBUTES),
                        ("max_links", 1)):
        value = getattr(limits, name, None)
        if value is not None and value < least:
            return f"the tracer's span limits ({name}={value}) would cut the spans"
    for name in ("max_attribute_length", "max_span_attribute_length"):
        if getattr(limits, name, None) is not None:
            return f"the tracer's span limits ({name}={getattr(limits, name)}) would cut the spans"
    metrics = getattr(tracer, "_tracer_metrics", None)
    if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":  # always, in 1.40 and 1.41
        return "the SDK counts every span in its own metrics"
    return None


class Sdk:
    """The parts of an SDK tracer that a batch builds its finished spans
    with: its processors (each span is handed to ``on_end`` once, finished),
    its resource, id generator and sampler. The sampler is asked only when
    its answer is known from its type and description: the default, parent-based
    one follows the producer's sampled flag and samples a root."""

    __slots__ = ("default_flags", "deferred", "enabled", "ids", "on_end", "parent_decides", "random_ids",
                 "resource", "root_flags", "root_on", "sampled", "sampled_random", "sampler", "scope")

    def __init__(self, tracer: Any, deferred: bool) -> None:
        #: The provider's exporters build a batch's spans in their thread (``build_provider``).
        self.deferred = deferred
        #: Whether the tracer makes spans at all (the SDK's tracer configurator may turn it off).
        self.enabled: Callable[[], bool] = getattr(tracer, "_is_enabled", _always)
        self.on_end = tracer.span_processor.on_end
        self.resource = tracer.resource
        self.ids = tracer.id_generator
        #: The SDK's random ids: its generator calls ``random.getrandbits``, less a Python frame here.
        self.random_ids = type(self.ids) is RandomIdGenerator
        self.sampler = tracer.sampler
        #: The tracer's own instrumentation scope, as the SDK gives its spans.
        self.scope = getattr(tracer, "_instrumentation_scope", None) or InstrumentationScope(SCOPE, "")
        self.root_flags, self.default_flags = flags(self.ids, None), flags(self.ids, None, sampled=False)
        self.sampled = api.TraceFlags(api.TraceFlags.SAMPLED)
        #: A sampled child's flags under a parent with the random trace id flag (the SDK passes it on).
        self.sampled_random = api.TraceFlags(api.TraceFlags.SAMPLED | _RANDOM)
        description = str(self.sampler.get_description())
        always = type(self.sampler) is StaticSampler and description == "AlwaysOnSampler"
        self.parent_decides = always or (type(self.sampler) is ParentBased and description.startswith("ParentBased{")
                                         and description.endswith(_PARENT_DECIDES))
        self.root_on = always or (self.parent_decides and description.startswith("ParentBased{root:AlwaysOnSampler,"))

    def context(self, parent: Any, name: str, kind: Any, attributes: dict[str, Any],
                links: Sequence[Any] = ()) -> tuple[Any, dict[str, Any], bool]:
        """The context of a new span under *parent* (a SpanContext, or None
        for a root), its attributes, and whether it is recorded -- as the
        SDK's ``start_span`` decides them."""
        ids = self.ids
        if parent is None:
            trace_id = ids.generate_trace_id()
            if self.root_on:
                return api.SpanContext(trace_id, ids.generate_span_id(), False, self.root_flags), attributes, True
        elif self.parent_decides:
            sampled = bool(parent.trace_flags.sampled)
            return (api.SpanContext(parent.trace_id, ids.generate_span_id(), False, flags(ids, parent, sampled),
                                    parent.trace_state), attributes, sampled)
        else:
            trace_id = parent.trace_id
        context = None if parent is None else api.set_span_in_context(api.NonRecordingSpan(parent))
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        if result.attributes:  # the sampler's join ours (the plain path sets ours on the started span)
            attributes = {**result.attributes, **attributes}
        made = api.SpanContext(trace_id, ids.generate_span_id(), False,
                               flags(ids, parent, result.decision.is_sampled()), result.trace_state)
        return made, attributes, result.decision.is_recording()


def _always() -> bool:
    return True


class SdkBatch(Batch):
    """A batch whose spans are built finished when it ends: with a provider
    of ``build_provider``, the batch's span alone is handed over, carrying the
    record its other spans are built from in the export thread; else each
    span is built here and handed to the processors."""

    __slots__ = ("_sdk",)

    def __init__(self, api_: Any, tracer: Any, sdk: Sdk, consumer: str, partition: int | None,
                 links_only: bool) -> None:
        self._sdk = sdk
        super().__init__(api_, tracer, consumer, partition, links_only)

    def _begin_batch(self, name: str, kind: Any) -> None:
        context, attributes, recorded = self._sdk.context(None, name, kind, self._attributes)
        self._context = context  # not recorded: still the events' link and the calls' parent
        if recorded:
            self._attributes = attributes
        self._span = api.NonRecordingSpan(context)

    def _as_span(self, opened: Any) -> Any:
        return api.NonRecordingSpan(opened[0])

    def _begin_event(self, d: Any, p: Envelope | Rejection) -> Any:
        """An event's span begun ahead of the batch's end: its context, the
        sampler's attributes and whether it is recorded; None when its
        producer's trace is not sampled."""
        parent = self._producer_context(d, p)
        if parent is not None and not parent.trace_flags.sampled:
            return None
        return self._sdk.context(parent, event_span_name(self._consumer, p), api.SpanKind.CONSUMER, {},
                                 (api.Link(self._context),))

    def _finish(self, phases: tuple[tuple[str, int, int], ...], status: Any, now: int) -> None:
        sdk = self._sdk
        record = Record(sdk, self._context, self._consumer, self._partition, self._start, now)
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
        record.opened, record.phases = self._open, phases
        record.attributes, record.status, record.links_only = self._attributes, status, self._links_only
        carrier = BatchSpan(record, name=f"{self._consumer} batch", context=self._context, resource=sdk.resource,
                            attributes=self._attributes, kind=api.SpanKind.CONSUMER, status=status,
                            start_time=self._start, end_time=now, instrumentation_scope=sdk.scope)
        if sdk.deferred and self._context.trace_flags.sampled:
            sdk.on_end(carrier)  # its exporters build the other spans in their thread
            return
        for span in carrier.spans():
            sdk.on_end(span)


class Record:
    """What a batch's spans are built from, kept from its end until they are
    built: a tuple per field of its events (their headers, redelivered
    flags, eventIds, types and ``meta``, not their bodies) and of their
    outcomes (statuses, rejections). A few tuples of strings and untracked
    dicts, not objects per event: records wait for the export thread long
    enough to reach the collector's oldest generation, whose every
    collection walks the whole heap of the process."""

    __slots__ = ("attributes", "batch", "consumer", "end", "event_ids", "headers", "links_only", "metas", "opened",
                 "partition", "phases", "redelivered", "rejections", "sdk", "start", "status", "statuses", "types")

    def __init__(self, sdk: Sdk, batch: Any, consumer: str, partition: int | None, start: int, end: int) -> None:
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


class BatchSpan(ReadableSpan):
    """A batch's span (a complete one: an exporter that knows nothing more
    exports it as it is) with the record its phases' and events' spans are
    built from (:meth:`spans`)."""

    def __init__(self, record: Record, **fields: Any) -> None:
        super().__init__(**fields)
        self.record: Record | None = record

    def spans(self, sink: Callable[[list[Any]], None] | None = None) -> list[Any]:
        """The batch's spans: its own, its phases', its events' (once);
        those given to *sink* as they are built are not in the list."""
        record, self.record = self.record, None
        return [] if record is None else spans(record, self, sink)


class Building(SpanExporter):
    """An exporter that builds each batch's spans from its record, in the
    export thread, and hands them to *exporter* in chunks."""

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
                try:
                    out.extend(span.spans(send))
                except Exception:  # the batch processor's thread logs an exporter's failure the same way
                    log.exception("tracing: the spans of a batch could not be built")
                    failed = True
            else:
                out.append(span)
            if len(out) >= EXPORT_SOON:
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
    """An event's span: a ReadableSpan whose fields are a tuple's items, so
    that it is made in one call (``tuple.__new__``, no ``__init__`` in
    Python); an object as any other span (compared and hashed by identity)."""

    __slots__ = ()
    __init__ = object.__init__
    _kind, _events, _instrumentation_info = api.SpanKind.CONSUMER, (), None
    __eq__, __ne__, __hash__, __repr__ = object.__eq__, object.__ne__, object.__hash__, object.__repr__


def _fields_of_event_spans() -> None:
    for i, field in enumerate(_EVENT_FIELDS):
        setattr(EventSpan, field, property(operator.itemgetter(i)))


_fields_of_event_spans()


def spans(record: Record, carrier: Any, sink: Callable[[list[Any]], None] | None = None) -> list[Any]:
    """Build a batch's spans from its *record*: one per event (a child of its
    producer's context, linked to the batch; or, in links mode, a link of
    the batch's span), its phases and the batch's own (*carrier*, unless it
    gets the events as links). Every event's span is built here, so this
    loop is written for speed: locals, one dict display and two tuples per
    span, the batch's span ids at once, a producer's context parsed once
    for the events in a row that it enqueued. With a *sink*, the events'
    spans are given to it as soon as :data:`EXPORT_SOON` are built, and the
    rest returned."""
    sdk = record.sdk
    sampled, root_flags, new_context, context_type = sdk.sampled, sdk.root_flags, tuple.__new__, api.SpanContext
    new_span, resource, scope = EventSpan, sdk.resource, sdk.scope
    from_bytes, fromhex = int.from_bytes, bytes.fromhex
    new_id, new_trace = sdk.ids.generate_span_id, sdk.ids.generate_trace_id
    batch, consumer, partition, start, now = record.batch, record.consumer, record.partition, record.start, record.end
    kind, random_flag, sampled_random = api.SpanKind.CONSUMER, _RANDOM, sdk.sampled_random
    unset: Any = api.Status(api.StatusCode.UNSET)
    links_only, opened, count = record.links_only, record.opened, len(record.event_ids)
    count_results(record.attributes, record.statuses)
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
    trace_id, state, child_flags = 0, no_state, sampled
    for low in range(0, count, EXPORT_SOON):  # slices, for the sink
        high = low + EXPORT_SOON
        for headers, redelivered, event_id, type_, meta, result, rejection, span_id in zip(
                *[column[low:high] for column in columns], strict=True):
            traceparent = meta.get(TRACEPARENT) if meta else None  # checked by the envelope's schema
            if headers:  # the dispatcher's traceparent (most often the same), a tracestate, a retry's attempts
                traceparent, tracestate, attempt = from_headers(headers, traceparent)
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
                            trace_id, bits = whole >> 72, whole & 0xFF
                            state = no_state if tracestate is None else api.TraceState.from_header([tracestate])
                            parent_flags = sampled if bits == 1 else api.TraceFlags(bits)
                            child_flags = sampled_random if bits & random_flag else sampled
                            parent = new_context(context_type, (trace_id, (whole >> 8) & _ID64, True, parent_flags,
                                                                state, True))
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
                    context = new_context(context_type, (new_trace(), span_id or new_id(), False, root_flags, no_state,
                                                         True))
                else:
                    context, attributes = _slow_context(sdk, opened, event_id, None, name, attributes, link)
            elif fast_child:
                context = new_context(context_type, (trace_id, span_id or new_id(), False, child_flags, state, True))
            else:
                context, attributes = _slow_context(sdk, opened, event_id, parent, name, attributes, link)
            if context is not None:
                out.append(new_span((name, context, parent, attributes, link, status, start, now, resource, scope)))
        if sink is not None and len(out) >= EXPORT_SOON:
            sink(out)
            out = []
    if batch.trace_flags.sampled:
        internal = api.SpanKind.INTERNAL
        for name, begin, finish in record.phases:
            if sdk.parent_decides:
                context, attributes = new_context(context_type, (batch.trace_id, new_id(), False, batch.trace_flags,
                                                                 batch.trace_state, True)), {}
            else:
                context, attributes, recorded = sdk.context(batch, name, internal, {})
                if not recorded:
                    continue
            out.append(ReadableSpan(name=name, context=context, parent=batch, resource=resource, attributes=attributes,
                                    kind=internal, status=unset, start_time=begin, end_time=finish,
                                    instrumentation_scope=scope))
        out.append(carrier if not links else ReadableSpan(
            name=f"{consumer} batch", context=batch, resource=resource, attributes=record.attributes, links=links,
            kind=kind, status=record.status, start_time=start, end_time=now, instrumentation_scope=scope))
    return out


def _slow_context(sdk: Sdk, opened: dict[str, Any], event_id: str | None, parent: Any, name: str,
                  attributes: dict[str, Any], links: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    """An event span's context (None when it is not recorded) and attributes
    when it is not the plain case: begun for a fenced call, or a sampler that
    must be asked (its attributes join the span's)."""
    if opened and event_id is not None:
        begun = opened.pop(event_id, None)
        if begun is not None:
            context, sampler_said, recorded = begun
            if not recorded:
                return None, attributes
            return context, ({**sampler_said, **attributes} if sampler_said else attributes)
    context, attributes, recorded = sdk.context(parent, name, api.SpanKind.CONSUMER, attributes, links)
    return (context if recorded else None), attributes
