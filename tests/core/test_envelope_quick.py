"""The quick acceptance path of envelope validation never accepts what fastjsonschema refuses,
for the material types and for declared types of other shapes."""

from __future__ import annotations

from functools import cache
from typing import Any

import fastjsonschema
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer.model import envelope
from delivery_consumer.model.errors import Rejection
from delivery_consumer.model.event_types import MATERIAL, EventType, EventTypes, quick_check

UUID = "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11"
VALID: dict[str, Any] = {
    "eventId": UUID,
    "type": "material.published",
    "articleId": "article-42",
    "revision": 1,
    "occurredAt": "2026-11-29T10:00:00Z",
    "data": {"title": "Доставка без потерь", "url": "https://example.org/a/42"},
}

# Each field: valid spellings and near misses (boundaries, wrong types,
# trailing newlines that a careless "$" would let through, Unicode).
EVENT_IDS = [UUID, UUID.upper(), UUID + "\n", UUID + " ", UUID[:-1], "", 7, None, UUID.replace("0", "٠")]
TYPES = ["material.published", "material.withdrawn", "material.published\n", "material.deleted", "", 1, None]
ARTICLES = ["a", "article-42", "x" * 256, "x" * 257, "é" * 256, "é" * 257, "", 42, None, ["a"],
            "a\x00b", "\x00", "a\n", "a\nb", "\t", "a\x1f", "\x1fa", "a\x7f", "a\x80", "a\u2028", " ", "a\r\n"]
REVISIONS = [1, 2, 2**63 - 1, 2**63, 0, -1, True, False, 1.0, 2.5, "1", None]
OCCURRED = [
    "2026-11-29T10:00:00Z", "2026-11-29T10:00:00+03:00", "2026-11-29t10:00:00z", "2026-11-29T10:00:00.123456789Z",
    "2016-12-31T23:59:60Z", "2026-02-30T10:00:00Z", "2026-11-29T24:00:00Z", "2026-11-29T10:00:00Z\n",
    "2026-11-29T10:00:00", "2026-11-29 10:00:00Z", "2026-W48-1T10:00:00Z", "2026-11-29T10:00:00.Z",
    "2026-11-29T10:00:00." + "1" * 50 + "Z", "٢٠٢٦-11-29T10:00:00Z", "", 0, None,
]
TITLES = ["t", "Доставка", "x" * 4096, "x" * 4097, "", 3, None]
URLS = ["", "https://example.org/a/42", "u" * 8192, "u" * 8193, 8, None]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
META_KEYS = ["correlationId", "causationId", "traceparent", "tracestate"]
METAS: list[Any] = [
    {}, {"correlationId": "c-1"}, {"traceparent": TRACEPARENT}, {"traceparent": TRACEPARENT.upper()},
    {"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, {"traceparent": TRACEPARENT + "\n"},
    {"correlationId": ""}, {"causationId": "x" * 257}, {"causationId": "a\nb"}, {"correlationId": 1},
    {"tracestate": "a=b"}, None, [], "meta",
]


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    env: dict[str, Any] = {
        "eventId": draw(st.sampled_from(EVENT_IDS) | st.text(max_size=40)),
        "type": draw(st.sampled_from(TYPES)),
        "articleId": draw(st.sampled_from(ARTICLES) | st.text(max_size=300)
                          | st.text(st.characters(max_codepoint=0x9F), max_size=8)),
        "revision": draw(st.sampled_from(REVISIONS) | st.integers()),
        "occurredAt": draw(st.sampled_from(OCCURRED) | st.text(max_size=70)),
    }
    data: Any = {"title": draw(st.sampled_from(TITLES)), "url": draw(st.sampled_from(URLS))}
    if draw(st.booleans()):
        data["lang"] = draw(st.sampled_from(["ru", 1, None, {"x": [1]}]))
    for key in draw(st.sets(st.sampled_from(["title", "url"]), max_size=1)):
        del data[key]
    env["data"] = draw(st.sampled_from([data, data, data, [data], None, "data"]))
    for key in draw(st.sets(st.sampled_from(sorted(env)), max_size=1)):
        del env[key]
    if draw(st.integers(0, 9)) == 0:
        env[draw(st.sampled_from(["revison", "extra", "data2"]))] = 1
    if draw(st.integers(0, 3)) == 0:
        env["meta"] = draw(st.sampled_from(METAS) | st.dictionaries(st.sampled_from(META_KEYS), st.text(max_size=60)))
    return env


@cache
def _compiled(event_type: EventType) -> Any:
    return fastjsonschema.compile(event_type.envelope_schema(), formats={"date-time": envelope.is_rfc3339})


def schema_accepts(event_type: EventType, obj: Any) -> bool:
    try:
        _compiled(event_type)(obj)
    except fastjsonschema.JsonSchemaValueException:
        return False
    return True


@cache
def _quick(event_type: EventType) -> Any:
    return quick_check(event_type)


PUBLISHED = MATERIAL.get("material.published")
assert PUBLISHED is not None


def test_the_material_declaration_is_the_shipped_schema() -> None:
    """A material type's envelope schema is the schema file's: same fields, same rules, same required list."""
    shipped = envelope.load_schema()
    declared = MATERIAL.schema("material.published")

    without_annotation = {k: v for k, v in shipped["properties"]["type"].items() if k != "description"}
    assert declared["properties"] == {**shipped["properties"], "type": without_annotation}
    assert declared["required"] == shipped["required"]
    assert declared["additionalProperties"] is shipped["additionalProperties"] is False


def test_the_quick_path_accepts_the_usual_envelope() -> None:
    """The usual material envelope, with or without meta, is accepted by the quick check alone."""
    check = _quick(PUBLISHED)

    assert check(VALID)
    assert check({**VALID, "meta": {"correlationId": "c-1", "traceparent": TRACEPARENT}})


@settings(max_examples=3000, deadline=None)
@given(envelopes())
def test_quick_acceptance_implies_the_schema_accepts(env: dict[str, Any]) -> None:
    """Whatever the quick check accepts, fastjsonschema accepts too (it may refuse more)."""
    if _quick(PUBLISHED)(env):
        assert schema_accepts(PUBLISHED, env), orjson.dumps(env, default=repr)


@pytest.mark.parametrize(
    "field, values",
    [
        ("eventId", EVENT_IDS),
        ("articleId", ARTICLES),
        ("revision", REVISIONS),
        ("occurredAt", OCCURRED),
        (
            "data",
            [{"title": t, "url": u} for t in TITLES for u in URLS]
            + [{"url": "u"}, {"title": "t"}, {"title": "t", "url": "u", "extra": [1]}, [], None, "x"],
        ),
        ("meta", [m for m in METAS if m != {"causationId": "a\nb"}]),
    ],
)
def test_quick_check_agrees_with_the_schema_field_by_field(field: str, values: list[Any]) -> None:
    """One field changed at a time: the quick check accepts exactly what the schema accepts,
    except an integral float revision (the schema takes 1.0; from_mapping refuses it after)."""
    check = _quick(PUBLISHED)

    for value in values:
        env = {**VALID, field: value}
        expected = schema_accepts(PUBLISHED, env) and not (field == "revision" and type(value) is not int)
        assert expected == check(env), (field, value)


def test_refused_envelopes_keep_their_rejection_reason() -> None:
    """A refusal still comes from fastjsonschema, with the same reason as before."""
    with pytest.raises(Rejection) as info:
        envelope.from_mapping({**VALID, "articleId": ""})

    assert "invalid-envelope" == info.value.code
    assert "articleId must be at least 1 characters long" == info.value.reason


#: Declared types of other shapes: integers, booleans, optional fields, closed
#: data, no revision, and a keyword the generated check does not mirror (pattern).
ORDER = EventType("order.placed", key="orderId", data={
    "type": "object", "additionalProperties": False, "required": ["status", "totalCents"],
    "properties": {"status": {"type": "string", "minLength": 1, "maxLength": 20},
                   "totalCents": {"type": "integer", "minimum": 0, "maximum": 10**9},
                   "gift": {"type": "boolean"}, "note": {"type": "string"},
                   "tier": {"type": "string", "enum": ["basic", "VIP"]}},
})
PING = EventType("device.ping", key="deviceId", revision=False, data={
    "required": ["sku"], "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"}},
})
DECLARED = EventTypes([ORDER, PING])
VALUES = ["basic", "VIP", "ok", "", "x" * 21,
          0, -1, 10**9, 10**9 + 1, True, False, 1.0, None, [], {}, "ABC-12", "abc-1", "ABC-1\n"]


@st.composite
def declared_envelopes(draw: st.DrawFn) -> dict[str, Any]:
    event_type = draw(st.sampled_from([ORDER, PING]))
    env: dict[str, Any] = {
        "eventId": draw(st.sampled_from(EVENT_IDS)),
        "type": event_type.name,
        event_type.key: draw(st.sampled_from(ARTICLES)),
        "occurredAt": draw(st.sampled_from(OCCURRED)),
    }
    if event_type.revision or draw(st.integers(0, 9)) == 0:
        env["revision"] = draw(st.sampled_from(REVISIONS))
    names = ["status", "totalCents", "gift", "note", "tier", "sku", "other"]
    env["data"] = draw(st.dictionaries(st.sampled_from(names), st.sampled_from(VALUES) | st.text(max_size=8)))
    if draw(st.integers(0, 3)) == 0:
        env["meta"] = draw(st.sampled_from(METAS))
    for key in draw(st.sets(st.sampled_from(sorted(env)), max_size=1)):
        del env[key]
    return env


@settings(max_examples=1000, deadline=None)
@given(declared_envelopes())
def test_quick_acceptance_implies_the_schema_accepts_for_declared_types(env: dict[str, Any]) -> None:
    """For declared types of other shapes too, the quick check never accepts what the schema refuses."""
    event_type = ORDER if env.get("type") == ORDER.name else PING
    if _quick(event_type)(env):
        assert schema_accepts(event_type, env), orjson.dumps(env, default=repr)


def test_the_quick_check_accepts_the_usual_declared_envelopes() -> None:
    """A valid order and a valid ping (with a data keyword the check delegates) pass the quick check."""
    order = {"eventId": UUID, "type": "order.placed", "orderId": "order-7", "revision": 1,
             "occurredAt": "2026-11-29T10:00:00Z", "data": {"status": "placed", "totalCents": 1250}}
    ping = {"eventId": UUID, "type": "device.ping", "deviceId": "d-1", "occurredAt": "2026-11-29T10:00:00Z",
            "data": {"sku": "ABC-12"}}

    assert _quick(ORDER)(order) and _quick(PING)(ping)
    assert not _quick(PING)({**ping, "data": {"sku": "abc"}})
    assert DECLARED.from_mapping(order).key == "order-7"
    assert DECLARED.from_mapping(ping).revision == 0
