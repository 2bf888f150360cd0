"""Declared event types: parsing, meta, the receipt, and revision-aware state on a user's own table."""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import orders_consumer
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer.inbox import ConsumerDB, apply_batch
from delivery_consumer.inbox.reports import receipt_row
from delivery_consumer.model import envelope
from delivery_consumer.model.errors import ConfigError, Rejection
from delivery_consumer.model.event_types import MATERIAL, EventType, EventTypes

ORDER_DATA = {
    "type": "object",
    "required": ["status", "totalCents"],
    "properties": {
        "status": {"type": "string", "minLength": 1, "maxLength": 32},
        "totalCents": {"type": "integer", "minimum": 0},
    },
}
ORDER = EventType("order.placed", key="orderId", data=ORDER_DATA)
ORDER_CHANGED = EventType("order.changed", key="orderId", data=ORDER_DATA)
ORDERS = EventTypes([ORDER, ORDER_CHANGED])
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

#: The tests' orders consumer (its table, ``RevisionTable``), taking these types.
SPEC = dataclasses.replace(orders_consumer.SPEC, name="orders-test", event_types=ORDERS)
MIGRATIONS, TABLE, _state = orders_consumer.MIGRATIONS, orders_consumer.TABLE, orders_consumer.state


def order(order_id: str = "order-7", revision: int = 1, status: str = "placed", total: int = 1250,
          **extra: Any) -> dict[str, Any]:
    return {"eventId": str(uuid.uuid4()), "type": "order.placed", "orderId": order_id, "revision": revision,
            "occurredAt": "2026-11-29T10:00:00Z", "data": {"status": status, "totalCents": total}, **extra}


@settings(max_examples=300, deadline=None)
@given(order_id=st.text(st.characters(min_codepoint=0x20, blacklist_categories=("Cs",)), min_size=1, max_size=40),
       revision=st.integers(1, 2**63 - 1), status=st.text(st.characters(blacklist_categories=("Cs",)),
                                                            min_size=1, max_size=32),
       total=st.integers(0, 2**63 - 1), kind=st.sampled_from(["order.placed", "order.changed"]),
       with_meta=st.booleans())
def test_a_declared_type_round_trips(order_id: str, revision: int, status: str, total: int, kind: str,
                                     with_meta: bool) -> None:
    """Any valid envelope of a declared type parses to its fields, its key and a fingerprint without meta."""
    obj = {**order(order_id, revision, status, total), "type": kind}
    if with_meta:
        obj["meta"] = {"correlationId": "req-1", "traceparent": TRACEPARENT}
    env = envelope.parse(orjson.dumps(obj), types=ORDERS)

    assert (env.event_id, env.type, env.key, env.key_field, env.revision) == (
        obj["eventId"], kind, order_id, "orderId", revision)
    assert orjson.loads(env.canonical) == obj
    without_meta = {k: v for k, v in obj.items() if k != "meta"}
    assert env.fingerprint == hashlib.sha256(envelope.canonical_bytes(without_meta)).hexdigest()
    assert env.meta == obj.get("meta")


@pytest.mark.parametrize("change, code, reason", [
    ({"type": "order.cancelled"}, "unknown-type", "type 'order.cancelled' is not a known event type"),
    ({"type": "material.published"}, "unknown-type", "type 'material.published' is not a known event type"),
    ({"data": {"status": "placed"}}, "invalid-envelope", "missing field in data: totalCents"),
    ({"data": {"status": "placed", "totalCents": -1}}, "invalid-envelope", "data.totalCents must be >= 0"),
    ({"orderId": ""}, "invalid-envelope", "orderId must be at least 1 characters long"),
    ({"orderId": "a\nb"}, "invalid-envelope", "orderId must not contain control characters (U+0000 to U+001F)"),
    ({"articleId": "x"}, "invalid-envelope", "unexpected field: articleId"),
    ({"revision": 1.0}, "invalid-envelope", "revision must be written as a JSON integer"),
    ({"meta": {"traceparent": "00-abc"}}, "invalid-envelope",
     "meta.traceparent must be a W3C traceparent: 00-<32 hex>-<16 hex>-<2 hex>, ids not all zeros"),
    ({"meta": {"userId": "u"}}, "invalid-envelope", "unexpected field in meta: userId"),
])
def test_refusals_of_a_declared_type_name_the_field(change: dict[str, Any], code: str, reason: str) -> None:
    """An undeclared type is unknown-type; a body failing its type's schema is invalid-envelope naming the field."""
    with pytest.raises(Rejection) as info:
        envelope.parse(orjson.dumps({**order(), **change}), types=ORDERS)

    assert (info.value.code, info.value.reason) == (code, reason)


@pytest.mark.parametrize("data, reason", [
    ({"currency": "eur"}, "data.currency must match the pattern ^[A-Z]{3}$"),
    ({"currency": "EUR", "note": "x"}, "unexpected field in data: note"),
    ({"currency": "EUR", "card": {"last4": "12"}}, "data.card.last4 must match the pattern ^[0-9]{4}$"),
    ({}, "missing field in data: currency"),
    ({"currency": "EUR", "state": "lost"}, 'data.state must be one of: "open", "closed"'),
])
def test_a_schema_refusal_says_where_the_field_is_and_which_rule_failed(data: dict[str, Any], reason: str) -> None:
    """A field inside data is named with its path (data.card.last4), an unexpected one with where it is, and
    a pattern refusal gives the pattern (the schema's words, never the value)."""
    strict = EventTypes([EventType("payment.captured", key="paymentId", data={
        "type": "object", "required": ["currency"], "additionalProperties": False, "properties": {
            "currency": {"type": "string", "pattern": "^[A-Z]{3}$"}, "state": {"enum": ["open", "closed"]},
            "card": {"type": "object", "properties": {"last4": {"type": "string", "pattern": "^[0-9]{4}$"}}}}})])
    obj = {"eventId": str(uuid.uuid4()), "type": "payment.captured", "paymentId": "pay-1", "revision": 1,
           "occurredAt": "2026-12-02T10:00:00Z", "data": data}
    with pytest.raises(Rejection) as info:
        envelope.parse(orjson.dumps(obj), types=strict)
    assert ("invalid-envelope", reason) == (info.value.code, info.value.reason)


def test_a_type_without_revision_refuses_one_and_extra_fields_are_declared() -> None:
    """revision is refused where the type declares none; a declared extra field is accepted, another is not."""
    ping = EventTypes([EventType("device.ping", key="deviceId", revision=False,
                                 extra={"region": {"type": "string"}})])
    obj = {"eventId": str(uuid.uuid4()), "type": "device.ping", "deviceId": "d-1",
           "occurredAt": "2026-11-29T10:00:00Z", "data": {}, "region": "eu"}

    assert ping.from_mapping(obj).revision == 0
    for extra in ({"revision": 1}, {"zone": "a"}):
        with pytest.raises(Rejection, match="unexpected field"):
            ping.from_mapping({**obj, **extra})


@pytest.mark.parametrize("kwargs", [
    {"name": "x", "key": "eventId"}, {"name": "x", "key": "meta"}, {"name": "x", "key": "order id"},
    {"name": "", "key": "k"}, {"name": "x", "key": "k", "data": {"type": "array"}},
    {"name": "x", "key": "k", "extra": {"k": {}}}, {"name": "x", "key": "k", "extra": {"data": {}}},
])
def test_a_bad_declaration_is_refused(kwargs: dict[str, Any]) -> None:
    """A key or extra field shadowing a common field, or data that is not an object, is refused."""
    with pytest.raises(ConfigError):
        EventType(**kwargs)


def test_the_same_name_declared_twice_differently_is_refused() -> None:
    """Two declarations of one name with another key cannot be combined into one set."""
    with pytest.raises(ConfigError, match="declared twice"):
        _ = MATERIAL | EventTypes([EventType("material.published", key="orderId")])


def _open(tmp_path: Path, name: str = "inbox.db") -> ConsumerDB:
    return ConsumerDB.open(tmp_path / name, SPEC, create=True)


def test_meta_is_recorded_with_the_receipt_and_is_not_part_of_the_fingerprint(tmp_path: Path) -> None:
    """The receipt keeps the event's meta; the same event sent again with another meta is a duplicate."""
    obj = order(meta={"correlationId": "req-1", "causationId": "cmd-9", "traceparent": TRACEPARENT})
    again = {**obj, "meta": {"correlationId": "req-2"}}
    with _open(tmp_path) as db:
        outcomes = apply_batch(db, [envelope.parse(orjson.dumps(o), types=ORDERS) for o in (obj, again)])
        receipt = receipt_row(db.conn, obj["eventId"])

    assert [o.status for o in outcomes] == ["updated", "duplicate:updated"]
    assert receipt is not None
    assert receipt["meta"] == obj["meta"] and receipt["key"] == "order-7"


def test_revision_table_answers_like_the_catalog(tmp_path: Path) -> None:
    """updated, stale, same-state, and a conflict at an equal revision whose reason names the key."""
    events = [order(revision=2), order(revision=1), order(revision=2), order(revision=2, status="paid"),
              order(revision=3, status="paid")]
    with _open(tmp_path) as db:
        outcomes = apply_batch(db, [ORDERS.from_mapping(e) for e in events])
        row = db.conn.execute("SELECT revision, status FROM orders").fetchall()

    assert [o.status for o in outcomes] == ["updated", "stale", "same-state", "revision-conflict", "updated"]
    assert outcomes[3].rejection is not None
    assert outcomes[3].rejection.reason == "revision 2 of orderId order-7 is already stored with another state"
    assert row == [(3, "paid")]


_EVENTS = [order(key, revision, status) for key in ("o-1", "o-2") for revision in (1, 2, 3)
           for status in ("placed", "paid")]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(_EVENTS), min_size=1, max_size=12).flatmap(st.permutations), st.integers(1, 12))
def test_any_order_and_batching_of_consistent_events_converges(events: list[dict[str, Any]], batch: int) -> None:
    """Events of one state per revision, applied in any order, duplicated, in any batch size: the same table."""
    consistent = {}
    for e in events:  # one state per (key, revision): the first drawn
        consistent.setdefault((e["orderId"], e["revision"]), e)
    chosen = [consistent[(e["orderId"], e["revision"])] for e in events]
    expected = {(e["orderId"], e["revision"], e["data"]["status"]) for e in consistent.values()}
    latest = {key: max(r for (k, r, _) in expected if k == key) for key in {k for (k, _, _) in expected}}
    want = sorted((k, r, s) for (k, r, s) in expected if latest[k] == r)

    conn = sqlite3.connect(":memory:")
    conn.executescript(MIGRATIONS[0])
    envs = [ORDERS.from_mapping(e) for e in chosen]
    for start in range(0, len(envs), batch):
        chunk = envs[start:start + batch]
        fresh = list({env.event_id: env for env in chunk}.values())
        TABLE.apply_many(conn, fresh, _state)
    got = conn.execute("SELECT order_id, revision, status FROM orders ORDER BY order_id").fetchall()

    assert got == want


def test_the_outbox_takes_a_declared_type_and_orders_it_by_its_key(tmp_path: Path) -> None:
    """enqueue validates against the producer's types: the row's ordering key is the orderId; an undeclared
    type is refused unknown-type; the same event with another meta is a no-op."""
    from delivery_consumer import outbox

    conn = outbox.connect(tmp_path / "producer.db")
    try:
        obj = order(meta={"correlationId": "a"})
        with outbox.transaction(conn):
            assert outbox.enqueue(conn, obj, types=ORDERS)
            assert not outbox.enqueue(conn, orjson.dumps({**obj, "meta": {"correlationId": "b"}}), types=ORDERS)
            with pytest.raises(Rejection) as info:
                outbox.enqueue(conn, {**order(), "type": "shipment.sent"}, types=ORDERS)
        rows = conn.execute("SELECT event_id, routing_key, ordering_key FROM outbox").fetchall()
    finally:
        conn.close()

    assert info.value.code == "unknown-type"
    assert rows == [(obj["eventId"], "order.placed", "order-7")]


def test_a_data_schema_that_is_not_json_schema_is_refused_when_declared() -> None:
    """A broken data schema is a ConfigError when the types are compiled, not at the first event."""
    with pytest.raises(ConfigError, match=r"order\.odd: its schema is not valid JSON Schema"):
        EventTypes([EventType("order.odd", key="orderId", data={"properties": {"x": {"type": "strin"}}})])


def test_a_data_schema_with_definitions_validates_through_them() -> None:
    """"#/definitions/..." in a data schema refers to its own definitions, in the quick path and in refusals."""
    money = EventTypes([EventType("payment.made", key="paymentId", data={
        "definitions": {"cents": {"type": "integer", "minimum": 1}},
        "required": ["amount"], "properties": {"amount": {"$ref": "#/definitions/cents"}},
    })])
    obj = {"eventId": str(uuid.uuid4()), "type": "payment.made", "paymentId": "p-1", "revision": 1,
           "occurredAt": "2026-11-29T10:00:00Z", "data": {"amount": 5}}

    assert money.from_mapping(obj).key == "p-1"
    with pytest.raises(Rejection, match=r"data\.amount must be >= 1"):
        money.from_mapping({**obj, "data": {"amount": 0}})
