"""CloudEvents 1.0 in: a CloudEvent received over AMQP -> the envelope it maps to.

Producers that are not ours speak CloudEvents (its SDKs, most event
platforms). Both content modes of the AMQP protocol binding are read:

* structured: ``content-type: application/cloudevents+json``, the whole
  event in the body;
* binary: the attributes in headers (``cloudEvents:`` as the binding
  spells it, ``cloudEvents_`` as the SDKs write it for JMS, ``ce-`` as the
  RabbitMQ binding of the SDK writes it), ``data`` in the body and
  ``datacontenttype`` in the ``content-type`` property.

The mapping (the contract; docs/envelope.md): ``type`` -> ``type``,
``subject`` -> the type's key, ``time`` -> ``occurredAt`` (in UTC, to the
millisecond: the one spelling both modes can carry), the extension
``revision`` -> ``revision``, ``data`` -> ``data``, the extensions
``correlationid``, ``causationid``, ``traceparent`` -> ``meta``; ``id`` ->
``eventId`` when it is a canonical UUID, else the UUID version 5 of
``source + "\\n" + id`` in the URL namespace (:func:`event_id_for`). The
event is then validated and fingerprinted as the envelope it maps to, and
carries its source and id (``Envelope.cloudevent``) and, where the previous
release spelled ``time`` otherwise, that release's fingerprint
(``Envelope.earlier_fingerprints``).

Pure functions: no broker, no SDK; the type's shape comes from a lookup.
:func:`parse_message` is the one parse path of a message (``run``, dead
letters, ``reroute``, ``replay``): a CloudEvent is mapped, anything else is
an envelope; both end in the declared types' ``from_mapping``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final, NamedTuple, Protocol

import orjson

from .envelope import (
    MAX_BODY_BYTES,
    Envelope,
    decode_body,
    decoded,
    envelope_of,
    fingerprint,
    is_event_id,
    is_rfc3339,
    parse,
    refuse_duplicate_keys,
    too_large,
)
from .errors import INVALID_ENVELOPE, MALFORMED_JSON, UNKNOWN_TYPE, Rejection, safe_reason
from .event_types import CloudEventId, EventTypes, default_types

#: ``content-type`` of an event in structured mode (JSON event format).
STRUCTURED_CONTENT_TYPE: Final = "application/cloudevents+json"
_BATCH_CONTENT_TYPE: Final = "application/cloudevents-batch+json"
#: Header prefixes of binary mode: the AMQP binding's, the SDKs' JMS spelling, the RabbitMQ binding's.
HEADER_PREFIXES: Final = ("cloudEvents:", "cloudEvents_", "ce-")
_JSON_MEDIA = re.compile(r"(application|text)/([a-z0-9.\-]+\+)?json", re.IGNORECASE)
_REVISION_TEXT = re.compile(r"[1-9][0-9]{0,18}")
#: Extension attributes kept in the envelope's ``meta`` (CloudEvents names are lowercase).
META_EXTENSIONS: Final = {"correlationid": "correlationId", "causationid": "causationId", "traceparent": "traceparent"}
_SPECVERSION: Final = "1.0"
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_FRACTION = re.compile(r"\.([0-9]+)")


class TypeShape(Protocol):
    """What the mapping needs to know of a declared event type (an
    :class:`~delivery_consumer.model.event_types.EventType` is one)."""

    @property
    def key(self) -> str:
        """The envelope field that names the entity (``orderId``)."""

    @property
    def revision(self) -> bool:
        """Whether the type's envelopes carry a ``revision``."""


#: Finds a declared type by name; None when no consumer declares it.
TypeLookup = Callable[[str], TypeShape | None]


def event_id_for(source: str, event_id: str) -> str:
    """The eventId a CloudEvent's ``id`` maps to (stable, and distinct across sources)."""
    if is_event_id(event_id):
        return event_id
    import uuid  # not at the top: start-up time counts (bench/bench_replay.py), and most ids are UUIDs

    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{source}\n{event_id}"))


def media_type(content_type: str | None) -> str:
    """``content_type`` without parameters, lowercase ('' when absent)."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def binary_attributes(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The CloudEvents attributes carried in *headers* (binary mode), by attribute name."""
    found: dict[str, Any] = {}
    for name, value in (headers or {}).items():
        for prefix in HEADER_PREFIXES:
            if name[: len(prefix)].lower() == prefix.lower():
                found[name[len(prefix):].lower()] = value
                break
    return found


_SPECVERSION_HEADERS: Final = frozenset(f"{prefix}specversion".lower() for prefix in HEADER_PREFIXES)


def is_cloudevent(content_type: str | None, headers: Mapping[str, Any] | None) -> bool:
    """Whether a message is a CloudEvent in either mode (cheap: looks at properties only)."""
    # On every delivery: a substring test, then one lowercase per header (no loop over the prefixes).
    if content_type and "cloudevents" in content_type.lower() \
            and media_type(content_type) in (STRUCTURED_CONTENT_TYPE, _BATCH_CONTENT_TYPE):
        return True
    if headers:
        for name in headers:
            if len(name) <= 23 and name.lower() in _SPECVERSION_HEADERS:
                return True
    return False


def looks_structured(obj: Mapping[str, Any]) -> bool:
    """Whether a decoded JSON object is a structured CloudEvent (it has ``specversion``).

    No envelope has that field, so for a body read without properties
    (``replay`` of files) this tells the two apart unambiguously.
    """
    return "specversion" in obj


class _Mapped(NamedTuple):
    """A CloudEvent mapped: the envelope (not yet validated), its source and id, and
    the spelling of ``time`` the previous release gave it where that differs."""

    envelope: dict[str, Any]
    origin: CloudEventId
    earlier_time: str | None


def from_message(
    body: bytes, content_type: str | None, headers: Mapping[str, Any] | None, types: TypeLookup,
) -> dict[str, Any]:
    """The envelope (a mapping, not yet validated) of a CloudEvent message, or raise Rejection.

    *body* is already decoded (content-encoding undone). Validate the result
    with :func:`delivery_consumer.model.envelope.from_mapping`.
    """
    return _from_message(body, content_type, headers, types).envelope


def _from_message(body: bytes, content_type: str | None, headers: Mapping[str, Any] | None,
                  types: TypeLookup) -> _Mapped:
    media = media_type(content_type)
    if media == _BATCH_CONTENT_TYPE:
        raise Rejection(INVALID_ENVELOPE, "CloudEvents batches are not accepted: publish one event per message")
    if media == STRUCTURED_CONTENT_TYPE:
        return _from_structured(_load(body, "the structured CloudEvent"), types)
    attributes = binary_attributes(headers)
    datacontenttype = content_type or "application/json"
    _require_json(datacontenttype, attributes)
    attributes["data"] = _load(body, "the CloudEvent's data")
    return _map(attributes, types, structured=False)


def from_structured(event: Mapping[str, Any], types: TypeLookup) -> dict[str, Any]:
    """The envelope of a structured CloudEvent already decoded from JSON."""
    return _from_structured(event, types).envelope


def _from_structured(event: Mapping[str, Any], types: TypeLookup) -> _Mapped:
    if not isinstance(event, Mapping):
        raise Rejection(MALFORMED_JSON, f"the structured CloudEvent is JSON but not an object ({type(event).__name__})")
    attributes = dict(event)
    if "data_base64" in attributes:
        raise Rejection(INVALID_ENVELOPE, "CloudEvent attribute data_base64: binary data is not accepted, only JSON",
                        event_id=_event_id_or_none(attributes), origin=_origin_or_none(attributes))
    _require_json(attributes.get("datacontenttype") or "application/json", attributes)
    return _map(attributes, types, structured=True)


def _map(attributes: Mapping[str, Any], types: TypeLookup, *, structured: bool) -> _Mapped:
    """The envelope of a CloudEvent's *attributes* (``data`` among them). In
    *structured* mode they are JSON values (``revision`` a JSON integer); in
    binary mode, headers (``revision`` may be a decimal string)."""
    specversion = attributes.get("specversion")
    event_id = _event_id_or_none(attributes)
    origin = _origin_or_none(attributes)
    if specversion != _SPECVERSION:
        what = "is missing" if specversion is None else f"{_shown(specversion)} is not supported (only 1.0)"
        raise Rejection(INVALID_ENVELOPE, f"CloudEvent attribute specversion {what}", event_id=event_id,
                        origin=origin)
    for required in ("id", "source", "type"):
        value = attributes.get(required)
        if not isinstance(value, str) or not value:
            raise Rejection(INVALID_ENVELOPE, f"CloudEvent attribute {required} is missing or not a string",
                            event_id=event_id, origin=origin)
    assert event_id is not None and origin is not None  # id and source are strings
    type_name = str(attributes["type"])
    shape = types(type_name)
    if shape is None:
        raise Rejection(UNKNOWN_TYPE, safe_reason(f"type {type_name!r} is not declared by this consumer"),
                        event_id=event_id, origin=origin)
    subject = attributes.get("subject")
    if not isinstance(subject, str) or not subject:
        raise Rejection(INVALID_ENVELOPE,
                        f"CloudEvent attribute subject is missing: it carries the {shape.key} of {type_name}",
                        event_id=event_id, origin=origin)
    occurred, earlier = _occurred_at(attributes.get("time"), event_id, origin)
    envelope: dict[str, Any] = {
        "eventId": event_id,
        "type": type_name,
        shape.key: subject,
        "occurredAt": occurred,
        "data": attributes.get("data"),
    }
    if shape.revision:
        envelope["revision"] = _revision(attributes.get("revision"), type_name, event_id, origin, structured)
    meta = {field: attributes[name] for name, field in META_EXTENSIONS.items() if attributes.get(name) is not None}
    if meta:
        envelope["meta"] = meta
    return _Mapped(envelope, origin, earlier if earlier != occurred else None)


def _validated(types: EventTypes, mapped: _Mapped) -> Envelope:
    """The Envelope of a mapped CloudEvent, validated, with its source and id and, when
    the previous release spelled its ``time`` otherwise, that release's fingerprint."""
    try:
        env = types.from_mapping(mapped.envelope)
    except Rejection as rej:
        rej.origin = rej.origin or mapped.origin
        raise
    earlier: tuple[str, ...] = ()
    if mapped.earlier_time is not None:
        before = {k: v for k, v in mapped.envelope.items() if k != "meta"}
        before["occurredAt"] = mapped.earlier_time
        earlier = (fingerprint(before),)
    return env._replace(cloudevent=mapped.origin, earlier_fingerprints=earlier)


def parse_message(
    body: bytes,
    *,
    content_type: str | None = None,
    headers: Mapping[str, Any] | None = None,
    content_encoding: str | None = None,
    compression: object = None,
    max_bytes: int = MAX_BODY_BYTES,
    types: EventTypes | None = None,
) -> Envelope:
    """A message's :class:`~delivery_consumer.model.envelope.Envelope`, or raise Rejection.

    A CloudEvent (by its properties: :func:`is_cloudevent`; or, for a body
    read without properties, a JSON object with ``specversion``) is mapped
    with the declared *types* and validated and fingerprinted as the
    envelope it maps to; any other body goes to
    :func:`delivery_consumer.model.envelope.parse`. *content_encoding*,
    *compression* and *max_bytes* apply to the body as there.
    """
    if types is None:
        types = default_types()
    if (content_type is not None or headers) and is_cloudevent(content_type, headers):
        if content_encoding is not None or compression is not None:
            body = decode_body(body, content_encoding, compression=compression, max_bytes=max_bytes)
        elif len(body) > max_bytes:
            raise too_large(len(body), max_bytes)
        return _validated(types, _from_message(body, content_type, headers, types.get))
    if content_encoding is None and compression is None:
        return parse_body(body, max_bytes, types)
    return parse(body, max_bytes=max_bytes, content_encoding=content_encoding, compression=compression, types=types)


def parse_body(body: bytes, max_bytes: int = MAX_BODY_BYTES, types: EventTypes | None = None) -> Envelope:
    """:func:`parse_message` of a body that has no properties (a line of a file): a structured
    CloudEvent when its JSON object has ``specversion`` (no envelope has that field), else an envelope."""
    if types is None:
        types = default_types()
    if len(body) > max_bytes:
        raise too_large(len(body), max_bytes)
    obj = decoded(body)
    if type(obj) is dict and "specversion" in obj:  # looks_structured, inline: once per event
        refuse_duplicate_keys(body, orjson.dumps(obj), obj)
        return _validated(types, _from_structured(obj, types.get))
    return envelope_of(body, obj, types)


def _origin_or_none(attributes: Mapping[str, Any]) -> CloudEventId | None:
    """The CloudEvent's source and id, when both are non-empty strings."""
    event_id, source = attributes.get("id"), attributes.get("source")
    if isinstance(event_id, str) and event_id and isinstance(source, str) and source:
        return CloudEventId(source, event_id)
    return None


def _event_id_or_none(attributes: Mapping[str, Any]) -> str | None:
    event_id, source = attributes.get("id"), attributes.get("source")
    if isinstance(event_id, str) and event_id and isinstance(source, str) and source:
        return event_id_for(source, event_id)
    return None


def _require_json(datacontenttype: object, attributes: Mapping[str, Any]) -> None:
    media = media_type(str(datacontenttype))
    if not _JSON_MEDIA.fullmatch(media):
        raise Rejection(INVALID_ENVELOPE,
                        safe_reason(f"CloudEvent attribute datacontenttype {media!r} is not JSON"),
                        event_id=_event_id_or_none(attributes), origin=_origin_or_none(attributes))


def utc_milliseconds(instant: datetime) -> str:
    """*instant* as ``YYYY-MM-DDTHH:MM:SS.mmmZ`` in UTC, cut (not rounded) to the
    millisecond: how a CloudEvent's ``time`` becomes ``occurredAt``."""
    utc = instant.astimezone(UTC)
    return (f"{utc.year:04d}-{utc.month:02d}-{utc.day:02d}T{utc.hour:02d}:{utc.minute:02d}:{utc.second:02d}"
            f".{utc.microsecond // 1000:03d}Z")


def _canonical_time(text: str) -> str | None:
    """An RFC 3339 *text* in UTC to the millisecond; None when it is not one
    (the envelope's check then refuses it by name) or names a leap second."""
    if not is_rfc3339(text) or text[17:19] == "60":
        return None
    digits = _FRACTION.sub(lambda m: "." + (m.group(1) + "000")[:6], text.upper(), count=1)
    try:
        return utc_milliseconds(datetime.fromisoformat(digits))
    except (ValueError, OverflowError):  # an offset that moves it out of datetime's years
        return None


def _occurred_at(time: object, event_id: str, origin: CloudEventId | None) -> tuple[str, str]:
    """``occurredAt`` of a CloudEvent's *time*, and the spelling the previous release
    gave it (it kept a string verbatim and wrote a whole-second timestamp without
    milliseconds): the same instant in both modes is one spelling now."""
    if isinstance(time, str) and time:
        return _canonical_time(time) or time, time
    if isinstance(time, datetime):  # an AMQP 0-9-1 timestamp header (whole seconds)
        instant = time if time.tzinfo is not None else time.replace(tzinfo=UTC)
        return utc_milliseconds(instant), instant.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(time, int) and not isinstance(time, bool) and 0 <= time < 253402300800000:
        # The AMQP 1.0 timestamp the SDKs write in binary mode: milliseconds since the epoch.
        spelled = utc_milliseconds(_EPOCH + timedelta(milliseconds=time))
        return spelled, spelled
    what = "is missing" if time is None else "is not a timestamp"
    raise Rejection(INVALID_ENVELOPE, f"CloudEvent attribute time {what} (it becomes occurredAt)", event_id=event_id,
                    origin=origin)


def _revision(value: object, type_name: str, event_id: str, origin: CloudEventId | None, structured: bool) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _REVISION_TEXT.fullmatch(value):
        if not structured:  # a header: the RabbitMQ binding writes every attribute as a string
            return int(value)
        raise Rejection(INVALID_ENVELOPE, "CloudEvent extension attribute revision must be a JSON integer in a "
                        f"structured event, not a string ({type_name} carries one)", event_id=event_id, origin=origin)
    what = "is missing" if value is None else "is not an integer"
    raise Rejection(INVALID_ENVELOPE, f"CloudEvent extension attribute revision {what} ({type_name} carries one)",
                    event_id=event_id, origin=origin)


def _load(body: bytes, what: str) -> Any:
    """The one place the mapping decodes JSON: orjson, then the envelope's duplicate-key refusal."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise Rejection(MALFORMED_JSON, f"{what} is not valid JSON") from None
    if isinstance(value, dict):
        refuse_duplicate_keys(body, orjson.dumps(value), value)
    elif b":" in body:  # objects inside an array or under a scalar's siblings: the exact check
        refuse_duplicate_keys(body, None, {})
    return value


def _shown(value: object) -> str:
    return safe_reason(repr(value), 40)


__all__ = [
    "HEADER_PREFIXES",
    "META_EXTENSIONS",
    "STRUCTURED_CONTENT_TYPE",
    "TypeLookup",
    "TypeShape",
    "binary_attributes",
    "event_id_for",
    "from_message",
    "from_structured",
    "is_cloudevent",
    "looks_structured",
    "media_type",
    "parse_body",
    "parse_message",
    "utc_milliseconds",
]
