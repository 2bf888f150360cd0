"""OpenTelemetry traces: the only package that imports ``opentelemetry``.

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
  all made when the batch ends;
* :func:`external_call` and :func:`http_headers` -- the fenced external call
  is a child span of its event's span and sends ``traceparent`` to the endpoint.

A batch's spans are made one of two ways, the same spans either way: the
plain path (``_plain.py``) through the API, for any implementation of it;
with the SDK, the fast path (``_sdk.py``) builds them finished through the
SDK's internals -- only with an SDK whose version it is tested with and
whose internals pass its checks, else the plain path, said in one log line
(:func:`fast_path`).

:func:`configure` sets up the SDK for ``run`` and ``dispatch`` from the
standard ``OTEL_*`` variables when ``OTEL_TRACES_EXPORTER`` names exporters,
with :func:`build_provider`, whose exporters build a batch's spans in the
export thread.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson

from ...model.envelope import Envelope, canonical_bytes
from ...model.errors import Rejection, TransientError
from ._plain import (
    NO_BATCH,
    SCOPE,
    TRACEPARENT,
    TRACEPARENT_PATTERN,
    TRACESTATE,
    Batch,
    NoBatch,
    header,
    local,
    log,
)

if TYPE_CHECKING:
    from ...amqp.partitions import Identity

#: ``OTEL_TRACES_EXPORTER`` value for finished spans written as JSON lines to
#: the file named by :data:`FILE_ENV` (one span a line; any process may append).
JSONL_EXPORTER: Final = "jsonl"
FILE_ENV: Final = "DELIVERY_TRACES_FILE"
#: ``spans`` (default): one span per event; ``links``: each event a link of its batch's span.
EVENTS_ENV: Final = "DELIVERY_TRACE_EVENTS"
#: ``0`` (or ``off``, ``false``, ``no``): make every span through the API, never the SDK's fast path.
FAST_ENV: Final = "DELIVERY_TRACE_FAST"
_API: Final = "opentelemetry.trace"

_installed: bool | None = None
#: Events as links of the batch span rather than spans (:func:`events_as_links`).
_links_only = False
#: A provider given with :func:`set_provider` (else the global one).
_provider: Any = None
#: Whether the fast path may be used (:func:`fast_path`), and, once the first SDK tracer asked,
#: its module when it can be (else False).
_fast_wanted: bool | None = None
_fast: ModuleType | bool | None = None
#: Why the fast path was not used for a tracer, each said once (:func:`_sdk_of`).
_said: set[str] = set()


def installed() -> bool:
    """Whether the OpenTelemetry API can be imported (looked up once)."""
    global _installed
    if _installed is None:
        try:
            _installed = importlib.util.find_spec(_API) is not None
        except (ImportError, ValueError):  # a parent package that is not there (or blocked)
            _installed = False
    return _installed


def _loaded_api() -> Any:
    """The ``opentelemetry.trace`` module if this process imported it, else None."""
    return sys.modules.get(_API)


def set_provider(provider: Any) -> None:
    """Trace with *provider* instead of the global tracer provider (None: the
    global one again); for embedding a worker in a process that has its own."""
    global _provider
    _provider = provider


def _active_tracer() -> Any:
    """A tracer of an active (SDK) tracer provider, or None."""
    api = _loaded_api()
    if api is None:
        return None
    provider = _provider if _provider is not None else api.get_tracer_provider()
    if isinstance(provider, api.ProxyTracerProvider | api.NoOpTracerProvider):
        return None
    tracer = getattr(local, "tracer", None)
    if tracer is None or local.provider is not provider or local.fast is not _fast:
        tracer = provider.get_tracer(SCOPE)
        local.tracer, local.provider = tracer, provider
        local.sdk, local.fast = _sdk_of(provider, tracer), _fast
    return tracer


# -- which path makes a batch's spans -----------------------------------------------


def fast_path(enabled: bool | None = None) -> bool:
    """Whether the SDK's tracers get their spans built by the fast path.
    *enabled* False makes every span through the API from now on (as
    ``DELIVERY_TRACE_FAST=0`` does), True uses the fast path where it can
    be (the default; checked again), None only asks. The fast path is used
    with an SDK whose version it is tested with and whose internals pass
    its checks (``_sdk.check``, once); otherwise one log line says why."""
    global _fast_wanted, _fast
    if enabled is not None:
        _fast_wanted, _fast = enabled, None
        _said.clear()
    return _fast_module() is not None


def _fast_module() -> Any:
    """The fast path's module when it can be used in this process, else None."""
    global _fast, _fast_wanted
    if _fast is None:
        if _fast_wanted is None:
            _fast_wanted = os.environ.get(FAST_ENV, "1").strip().lower() not in ("0", "off", "false", "no")
        if not _fast_wanted:
            _fast = False
            return None
        try:
            from . import _sdk
        except ImportError:  # no SDK: nothing to build faster
            _fast = False
            return None
        except Exception as exc:  # its classes cannot even be made on this SDK
            reason: str | None = f"the fast path cannot be loaded ({type(exc).__name__}: {exc})"
        else:
            reason = _sdk.check()
        if reason is not None:
            log.warning("tracing: %s: spans are made through the OpenTelemetry API instead (the same spans, "
                        "slower; docs/tracing.md)", reason)
            _fast = False
            return None
        _fast = _sdk
    return _fast or None


#: Providers whose every exporter builds the batches' spans itself (:func:`build_provider`).
_deferring: Any = None


def _sdk_of(provider: Any, tracer: Any) -> Any:
    """What the fast path keeps of an SDK *tracer* (``_sdk.Sdk``), or None:
    another implementation of the API, or the fast path is not used (its
    spans are then started and ended through the API)."""
    if not all(hasattr(tracer, name) for name in ("span_processor", "resource", "id_generator", "sampler")):
        return None
    fast = _fast_module()
    if fast is None:
        return None
    reason = fast.unusable(tracer)
    if reason is not None:
        if reason not in _said:
            _said.add(reason)
            log.warning("tracing: %s: its spans are made through the OpenTelemetry API (docs/tracing.md)", reason)
        return None
    return fast.Sdk(tracer, _deferring is not None and provider in _deferring)


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
    BatchSpanProcessor and to each of the *immediate* ones at once. With the
    fast path, ``run``'s batches hand it one span each, from which its
    exporters build the batch's other spans in the export thread; a span
    processor added to it later sees only the batches' spans."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    global _deferring
    fast = _fast_module()
    building: Callable[[Any], Any] = (lambda exporter: exporter) if fast is None else fast.Building
    provider = TracerProvider(**options)
    queue: dict[str, Any] = {name: size for variable, name, size in _QUEUE if variable not in os.environ}
    for exporter in batched:
        provider.add_span_processor(BatchSpanProcessor(building(exporter), **queue))
    for exporter in immediate:
        provider.add_span_processor(SimpleSpanProcessor(building(exporter)))
    if fast is not None:
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
    api = _loaded_api()
    if api is None:
        return
    provider = _provider if _provider is not None else api.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        force_flush()


# -- the producer ----------------------------------------------------------------


def _current_traceparent() -> str | None:
    api = _loaded_api()
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
    return value if isinstance(value, str) and TRACEPARENT_PATTERN.fullmatch(value) else None


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


def parent_traceparent(headers: Mapping[str, Any], parsed: Envelope | Rejection) -> str | None:
    """The producer's context of a delivery: its ``traceparent`` header, else
    the envelope's ``meta.traceparent`` (which survives any copy of the body)."""
    value = header(headers, TRACEPARENT)
    if value is not None and TRACEPARENT_PATTERN.fullmatch(value):
        return value
    meta = parsed.meta if isinstance(parsed, Envelope) else None
    value = meta.get(TRACEPARENT) if meta is not None else None
    return value if isinstance(value, str) and TRACEPARENT_PATTERN.fullmatch(value) else None


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
    previous = getattr(local, "batch", None)
    if previous is not None:
        previous.end(abandoned=True)
    if tracer is None:
        return NO_BATCH
    api, sdk, number = _loaded_api(), local.sdk, None if partition is None else partition.partition
    current: Batch
    if sdk is not None and sdk.enabled():
        current = local.fast.SdkBatch(api, tracer, sdk, consumer, number, _links_only)
    else:
        current = Batch(api, tracer, consumer, number, _links_only)
    local.batch = current
    return current


def mark_commit() -> None:
    """The current batch's transaction is about to commit."""
    current = getattr(local, "batch", None)
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
    current = getattr(local, "batch", None)
    if current is None:
        return _NO_CALL
    api = _loaded_api()
    parent = current.parent_of(env.event_id)
    span = current.tracer.start_span(f"{step} {env.type}", context=api.set_span_in_context(parent),
                                     kind=api.SpanKind.CLIENT, attributes={"delivery_consumer.fence_key": key})
    return _Call(span, api.use_span(span, end_on_exit=True))


__all__ = [
    "EVENTS_ENV",
    "FAST_ENV",
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
    "fast_path",
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
