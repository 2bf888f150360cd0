"""The plain path: a batch of ``run`` traced through the OpenTelemetry API.

What both ways of building a batch's spans share -- the W3C header names,
the producer's context of a delivery, the batch's phases, the no-op batch
-- and the way that needs nothing but the API: every span started and ended
through the tracer, with explicit times. Any implementation of the API gets
its spans this way; the SDK's gets the same spans, built faster, from
``_sdk.py`` when its version and internals are the ones that path was
tested with. Nothing here imports ``opentelemetry``: the hooks hand in the
API module they found loaded.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from ...amqp.retry import attempts_done
from ...amqp.topology import H_ATTEMPTS
from ...model.envelope import Envelope
from ...model.errors import Rejection

if TYPE_CHECKING:
    from ...model.contract import Outcome
    from ...model.deliveries import Delivery

log = logging.getLogger("delivery_consumer.observability.tracing")

#: The W3C header names (AMQP headers and HTTP headers alike).
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
TRACEPARENT_PATTERN: Final = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
#: The instrumentation scope of every span made here.
SCOPE: Final = "delivery_consumer"
#: The status of a batch that ended before its ack.
ABANDONED: Final = "abandoned before its ack"

#: Per thread: the batch being traced (``batch``), and the tracer of the provider last used with what
#: the fast path keeps of it (``tracer``, ``provider``, ``fast``, ``sdk``).
local = threading.local()


def header(headers: Mapping[str, Any], name: str) -> str | None:
    """A header's value as text (AMQP headers may be bytes), or None."""
    value = headers.get(name)
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value if isinstance(value, str) else None


def traceparent_of(headers: Mapping[str, Any] | None, meta: Any) -> tuple[str | None, str | None]:
    """The producer's ``traceparent`` (header, else ``meta``) and its header
    ``tracestate``, from a delivery's headers and its envelope's ``meta``."""
    own = meta.get(TRACEPARENT) if meta else None
    return from_headers(headers, own)[:2] if headers else (own, None)


def from_headers(headers: Mapping[str, Any], own: str | None) -> tuple[str | None, str | None, int]:
    """The ``traceparent`` of a delivery with *headers* whose envelope's
    ``meta`` has *own* (which its schema checked, with
    :data:`TRACEPARENT_PATTERN`): the header's when it is one (checked unless
    it is the same), and then its ``tracestate``; and the delivery's attempt."""
    attempt = attempts_done(headers) + 1 if H_ATTEMPTS in headers else 1
    value = headers.get(TRACEPARENT)
    if value is None:
        return own, None, attempt
    if type(value) is bytes:
        value = value.decode("ascii", "replace")
    if value == own or (type(value) is str and TRACEPARENT_PATTERN.fullmatch(value)):
        return value, header(headers, TRACESTATE), attempt
    return own, None, attempt


def remote(api: Any, traceparent: str, tracestate: str | None) -> Any:
    """The remote span context *traceparent* (with *tracestate*) names."""
    state = api.TraceState.from_header([tracestate]) if tracestate else None
    return api.SpanContext(int(traceparent[3:35], 16), int(traceparent[36:52], 16), True,
                           api.TraceFlags(int(traceparent[53:55], 16)), state)


def count_results(attributes: dict[str, Any], statuses: Sequence[str | None]) -> None:
    """The batch span's ``delivery_consumer.results.<result>`` counts."""
    for result, n in Counter(statuses).items():
        attributes[f"delivery_consumer.results.{result}"] = n


def event_span_name(consumer: str, p: Envelope | Rejection) -> str:
    return f"{consumer} apply {p.type}" if isinstance(p, Envelope) else f"{consumer} apply"


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
    """One batch of ``run``: its span, its phases' times and its events.

    Applying a batch notes times and keeps references to the deliveries,
    their parsed envelopes and their outcomes; the spans are made when the
    batch ends (acked, or abandoned when the next one begins), with their own
    start and end times, in one pass over the events (:meth:`_finish`). This
    class makes them through the API (any implementation of it); the SDK's
    fast path is a subclass that builds the same spans finished.
    """

    __slots__ = ("_api", "_attributes", "_commit", "_committed", "_consumer", "_context", "_items", "_links_only",
                 "_open", "_outcomes", "_parsed", "_parsed_at", "_partition", "_span", "_start", "_tracer")

    def __init__(self, api: Any, tracer: Any, consumer: str, partition: int | None, links_only: bool) -> None:
        self._api, self._tracer = api, tracer
        self._consumer, self._partition, self._links_only = consumer, partition, links_only
        self._start = time.time_ns()
        self._parsed_at = self._commit = self._committed = 0
        self._items: Sequence[Delivery] = ()
        self._parsed: Sequence[Envelope | Rejection] = ()
        self._outcomes: Sequence[Outcome] = ()
        #: eventId -> the started span (the SDK's fast path: its context) of an event whose fenced call began.
        self._open: dict[str, Any] = {}
        attributes: dict[str, Any] = {"messaging.system": "rabbitmq", "delivery_consumer.consumer": consumer}
        if partition is not None:
            attributes["delivery_consumer.partition"] = partition
        self._attributes = attributes
        self._begin_batch(f"{consumer} batch", api.SpanKind.CONSUMER)

    def _begin_batch(self, name: str, kind: Any) -> None:
        """Start the batch's span: ``_span``, and ``_context``, its context."""
        self._span = self._tracer.start_span(name, kind=kind, attributes=self._attributes, start_time=self._start)
        self._context = self._span.get_span_context()

    @property
    def span(self) -> Any:
        """The batch's span (with the SDK's fast path, a non-recording one with its context)."""
        return self._span

    @property
    def tracer(self) -> Any:
        return self._tracer

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
        if opened is None and event_id is not None and not self._links_only:
            for d, p in zip(self._items, self._parsed, strict=False):
                if p.event_id == event_id:
                    opened = self._begin_event(d, p)
                    break
            if opened is not None:
                self._open[event_id] = opened
        if opened is None:
            return self._span
        return self._as_span(opened)

    def _as_span(self, opened: Any) -> Any:
        """The span of an event begun ahead of the batch's end."""
        return opened

    def _producer_context(self, d: Delivery, p: Envelope | Rejection) -> Any:
        """The producer's span context of delivery *d*, or None."""
        traceparent, tracestate = traceparent_of(d.headers, p.meta if isinstance(p, Envelope) else None)
        return None if traceparent is None else remote(self._api, traceparent, tracestate)

    def _begin_event(self, d: Delivery, p: Envelope | Rejection) -> Any:
        """An event's span begun ahead of the batch's end, or None when it is not recorded."""
        api = self._api
        parent = self._producer_context(d, p)
        if parent is not None and not parent.trace_flags.sampled:
            return None
        context = None if parent is None else api.set_span_in_context(api.NonRecordingSpan(parent))
        return self._tracer.start_span(event_span_name(self._consumer, p), context=context,
                                       kind=api.SpanKind.CONSUMER, links=[api.Link(self._context)],
                                       start_time=self._start)

    def end(self, abandoned: bool = False) -> None:
        if getattr(local, "batch", None) is self:
            local.batch = None
        now = time.time_ns()
        api = self._api
        status = api.Status(api.StatusCode.UNSET)
        if abandoned:
            self._attributes["delivery_consumer.batch.abandoned"] = True
            status = api.Status(api.StatusCode.ERROR, ABANDONED)
        parsed = self._parsed_at or now
        committed = self._committed or now
        phases = [("consume", self._start, parsed)]
        if self._commit:
            phases += [("apply", parsed, self._commit), ("commit", self._commit, committed)]
        else:
            phases.append(("apply", parsed, committed))
        if self._committed:
            phases.append(("ack", committed, now))
        try:
            self._finish(tuple(phases), status, now)
        except Exception:  # tracing never stops a batch
            log.exception("tracing: the spans of a batch of %s could not be made", self._consumer)

    def _finish(self, phases: tuple[tuple[str, int, int], ...], status: Any, now: int) -> None:
        """Make the batch's spans: its events', its *phases*' and its own."""
        api, tracer, span = self._api, self._tracer, self._span
        kind, link = api.SpanKind.CONSUMER, [api.Link(self._context)]
        count_results(self._attributes, [outcome.status for outcome in self._outcomes])
        base: dict[str, Any] = {"delivery_consumer.consumer": self._consumer}
        if self._partition is not None:
            base["delivery_consumer.partition"] = self._partition
        outcomes = self._outcomes
        for i, (d, p) in enumerate(zip(self._items, self._parsed, strict=False)):
            parent = self._producer_context(d, p)
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
            if self._links_only:
                del attributes["delivery_consumer.consumer"]
                attributes.pop("delivery_consumer.partition", None)
                span.add_link(api.INVALID_SPAN_CONTEXT if parent is None else parent, attributes)
                continue
            begun = self._open.pop(p.event_id, None) if p.event_id is not None else None
            if begun is None:  # the sampler sees the span's attributes; a sampler's own do not replace them
                context = None if parent is None else api.set_span_in_context(api.NonRecordingSpan(parent))
                begun = tracer.start_span(event_span_name(self._consumer, p), context=context, kind=kind,
                                          attributes=attributes, links=link, start_time=self._start)
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
