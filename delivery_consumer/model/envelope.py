"""Bytes -> envelope: content encoding, size limit, JSON decoding, schema validation, fingerprint.

The only place that knows how an event looks on the wire (with
``event_types.py``, where the declared types are compiled into the checks
:func:`from_mapping` applies, and where :class:`Envelope`, the schema file
and the field checks those need are defined: this module imports that one,
never the other way). Every refusal is a
:class:`~delivery_consumer.model.errors.Rejection` whose reason never quotes the
payload (only field names and rules), so it is safe to log and to put in AMQP
headers.

Schema validator: ``fastjsonschema``, each declared type's envelope schema
compiled to Python code (``event_types.py``), behind a quick check generated
for the type. ``bench/bench_validate.py`` compares it with ``jsonschema``
on the same envelopes; see docs/performance.md for the figures.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from typing import Any, Final, NoReturn

import orjson

from .errors import (
    INVALID_ENVELOPE,
    MALFORMED_JSON,
    Rejection,
    safe_reason,
)
from .event_types import (
    _CANONICAL,
    Envelope,
    EventTypes,
    _event_id_of,
    default_types,
    is_event_id,
    is_rfc3339,
    load_schema,
    schema_dir,
)

#: Default limit on the size of one body, in bytes (1 MiB).
MAX_BODY_BYTES: Final = 1 << 20

#: ``content_encoding`` values that mean "the bytes as they are" (kombu writes
#: the charset there: ``utf-8``, or ``binary`` for bytes it did not serialize).
IDENTITY_ENCODINGS: Final = frozenset({"", "identity", "utf-8", "utf8", "binary", "us-ascii", "ascii"})
#: Compressions a body may arrive in -> zlib ``wbits`` to try, in order:
#: 47 reads a gzip or a zlib stream (producers label either "gzip"), -15 a
#: raw deflate stream (what some send as "deflate").
_COMPRESSIONS: Final = {"gzip": (47,), "x-gzip": (47,), "deflate": (47, -15)}
#: kombu's ``compression="gzip"`` keeps ``content_encoding`` for the charset
#: and names the compression in this header instead (zlib stream).
KOMBU_COMPRESSION_HEADER: Final = "compression"
_KOMBU_COMPRESSIONS: Final = {"application/x-gzip": "gzip"}
_GZIP_MAGIC: Final = b"\x1f\x8b"
_BACKSLASH: Final = ord("\\")

def canonical_bytes(obj: Any) -> bytes:
    """The canonical JSON of *obj*: keys sorted, no whitespace, UTF-8."""
    return orjson.dumps(obj, option=_CANONICAL)


def fingerprint(obj: Any) -> str:
    """Lowercase hex SHA-256 of the canonical JSON of *obj*."""
    return hashlib.sha256(canonical_bytes(obj)).hexdigest()


def too_large(size: int, limit: int) -> Rejection:
    """The rejection of a body of *size* bytes over the size *limit*."""
    return Rejection(INVALID_ENVELOPE, f"body is {size} bytes, over the limit of {limit}")


def decode_body(
    body: bytes, content_encoding: str | None, *, compression: object = None, max_bytes: int = MAX_BODY_BYTES
) -> bytes:
    """The JSON bytes of a delivery whose ``content_encoding`` property (or
    kombu's ``compression`` header) says how it was compressed.

    gzip and deflate are decompressed in a stream that never produces more
    than ``max_bytes + 1`` bytes: the limit applies to the decompressed size,
    and a small bomb is refused (``invalid-envelope``) without ever being
    inflated. Any other encoding is refused (``malformed-json``) with a
    reason naming it.
    """
    codings = [token.strip() for token in (content_encoding or "").lower().replace(":", ",").split(",")]
    codings = [token for token in codings if token not in IDENTITY_ENCODINGS]
    if compression is not None:  # an AMQP header: any type
        kombu = _KOMBU_COMPRESSIONS.get(compression.strip().lower()) if isinstance(compression, str) else None
        if kombu is None:
            raise Rejection(MALFORMED_JSON, f"compression {safe_reason(str(compression), 40)!r} is not "
                                            "supported (application/x-gzip is)")
        codings.append(kombu)
    if not codings:
        if len(body) > max_bytes:
            raise too_large(len(body), max_bytes)
        return body
    if len(codings) > 1 or codings[0] not in _COMPRESSIONS:
        named = safe_reason(content_encoding or "", 40)
        raise Rejection(MALFORMED_JSON, f"content-encoding {named!r} is not supported (gzip, deflate or none)")
    coding = codings[0]
    first_error: zlib.error | None = None
    for wbits in _COMPRESSIONS[coding]:
        try:
            return _inflate(body, wbits, max_bytes, coding)
        except zlib.error as exc:
            first_error = first_error or exc
    raise Rejection(MALFORMED_JSON, f"body is not valid {coding} data ({first_error})")


def _inflate(body: bytes, wbits: int, limit: int, coding: str) -> bytes:
    """Decompress every member of *body* (gzip allows several), producing at
    most ``limit + 1`` bytes in all; zlib.error when it is not *wbits* data."""
    parts: list[bytes] = []
    size = 0
    rest = body
    while True:
        stream = zlib.decompressobj(wbits)
        part = stream.decompress(rest, limit + 1 - size)  # > 0: size <= limit here
        size += len(part)
        if size > limit:
            raise Rejection(INVALID_ENVELOPE, f"body decompresses ({coding}) to more than the limit of {limit} bytes")
        if not stream.eof:
            raise zlib.error("the compressed stream is cut short")
        parts.append(part)
        rest = stream.unused_data
        if not rest:
            return b"".join(parts)


def _refuse(body: bytes) -> NoReturn:
    """The rejection of a body orjson refused, naming the exact problem."""
    import json  # not at the top: start-up time counts (bench/bench_replay.py)

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if body.startswith(_GZIP_MAGIC):
            raise Rejection(MALFORMED_JSON, "body is not UTF-8: it looks gzip-compressed, but no "
                                            "content-encoding says so") from None
        raise Rejection(MALFORMED_JSON, f"body is not UTF-8 (byte {exc.start})") from None

    if text.startswith("\ufeff"):
        raise Rejection(MALFORMED_JSON, "body starts with a UTF-8 byte order mark (BOM): "
                                        "send the JSON without it")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        if isinstance(exc, json.JSONDecodeError):
            reason = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
        elif isinstance(exc, RecursionError):
            reason = "nesting too deep"
        raise Rejection(MALFORMED_JSON, f"body is not JSON: {reason}") from None
    # Valid JSON that has no faithful representation (a lone surrogate in a
    # string, a number that overflows a double, nesting past orjson's limit).
    raise Rejection(INVALID_ENVELOPE, "a value cannot be represented (lone surrogate, overflow or nesting)")


def refuse_duplicate_keys(body: bytes, canonical: bytes | None, obj: Mapping[str, Any]) -> None:
    """Raise ``malformed-json`` naming a key that appears twice in one object of *body*.

    orjson keeps the last of two equal keys, so *obj* (what it parsed) and
    *canonical* (that written back) may have lost pairs of *body*. A cheap
    count proves the usual body free of duplicates: every ``:`` of *canonical*
    is a key's or a string's, and each one stands for a ``:`` byte or a
    ``\\u003a`` escape of *body*, which has one more of these for every pair
    the parse dropped (and never fewer). Only when the counts differ (or no
    *canonical*) is *body* parsed again, by the standard library, with every
    pair kept (docs/failures.md, "Duplicate keys").
    """
    if canonical is not None:
        if body == canonical:  # what the toolkit's producers send: one memcmp
            return
        colons = body.count(b":")
        # No escape at all, the usual case: one memchr. (The byte as an int:
        # bytes' ``in`` tries a bytes operand as an int first, a TypeError each time.)
        if _BACKSLASH in body:
            colons += body.count(b"\\u003a") + body.count(b"\\u003A")
        if colons == canonical.count(b":"):
            return
    import json  # not at the top: start-up time counts (bench/bench_replay.py)

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        kept = dict(pairs)
        if len(kept) == len(pairs):
            return kept
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise Rejection(MALFORMED_JSON, f'duplicate key "{safe_reason(key, 40)}"',
                                event_id=None if key == "eventId" else _event_id_of(obj))
            seen.add(key)
        raise AssertionError("unreachable")

    try:
        json.loads(body, object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError):  # what orjson parsed, but too deep for this parser
        raise Rejection(MALFORMED_JSON, "body nested too deep to check it for duplicate keys") from None


def parse(
    body: bytes,
    *,
    max_bytes: int = MAX_BODY_BYTES,
    content_encoding: str | None = None,
    compression: object = None,
    types: EventTypes | None = None,
) -> Envelope:
    """Validate one body and return its :class:`Envelope`, or raise Rejection.

    *content_encoding* and *compression* are a delivery's property and
    kombu's header of that name (see :func:`decode_body`). *types*: the
    declared event types to accept (default: ``event_types.default_types()``).
    """
    if content_encoding is not None or compression is not None:
        body = decode_body(body, content_encoding, compression=compression, max_bytes=max_bytes)
    elif len(body) > max_bytes:
        raise too_large(len(body), max_bytes)
    return envelope_of(body, decoded(body), default_types() if types is None else types)


def decoded(body: bytes) -> Any:
    """The JSON value of *body* (orjson's), or the rejection naming what is wrong with it."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        _refuse(body)


def envelope_of(body: bytes, obj: Any, types: EventTypes) -> Envelope:
    """The :class:`Envelope` of *body*, whose JSON value is *obj*
    (:func:`decoded`), validated against *types*; or raise Rejection.

    :func:`parse` after the size limit and the content encoding, for a
    caller that already decoded the body (``cloudevents.parse_body``).
    """
    if not isinstance(obj, dict):
        raise Rejection(MALFORMED_JSON, f"body is JSON but not an object ({type(obj).__name__})")
    try:
        env = types.from_mapping(obj)
    except Rejection:
        refuse_duplicate_keys(body, None, obj)  # a duplicate is the first thing wrong with a body
        raise
    refuse_duplicate_keys(body, env.canonical, obj)
    return env


def from_mapping(obj: Mapping[str, Any], types: EventTypes | None = None) -> Envelope:
    """Validate an already decoded envelope (a dict) and return its Envelope
    (*types*: as for :func:`parse`)."""
    return (default_types() if types is None else types).from_mapping(obj)


def body_digest(body: bytes) -> str:
    """SHA-256 of the raw bytes, to identify a body that has no fingerprint."""
    return hashlib.sha256(body).hexdigest()


__all__ = [
    "IDENTITY_ENCODINGS",
    "KOMBU_COMPRESSION_HEADER",
    "MAX_BODY_BYTES",
    "Envelope",
    "body_digest",
    "canonical_bytes",
    "decode_body",
    "decoded",
    "envelope_of",
    "fingerprint",
    "from_mapping",
    "is_event_id",
    "is_rfc3339",
    "load_schema",
    "parse",
    "refuse_duplicate_keys",
    "safe_reason",
    "schema_dir",
    "too_large",
]
