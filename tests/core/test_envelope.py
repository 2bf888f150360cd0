"""The envelope contract: fingerprint, schema edge cases, rejection codes."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import unicodedata
from typing import Any

import orjson
import pytest
from support import EVENT_ID, TITLE, URL, WITHDRAWN, body, make_envelope

from delivery_consumer.model import envelope
from delivery_consumer.model.errors import (
    INVALID_ENVELOPE,
    MALFORMED_JSON,
    MAX_REASON_CHARS,
    UNKNOWN_TYPE,
    Rejection,
)


def rejection(raw: bytes, **kwargs: Any) -> Rejection:
    """The Rejection that parsing *raw* raises (fails the test if it parses)."""
    with pytest.raises(Rejection) as info:
        envelope.parse(raw, **kwargs)
    return info.value


def with_field(**changes: Any) -> dict[str, Any]:
    """The lesson's envelope with top-level fields replaced (``...`` deletes)."""
    env = make_envelope()
    for key, value in changes.items():
        if value is ...:
            del env[key]
        else:
            env[key] = value
    return env


# -- fingerprint ---------------------------------------------------------------


def test_fingerprint_is_sha256_of_orjson_sorted_keys() -> None:
    """The fingerprint is exactly sha256(orjson.dumps(env, OPT_SORT_KEYS)), lowercase hex."""
    env = make_envelope()
    expected = hashlib.sha256(orjson.dumps(env, option=orjson.OPT_SORT_KEYS)).hexdigest()

    assert expected == envelope.fingerprint(env)
    assert expected == envelope.parse(body(env)).fingerprint
    assert expected == expected.lower() and 64 == len(expected)


def test_canonical_bytes_of_the_lesson_example() -> None:
    """Canonical JSON: keys sorted at every level, no whitespace, raw UTF-8 (no \\u escapes)."""
    expected = (
        '{"articleId":"article-42","data":{"title":"Доставка без потерь","url":"https://example.org/a/42"},'
        '"eventId":"0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11","occurredAt":"2026-11-29T10:00:00Z",'
        '"revision":1,"type":"material.published"}'
    ).encode()

    parsed = envelope.parse(body(make_envelope()))

    assert expected == parsed.canonical
    assert expected == envelope.canonical_bytes(make_envelope())
    assert hashlib.sha256(expected).hexdigest() == parsed.fingerprint


def test_fingerprint_ignores_key_order_and_whitespace() -> None:
    """Reordered keys (also inside data) and other indentation give the same fingerprint."""
    env = make_envelope()
    reordered = {k: env[k] for k in reversed(list(env))}
    reordered["data"] = {"url": URL, "title": TITLE}
    pretty = json.dumps(reordered, ensure_ascii=False, indent=4).encode()

    assert envelope.parse(body(env)).fingerprint == envelope.parse(pretty).fingerprint


def test_fingerprint_ignores_json_escapes() -> None:
    """A title written with \\u escapes is the same string, hence the same fingerprint."""
    ascii_body = json.dumps(make_envelope(), ensure_ascii=True).encode()

    assert envelope.parse(body(make_envelope())).fingerprint == envelope.parse(ascii_body).fingerprint


@pytest.mark.parametrize(
    "change",
    [
        {"eventId": "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c12"},
        {"type": WITHDRAWN},
        {"articleId": "article-43"},
        {"revision": 2},
        {"occurredAt": "2026-11-29T10:00:00+00:00"},  # the same instant, another spelling
        {"data": {"title": TITLE + ".", "url": URL}},
        {"data": {"title": TITLE, "url": URL + "/"}},
        {"data": {"title": TITLE, "url": URL, "lang": "ru"}},
    ],
    ids=lambda change: "-".join(change),
)
def test_any_changed_value_changes_fingerprint(change: dict[str, Any]) -> None:
    """Changing any value (or adding a data field) gives another fingerprint."""
    original = make_envelope()
    changed = {**copy.deepcopy(original), **change}

    assert envelope.parse(body(original)).fingerprint != envelope.parse(body(changed)).fingerprint


def test_no_unicode_normalisation() -> None:
    """NFC and NFD spellings of one title are both accepted and are different facts."""
    title = "Доставка без потерь: й и café"
    nfc = make_envelope(title=unicodedata.normalize("NFC", title))
    nfd = make_envelope(title=unicodedata.normalize("NFD", title))
    assert nfc["data"]["title"] != nfd["data"]["title"]

    parsed_nfc, parsed_nfd = envelope.parse(body(nfc)), envelope.parse(body(nfd))

    assert parsed_nfc.fingerprint != parsed_nfd.fingerprint
    assert unicodedata.normalize("NFD", title) == parsed_nfd.data["title"]


def test_parse_and_from_mapping_agree() -> None:
    """parse(bytes) and from_mapping(dict) give the same Envelope fields."""
    env = make_envelope(type=WITHDRAWN, revision=7)

    parsed = envelope.parse(body(env))
    mapped = envelope.from_mapping(env)

    assert (EVENT_ID, WITHDRAWN, "article-42", 7, TITLE, URL) == (
        parsed.event_id, parsed.type, parsed.key, parsed.revision, parsed.data["title"], parsed.data["url"]
    )
    assert (parsed.canonical, parsed.fingerprint) == (mapped.canonical, mapped.fingerprint)


# -- schema edge cases -----------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"articleId": "a"},
        {"articleId": "a" * 256},
        {"articleId": "ж" * 256},  # the bound counts characters, not UTF-8 bytes
        {"articleId": "a b\x7f\x85\u2028"},  # DEL, C1 and Unicode separators are not C0 controls
        {"revision": 1},
        {"revision": 2**63 - 1},
        {"occurredAt": "2026-11-29T13:00:00+03:00"},
        {"occurredAt": "2026-11-29T04:30:00-05:30"},
        {"occurredAt": "2026-11-29T10:00:00.5Z"},
        {"occurredAt": "2026-11-29T10:00:00.123456789Z"},  # nanoseconds: more than datetime holds
        {"occurredAt": "2016-12-31T23:59:60Z"},  # a real leap second
        {"occurredAt": "2026-11-29t10:00:00z"},  # RFC 3339 allows lowercase t and z
        {"data": {"title": TITLE, "url": URL, "lang": "ru", "tags": ["sqlite"]}},
        {"data": {"title": TITLE, "url": ""}},
        {"data": {"title": "x" * 4096, "url": URL}},
    ],
    ids=lambda changes: repr(changes)[:60],
)
def test_accepted_edge_cases(changes: dict[str, Any]) -> None:
    """Values at the edges of the contract are accepted as they are."""
    env = with_field(**changes)

    parsed = envelope.parse(body(env))

    assert env["revision"] == parsed.revision and type(parsed.revision) is int
    assert env["occurredAt"] == parsed.occurred_at
    assert env["articleId"] == parsed.key


@pytest.mark.parametrize(
    "changes",
    [
        {"articleId": ""},
        {"articleId": "a" * 257},
        {"articleId": 42},
        {"revision": 0},
        {"revision": -1},
        {"revision": 2**63},
        {"revision": 1.0},
        {"revision": 1.5},
        {"revision": True},
        {"revision": "1"},
        {"revision": None},
        {"occurredAt": "2026-02-30T10:00:00Z"},
        {"occurredAt": "2026-11-29T24:00:01Z"},
        {"occurredAt": "2026-11-29T10:00:00"},  # no offset
        {"occurredAt": "2026-11-29 10:00:00Z"},
        {"occurredAt": "2026-11-29T10:00:00+3:00"},
        {"occurredAt": "2026-11-29T10:00:00+00:75"},  # an offset's minutes are 00-59
        {"occurredAt": "2026-11-29T10:00:61Z"},
        {"occurredAt": "2026-W48-1T10:00:00Z"},  # an ISO week date datetime would take
        {"occurredAt": "29.11.2026 10:00"},
        {"occurredAt": 1764410400},
        {"eventId": EVENT_ID.upper()},
        {"eventId": EVENT_ID.replace("-", "")},
        {"eventId": "{" + EVENT_ID + "}"},
        {"eventId": EVENT_ID[:-1]},
        {"eventId": "urn:uuid:" + EVENT_ID},
        {"type": 5},
        {"data": {"title": "", "url": URL}},
        {"data": {"title": "x" * 4097, "url": URL}},
        {"data": {"url": URL}},
        {"data": {"title": TITLE}},
        {"data": {"title": TITLE, "url": None}},
        {"data": [TITLE, URL]},
        {"source": "cms"},  # the top level is closed
        {"revison": 2},  # a typo is not silently ignored
        {"eventId": ...},
        {"type": ...},
        {"articleId": ...},
        {"revision": ...},
        {"occurredAt": ...},
        {"data": ...},
    ],
    ids=lambda changes: repr(changes)[:60],
)
def test_refused_edge_cases(changes: dict[str, Any]) -> None:
    """Values outside the contract are rejected invalid-envelope."""
    assert INVALID_ENVELOPE == rejection(body(with_field(**changes))).code


@pytest.mark.parametrize("article_id", ["a\x00b", "\x00", "article-42\n", "a\tb", "\x1f", "a\rb"])
def test_a_control_character_in_article_id_is_refused(article_id: str) -> None:
    """A NUL or any other C0 control character in articleId is invalid-envelope, saying so (never quoting it)."""
    refused = rejection(body(with_field(articleId=article_id)))

    assert INVALID_ENVELOPE == refused.code
    assert "articleId must not contain control characters (U+0000 to U+001F)" == refused.reason
    assert EVENT_ID == refused.event_id


def test_a_byte_order_mark_on_the_wire_is_named() -> None:
    """A body that starts with a UTF-8 BOM is malformed-json, saying so in plain words."""
    refused = rejection(b"\xef\xbb\xbf" + body(make_envelope()))

    assert ("malformed-json", "body starts with a UTF-8 byte order mark (BOM): send the JSON without it") == (
        refused.code, refused.reason)


def test_missing_field_is_named_in_reason() -> None:
    """A missing field is named in the reason, so the producer can fix it."""
    reason = rejection(body(with_field(occurredAt=...))).reason

    assert "occurredAt" in reason


def test_invalid_event_id_is_not_reported_as_the_event_id() -> None:
    """A rejection carries the eventId only when it is a valid UUID, the fingerprint when JSON parsed."""
    env = make_envelope(revision=0)
    refused = rejection(body(env))
    assert (EVENT_ID, envelope.fingerprint(env)) == (refused.event_id, refused.fingerprint)

    bad_id = rejection(body(make_envelope(event_id=EVENT_ID.upper())))
    assert bad_id.event_id is None and bad_id.fingerprint is not None

    not_json = rejection(b"{")
    assert (None, None) == (not_json.event_id, not_json.fingerprint)


# -- rejection codes with realistic input ------------------------------------------

_VALID = body(make_envelope())


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", MALFORMED_JSON),
        (_VALID[:-1], MALFORMED_JSON),  # cut short in transit
        (b"eventId=0b1e9c1e&type=material.published", MALFORMED_JSON),
        (json.dumps(make_envelope(), ensure_ascii=False).encode("cp1251"), MALFORMED_JSON),  # not UTF-8
        (json.dumps(make_envelope(), ensure_ascii=False).encode("utf-16"), MALFORMED_JSON),
        (b"[" + _VALID + b"]", MALFORMED_JSON),  # an array, not an object
        (b'"' + _VALID.replace(b'"', b'\\"') + b'"', MALFORMED_JSON),  # JSON-in-a-string
        (b"null", MALFORMED_JSON),
        (_VALID + _VALID, MALFORMED_JSON),  # two envelopes in one body
        (_VALID.replace(b'"revision":1', b'"revision":NaN'), MALFORMED_JSON),
        (_VALID.replace(b'"revision":1', b'"revision":Infinity'), MALFORMED_JSON),
        (body(make_envelope(type="material.deleted")), UNKNOWN_TYPE),
        (body(make_envelope(type="Material.Published")), UNKNOWN_TYPE),
        (body(make_envelope(type="")), UNKNOWN_TYPE),
        (body(make_envelope(revision=0)), INVALID_ENVELOPE),
        (body({}), INVALID_ENVELOPE),
        (_VALID.replace(b'"revision":1', b'"revision":1e400'), INVALID_ENVELOPE),  # overflows a double
        (_VALID.replace("Доставка".encode(), b"\\ud800"), INVALID_ENVELOPE),  # a lone surrogate
    ],
    ids=[
        "empty", "truncated", "form-encoded", "cp1251", "utf-16", "array", "json-string", "null",
        "two-objects", "NaN", "Infinity", "unknown-type", "type-case", "type-empty", "revision-0",
        "empty-object", "overflow", "lone-surrogate",
    ],
)
def test_rejection_codes(raw: bytes, code: str) -> None:
    """Each kind of broken body is rejected with its documented code."""
    assert code == rejection(raw).code


def test_body_over_the_limit_is_rejected_before_decoding() -> None:
    """A body over 1 MiB is invalid-envelope, even when it is not JSON at all."""
    refused = rejection(b"x" * (envelope.MAX_BODY_BYTES + 1))

    assert INVALID_ENVELOPE == refused.code
    assert str(envelope.MAX_BODY_BYTES) in refused.reason


def test_body_exactly_at_the_limit_is_accepted() -> None:
    """The limit is inclusive: a valid body of exactly 1 MiB parses, one byte more does not."""
    env = make_envelope()
    env["data"]["padding"] = ""
    env["data"]["padding"] = "p" * (envelope.MAX_BODY_BYTES - len(body(env)))
    raw = body(env)
    assert envelope.MAX_BODY_BYTES == len(raw)

    assert EVENT_ID == envelope.parse(raw).event_id
    assert INVALID_ENVELOPE == rejection(raw + b" ").code


def test_max_bytes_is_configurable() -> None:
    """parse(max_bytes=N) refuses a body over N bytes."""
    assert INVALID_ENVELOPE == rejection(_VALID, max_bytes=len(_VALID) - 1).code
    assert EVENT_ID == envelope.parse(_VALID, max_bytes=len(_VALID)).event_id


SECRET = "s3cr3t-Пароль-do-not-log"


@pytest.mark.parametrize(
    "raw",
    [
        body(make_envelope(title=SECRET, revision=0)),
        body(make_envelope(title=SECRET * 200)),
        body(make_envelope(url=SECRET, revision="1")),
        body(make_envelope(article_id=SECRET * 20)),
        body(make_envelope(title=SECRET, type="material.deleted")),
        body(make_envelope(event_id=SECRET)),
        body(make_envelope(occurred_at=SECRET)),
        body(make_envelope(revision=SECRET)),
        body({**make_envelope(), "data": SECRET}),
        body({**make_envelope(), "extra": SECRET}),
        body({"data": {"title": SECRET}}),
        body([SECRET]),
        body(SECRET),
        json.dumps(make_envelope(title=SECRET), ensure_ascii=False).encode("cp1251"),
        body(make_envelope(title=SECRET))[:-3],
        body(make_envelope(title=SECRET)).replace(b'"revision":1', b'"revision":NaN'),
        body(make_envelope(title=SECRET)).replace(b'"revision":1', b'"revision":1e999'),
        body(make_envelope(title=SECRET, padding="x" * envelope.MAX_BODY_BYTES)),
    ],
    ids=lambda raw: str(len(raw)),
)
def test_reason_never_quotes_payload_values(raw: bytes) -> None:
    """The reason of a rejection never contains a value from the payload, and is one short line."""
    refused = rejection(raw)

    assert SECRET[:6] not in refused.reason
    assert "Пароль" not in refused.reason
    assert len(refused.reason) <= MAX_REASON_CHARS
    assert refused.reason.isprintable()


def test_unknown_type_reason_is_bounded_and_printable() -> None:
    """The unknown type is named in the reason, cut short and with control characters escaped."""
    refused = rejection(body(make_envelope(type="material.\nevil\x1b[31m" + "x" * 500)))

    assert UNKNOWN_TYPE == refused.code
    assert refused.reason.isprintable()
    assert len(refused.reason) <= MAX_REASON_CHARS


def test_the_material_names_of_an_envelope_are_deprecated_aliases_of_the_generic_ones() -> None:
    """``article_id``, ``title`` and ``url`` still answer, each with a DeprecationWarning naming what to
    use (``key``, ``data[...]``) at the caller's line; ``key`` and ``data`` warn nothing."""
    import warnings

    env = envelope.parse(body(make_envelope()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generic = (env.key, env.data["title"], env.data["url"])
    for name, instead in (("article_id", "Envelope.key"), ("title", 'Envelope.data["title"]'),
                          ("url", 'Envelope.data["url"]')):
        with pytest.warns(DeprecationWarning, match=re.escape(instead)) as caught:
            getattr(env, name)
        assert __file__ == caught[0].filename
    with pytest.warns(DeprecationWarning):
        assert generic == (env.article_id, env.title, env.url)
