"""Duplicate keys: a body whose objects name a key twice means two things and is refused
(``malformed-json``, the key named) by every path that parses bodies: the law of the cheap
test that proves the usual body free of them, parse, replay and run."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any
from unittest import mock

import orjson
import pytest
from brokerkit import Namespace
from hypothesis import given, settings
from hypothesis import strategies as st
from support import cli, json_lines, make_envelope, new_event, read_rows

from delivery_consumer import outbox
from delivery_consumer.model import envelope
from delivery_consumer.model.errors import MALFORMED_JSON, Rejection

# -- a JSON writer that may repeat keys, escape any character and add whitespace -------------

_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}

keys = st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(["a", "b", ":", "a:b", "revision"])
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | keys)
trees = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(keys, inner, max_size=4), max_leaves=20)
objects = st.dictionaries(keys, trees, max_size=6)


class Writer:
    """Writes a tree as JSON text with random escapes and whitespace; with
    ``duplicates``, may add to an object a pair whose key it already has."""

    def __init__(self, rnd: random.Random, duplicates: bool) -> None:
        self.rnd = rnd
        self.duplicates = duplicates
        self.added = 0

    def space(self) -> str:
        return "".join(self.rnd.choice(" \t\n\r") for _ in range(self.rnd.choice((0, 0, 0, 1, 2))))

    def char(self, c: str) -> str:
        how = self.rnd.choice(("plain", "plain", "plain", "u", "U"))
        if how == "plain" and c not in _SHORT_ESCAPES and c >= " ":
            return c
        if how == "plain":
            return _SHORT_ESCAPES.get(c, f"\\u{ord(c):04x}")
        units = [ord(c)] if ord(c) < 0x10000 else [0xD800 + ((ord(c) - 0x10000) >> 10),
                                                   0xDC00 + ((ord(c) - 0x10000) & 0x3FF)]
        return "".join(f"\\u{u:04x}" if how == "u" else f"\\u{u:04X}" for u in units)

    def string(self, s: str) -> str:
        return '"' + "".join(self.char(c) for c in s) + '"'

    def write(self, value: Any) -> str:
        if isinstance(value, dict):
            pairs = list(value.items())
            if self.duplicates and pairs and self.rnd.random() < 0.5:
                again, old = self.rnd.choice(pairs)
                other = self.rnd.choice((old, None, 1, ":", {":": [":"]}))
                pairs.insert(self.rnd.randint(0, len(pairs)), (again, other))
                self.added += 1
            inner = ",".join(f"{self.space()}{self.string(k)}{self.space()}:{self.write(v)}" for k, v in pairs)
            return "{" + inner + self.space() + "}"
        if isinstance(value, list):
            return "[" + ",".join(self.write(v) for v in value) + self.space() + "]"
        if isinstance(value, str):
            return self.space() + self.string(value) + self.space()
        return self.space() + json.dumps(value) + self.space()


def outcome(raw: bytes) -> str | None:
    """The reason refuse_duplicate_keys gives for *raw*, None when it finds none."""
    obj = orjson.loads(raw)
    try:
        envelope.refuse_duplicate_keys(raw, envelope.canonical_bytes(obj), obj)
    except Rejection as rej:
        assert MALFORMED_JSON == rej.code
        return rej.reason
    return None


@settings(max_examples=300, deadline=None)
@given(objects, st.booleans(), st.randoms(use_true_random=False))
def test_duplicates_are_found_exactly(tree: dict[str, Any], duplicates: bool, rnd: random.Random) -> None:
    """Whatever the escapes and whitespace, a body is refused exactly when one of its
    objects repeats a key, and the reason names that key."""
    writer = Writer(rnd, duplicates)
    raw = writer.write(tree).encode("utf-8")
    reason = outcome(raw)
    if writer.added:
        assert reason is not None and reason.startswith("duplicate key ")
    else:
        assert reason is None


@settings(max_examples=200, deadline=None)
@given(objects, st.randoms(use_true_random=False))
def test_the_cheap_count_proves_a_body_without_duplicates(tree: dict[str, Any], rnd: random.Random) -> None:
    """A body without duplicate keys is parsed a second time only when it holds an
    escaped backslash followed by ``u003a`` (which the count takes for an escaped colon)."""
    raw = Writer(rnd, False).write(tree).encode("utf-8")
    with mock.patch.object(json, "loads", wraps=json.loads) as slow:
        assert outcome(raw) is None
    assert not slow.called or b"\\\\u003a" in raw.lower()


@pytest.mark.parametrize("raw, key", [
    (b'{"a":1,"a":2}', "a"),
    (b'{"a":{"b":1,"b":1}}', "b"),
    (b'{"a":1,"\\u0061":1}', "a"),
    (b'{"a\\u003a":1,"a:":2}', "a:"),
    (b'{"x":[{"k":":"},{"k":1,"k":"\\u003a"}]}', "k"),
])
def test_the_reason_names_the_key(raw: bytes, key: str) -> None:
    """Escaped, nested or inside arrays, a repeated key is named in the reason."""
    assert f'duplicate key "{key}"' == outcome(raw)


# -- parse -----------------------------------------------------------------------------------


def twice(field: str, first: str, env: dict[str, Any] | None = None) -> bytes:
    """The body of *env* (the lesson's envelope) with *field* written twice, *first* before the real one."""
    raw = orjson.dumps(env or make_envelope())
    marker = f'"{field}":'.encode()
    assert raw.count(marker) == 1
    return raw.replace(marker, marker + first.encode() + b"," + marker)


def test_parse_refuses_a_repeated_top_level_field() -> None:
    """Two revisions (7, then the real one) are malformed-json naming revision, not the last one applied."""
    with pytest.raises(Rejection) as info:
        envelope.parse(twice("revision", "7", make_envelope(revision=8)))
    assert (MALFORMED_JSON, 'duplicate key "revision"') == (info.value.code, info.value.reason)
    assert make_envelope()["eventId"] == info.value.event_id


def test_parse_refuses_a_repeated_field_in_data() -> None:
    """A title written twice inside data is refused like one at the top level."""
    with pytest.raises(Rejection) as info:
        envelope.parse(twice("title", '"another"'))
    assert (MALFORMED_JSON, 'duplicate key "title"') == (info.value.code, info.value.reason)


def test_two_event_ids_leave_the_rejection_without_one() -> None:
    """With two eventIds, neither is the event's: the rejection names none."""
    with pytest.raises(Rejection) as info:
        envelope.parse(twice("eventId", '"0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c12"'))
    assert (MALFORMED_JSON, 'duplicate key "eventId"', None) == (
        info.value.code, info.value.reason, info.value.event_id)


def test_a_duplicate_comes_before_the_schema() -> None:
    """A body with a duplicate key and an unknown field is refused for the duplicate."""
    raw = twice("revision", "1", make_envelope(extra_field=1))
    with pytest.raises(Rejection) as info:
        envelope.parse(raw)
    assert (MALFORMED_JSON, 'duplicate key "revision"') == (info.value.code, info.value.reason)


def test_colons_and_escapes_in_a_valid_envelope_still_parse() -> None:
    """Escaped colons and quotes in a valid envelope are no duplicate: it parses as before."""
    env = make_envelope(title='a: "b" \\ c', url="https://example.org/a:b")
    raw = orjson.dumps(env).replace(b"a: ", b"a\\u003a ")
    assert env == envelope.parse(raw).fields


def test_the_outbox_refuses_bytes_with_a_duplicate_key(tmp_path: Path) -> None:
    """outbox.enqueue of raw bytes with a repeated revision raises malformed-json and adds no row."""
    conn = outbox.connect(tmp_path / "producer.db")
    try:
        with pytest.raises(Rejection) as info, outbox.transaction(conn):
            outbox.enqueue(conn, twice("revision", "7", new_event(revision=8)))
        assert (MALFORMED_JSON, 'duplicate key "revision"') == (info.value.code, info.value.reason)
        assert [(0,)] == conn.execute("SELECT count(*) FROM outbox").fetchall()
    finally:
        conn.close()


# -- replay ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", ["1", "100"])
def test_replay_refuses_duplicate_keys_and_applies_the_rest(tmp_path: Path, batch: str) -> None:
    """replay: bodies with a repeated revision or data title are rejected malformed-json
    (reason names the key); the catalog keeps the real events only."""
    good = new_event(article_id="ok", revision=3)
    top = new_event(article_id="top", revision=8)
    nested = new_event(article_id="nested", revision=1)
    source = tmp_path / "in.ndjson"
    source.write_bytes(orjson.dumps(good) + b"\n" + twice("revision", "7", top) + b"\n"
                       + twice("title", '"x"', nested) + b"\n")
    db = tmp_path / "catalog.db"

    result = cli(["replay", "--consumer", "catalog", "--db", str(db), "--batch", batch, "--json", str(source)])

    assert 1 == result.exit_code, result.output
    lines = json_lines(result.stdout)
    assert {"eventId": good["eventId"], "result": "updated"} == lines[0]
    assert [(MALFORMED_JSON, 'duplicate key "revision"', top["eventId"]),
            (MALFORMED_JSON, 'duplicate key "title"', nested["eventId"])] == [
        (line["rejected"], line["reason"], line["eventId"]) for line in lines[1:]]
    assert [("ok", 3)] == read_rows(db, "catalog", "article_id, revision")
    assert sorted([(MALFORMED_JSON, top["eventId"]), (MALFORMED_JSON, nested["eventId"])]) == sorted(
        read_rows(db, "rejected", "code, event_id"))


# -- run ---------------------------------------------------------------------------------------


def test_run_dead_letters_duplicate_keys(ns: Namespace) -> None:
    """run: a body with two revisions and one with two titles go to the dead queue as
    malformed-json naming the key; the event between them is applied; nothing else is."""
    good = new_event(article_id="ok", revision=2)
    top = new_event(article_id="top", revision=8)
    nested = new_event(article_id="nested", revision=1)
    ns.publish([twice("revision", "7", top), orjson.dumps(good), twice("title", '"x"', nested)],
               declare=["catalog"])

    done = ns.run_until_idle("catalog")

    assert 0 == done.returncode, done.stderr
    db = ns.db("catalog")
    assert [("ok", 2)] == read_rows(db, "catalog", "article_id, revision")
    dead = ns.drain(ns.topology("catalog").dead_queue)
    assert [(MALFORMED_JSON, 'duplicate key "revision"'), (MALFORMED_JSON, 'duplicate key "title"')] == [
        (props.headers["x-error-code"], props.headers["x-error-reason"]) for props, _ in dead]
    assert sorted([top["eventId"], nested["eventId"]]) == sorted(
        r[0] for r in read_rows(db, "rejected", "event_id", where="code = 'malformed-json'"))
