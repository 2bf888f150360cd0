"""The quick acceptance path of envelope validation never accepts what fastjsonschema refuses."""

from __future__ import annotations

import copy
from typing import Any

import fastjsonschema
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer import envelope
from delivery_consumer.errors import Rejection

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
    return env


def schema_accepts(obj: Any) -> bool:
    try:
        envelope.validator()(obj)
    except fastjsonschema.JsonSchemaValueException:
        return False
    return True


def test_the_quick_path_is_in_use_for_the_shipped_schema() -> None:
    """The shipped schema has the shape the quick check mirrors, so replay uses it."""
    check = envelope.quick_check()

    assert check is not None
    assert check(VALID)


@settings(max_examples=3000, deadline=None)
@given(envelopes())
def test_quick_acceptance_implies_the_schema_accepts(env: dict[str, Any]) -> None:
    """Whatever the quick check accepts, fastjsonschema accepts too (it may refuse more)."""
    check = envelope.quick_check()
    assert check is not None

    if check(env):
        assert schema_accepts(env), orjson.dumps(env, default=repr)


@pytest.mark.parametrize(
    "field, values",
    [
        ("eventId", EVENT_IDS),
        ("type", TYPES),
        ("articleId", ARTICLES),
        ("revision", REVISIONS),
        ("occurredAt", OCCURRED),
        (
            "data",
            [{"title": t, "url": u} for t in TITLES for u in URLS]
            + [{"url": "u"}, {"title": "t"}, {"title": "t", "url": "u", "extra": [1]}, [], None, "x"],
        ),
    ],
)
def test_quick_check_agrees_with_the_schema_field_by_field(field: str, values: list[Any]) -> None:
    """One field changed at a time: the quick check accepts exactly what the schema accepts,
    except an integral float revision (the schema takes 1.0; from_mapping refuses it after)."""
    check = envelope.quick_check()
    assert check is not None

    for value in values:
        env = {**VALID, field: value}
        expected = schema_accepts(env) and not (field == "revision" and type(value) is not int)
        assert expected == check(env), (field, value)


def test_refused_envelopes_keep_their_rejection_reason() -> None:
    """A refusal still comes from fastjsonschema, with the same reason as before."""
    with pytest.raises(Rejection) as info:
        envelope.from_mapping({**VALID, "articleId": ""})

    assert "invalid-envelope" == info.value.code
    assert "articleId must be at least 1 characters long" == info.value.reason


def test_limits_are_read_from_the_schema() -> None:
    """Another limit in the schema file changes the quick check with it."""
    schema = copy.deepcopy(envelope.load_schema())
    schema["properties"]["articleId"]["maxLength"] = 5
    check = envelope.quick_check_for(schema)

    assert check is not None
    assert check({**VALID, "articleId": "abcde"})
    assert not check({**VALID, "articleId": "abcdef"})


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["properties"]["articleId"].update(format="uri"),  # a keyword it does not mirror there
        lambda s: s["properties"].update(extra={"type": "string"}),  # a field it does not know
        lambda s: s.update(additionalProperties=True),
        lambda s: s["required"].remove("data"),
        lambda s: s["properties"]["revision"].update(type="number"),
        lambda s: s["properties"]["occurredAt"].update(format="date"),
        lambda s: s["properties"]["data"]["properties"]["title"].update(format="email"),
    ],
)
def test_a_schema_of_another_shape_turns_the_quick_check_off(change: Any) -> None:
    """Any structure the quick check does not mirror disables it (fastjsonschema alone decides)."""
    schema = copy.deepcopy(envelope.load_schema())
    change(schema)

    assert envelope.quick_check_for(schema) is None
