"""The one parse path of a message: a CloudEvent (by its properties, or a JSON object with specversion read from a
file) is validated and fingerprinted as the envelope it maps to; anything else is an envelope as before."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orders_consumer
import orjson
import pytest
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from support import cli, json_lines, read_rows

from delivery_consumer.model import envelope
from delivery_consumer.model.cloudevents import (
    binary_attributes,
    event_id_for,
    is_cloudevent,
    media_type,
    parse_message,
)
from delivery_consumer.model.errors import INVALID_ENVELOPE, Rejection

TYPES = orders_consumer.TYPES
SOURCE = "/shop/orders"


def structured(ce_id: str, order: str | None, revision: int | None, **more: Any) -> dict[str, Any]:
    """A structured CloudEvent as JSON (what a file of them holds)."""
    event = {"specversion": "1.0", "id": ce_id, "source": SOURCE, "type": "order.placed", "subject": order,
             "revision": revision, "time": "2026-12-02T10:00:00.5Z", "datacontenttype": "application/json",
             "data": {"status": "placed", "totalCents": 10}, **more}
    return {k: v for k, v in event.items() if v is not None}


ids = st.one_of(st.uuids().map(str), st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1,
                                             max_size=40))
instants = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))


@settings(max_examples=60, deadline=None)
@given(ce_id=ids, order=st.text(st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=30),
       revision=st.integers(1, 2**53), total=st.integers(0, 10**9), time=instants)
def test_a_cloudevent_has_the_fingerprint_of_the_envelope_it_maps_to(ce_id: str, order: str, revision: int,
                                                                     total: int, time: datetime) -> None:
    """For any SDK CloudEvent, structured or binary (both bindings: the AMQP one writes time as milliseconds):
    parsing the message gives the same eventId, key, revision and fingerprint as parsing the envelope it maps to;
    the eventId is source + id's; and the four messages of one event have one fingerprint."""
    ce = CloudEvent(attributes={"id": ce_id, "source": SOURCE, "type": "order.placed", "subject": order,
                                "revision": revision, "time": time, "datacontenttype": "application/json"},
                    data={"status": "paid", "totalCents": total})
    found = []
    for to in (ce_rabbitmq.to_structured, ce_rabbitmq.to_binary):
        message = to(ce, JSONFormat())
        found.append(parse_message(message.body, content_type=message.content_type, headers=message.headers,
                                   types=TYPES))
    for to_amqp in (ce_amqp.to_structured, ce_amqp.to_binary):
        amqp = to_amqp(ce, JSONFormat())
        found.append(parse_message(amqp.application_data, content_type=amqp.properties.get("content-type"),
                                   headers=amqp.application_properties, types=TYPES))
    for env in found:
        again = envelope.parse(env.canonical, types=TYPES)
        assert (env.event_id, env.key, env.revision, env.fingerprint) == (
            again.event_id, again.key, again.revision, again.fingerprint)
        assert env.event_id == event_id_for(SOURCE, ce_id)
    assert len({env.fingerprint for env in found}) == 1  # one time spelling, whatever the mode
    assert {env.cloudevent for env in found} == {(SOURCE, ce_id)}


@settings(max_examples=100, deadline=None)
@given(time=instants, offset_min=st.integers(-23 * 60 - 59, 23 * 60 + 59), digits=st.integers(0, 9))
def test_time_maps_to_its_instant_in_utc_to_the_millisecond(time: datetime, offset_min: int, digits: int) -> None:
    """A CloudEvent's time written with any offset and any number of fraction digits (RFC 3339), or as the
    AMQP binding's milliseconds, maps to the one occurredAt of its instant: UTC, cut to the millisecond."""
    local = time.astimezone(timezone(timedelta(minutes=offset_min)))
    fraction = f"{time.microsecond:06d}000"[:digits]
    text = local.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction}" if digits else "") + local.strftime("%z")
    text = text[:-2] + ":" + text[-2:]
    kept = time.replace(microsecond=int(fraction.ljust(6, "0")[:6]) if digits else 0)
    expected = kept.strftime("%Y-%m-%dT%H:%M:%S.") + f"{kept.microsecond // 1000:03d}Z"
    env = parse_message(orjson.dumps(structured("t-1", "o-1", 1, time=text)), types=TYPES)
    assert env.occurred_at == expected
    millis = (kept - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    binary = parse_message(b'{"status": "placed", "totalCents": 10}', content_type="application/json", types=TYPES,
                           headers={"cloudEvents_specversion": "1.0", "cloudEvents_id": "t-1",
                                    "cloudEvents_source": SOURCE, "cloudEvents_type": "order.placed",
                                    "cloudEvents_subject": "o-1", "cloudEvents_revision": 1,
                                    "cloudEvents_time": millis})
    assert (binary.occurred_at, binary.fingerprint) == (expected, env.fingerprint)


def test_the_previous_releases_fingerprint_rides_along_where_it_spelled_time_otherwise() -> None:
    """Where the previous release kept time verbatim (a string) or wrote whole seconds (an AMQP 0-9-1 timestamp),
    the envelope carries that release's fingerprint too: a receipt it wrote answers this copy. Where the spelling
    is the same, there is nothing to carry."""
    verbatim = structured("p-1", "o-1", 1, time="2026-12-02T11:00:00.500000+01:00")
    env = parse_message(orjson.dumps(verbatim), types=TYPES)
    assert env.occurred_at == "2026-12-02T10:00:00.500Z"
    previous = {**orjson.loads(env.canonical), "occurredAt": "2026-12-02T11:00:00.500000+01:00"}
    assert env.earlier_fingerprints == (envelope.fingerprint(previous),)
    same = parse_message(orjson.dumps(structured("p-1", "o-1", 1, time="2026-12-02T10:00:00.500Z")), types=TYPES)
    assert (same.fingerprint, same.earlier_fingerprints) == (env.fingerprint, ())
    headers = {"ce-specversion": "1.0", "ce-id": "p-1", "ce-source": SOURCE, "ce-type": "order.placed",
               "ce-subject": "o-1", "ce-revision": "1", "ce-time": datetime(2026, 12, 2, 10, 0, 0)}
    stamped = parse_message(b'{"status": "placed", "totalCents": 10}', content_type="application/json",
                            headers=headers, types=TYPES)
    whole = {**orjson.loads(stamped.canonical), "occurredAt": "2026-12-02T10:00:00Z"}
    assert (stamped.occurred_at, stamped.earlier_fingerprints) == ("2026-12-02T10:00:00.000Z",
                                                                   (envelope.fingerprint(whole),))


@pytest.mark.parametrize(("revision", "structured_ok"), [(2, True), ("2", False)])
def test_a_structured_revision_is_a_json_integer_a_header_may_be_text(revision: Any, structured_ok: bool) -> None:
    """In a structured CloudEvent (JSON) the revision extension is a JSON integer: "2" is refused naming it;
    in a header (the RabbitMQ binding writes text) "2" is the integer 2."""
    body = orjson.dumps(structured("r-1", "o-1", revision))
    if structured_ok:
        assert parse_message(body, types=TYPES).revision == 2
    else:
        with pytest.raises(Rejection) as refused:
            parse_message(body, content_type="application/cloudevents+json", types=TYPES)
        assert refused.value.code == INVALID_ENVELOPE and "revision must be a JSON integer" in refused.value.reason
        assert refused.value.origin == (SOURCE, "r-1")
    headers = {"ce-specversion": "1.0", "ce-id": "r-1", "ce-source": SOURCE, "ce-type": "order.placed",
               "ce-subject": "o-1", "ce-revision": str(revision), "ce-time": "2026-12-02T10:00:00Z"}
    assert parse_message(b'{"status": "placed", "totalCents": 10}', content_type="application/json",
                         headers=headers, types=TYPES).revision == 2


def test_binary_mode_time_in_milliseconds_is_kept_to_the_millisecond() -> None:
    """The AMQP binding writes time as milliseconds: occurredAt is that instant with three decimals, and the
    event is valid."""
    time = datetime(2026, 12, 2, 10, 0, 0, 7000, tzinfo=UTC) + timedelta(days=1)
    ce = CloudEvent(attributes={"id": "a", "source": SOURCE, "type": "order.placed", "subject": "o-1",
                                "revision": 1, "time": time}, data={"status": "paid", "totalCents": 1})
    message = ce_amqp.to_binary(ce, JSONFormat())
    env = parse_message(message.application_data, content_type=message.properties.get("content-type"),
                        headers=message.application_properties, types=TYPES)
    assert env.occurred_at == "2026-12-03T10:00:00.007Z"


def test_a_compressed_structured_cloudevent_is_decoded_first() -> None:
    """content-encoding applies to a CloudEvent's body as to an envelope's."""
    body = orjson.dumps(structured("x-1", "o-1", 1))
    env = parse_message(gzip.compress(body), content_type="application/cloudevents+json", content_encoding="gzip",
                        types=TYPES)
    assert env.event_id == event_id_for(SOURCE, "x-1")


def test_an_envelope_mentioning_specversion_in_its_data_is_still_an_envelope() -> None:
    """Only a top-level specversion makes a body read without properties a CloudEvent."""
    obj = {"eventId": "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11", "type": "order.placed", "orderId": "o-1",
           "revision": 1, "occurredAt": "2026-12-02T10:00:00Z",
           "data": {"status": "placed", "totalCents": 1, "note": {"specversion": "1.0"}}}
    env = parse_message(orjson.dumps(obj), types=TYPES)
    assert (env.event_id, env.fingerprint) == (obj["eventId"], envelope.fingerprint(obj))
    with pytest.raises(Rejection) as refused:  # a wrong envelope keeps the envelope's reason
        parse_message(orjson.dumps({**obj, "revision": 0}), types=TYPES)
    assert refused.value.code == INVALID_ENVELOPE and refused.value.reason == "revision must be >= 1"


def test_replay_applies_a_file_of_structured_cloudevents_once(tmp_path: Path) -> None:
    """replay of an NDJSON file of structured CloudEvents (and envelopes) applies each event once under its mapped
    eventId; replaying it again answers duplicate; a CloudEvent without subject is refused naming it."""
    events = [structured("order-1-r1", "order-1", 1), structured("order-1-r2", "order-1", 2, type="order.changed",
                                                                 data={"status": "paid", "totalCents": 10}),
              structured("no-subject", None, 1)]
    source = tmp_path / "events.ndjson"
    source.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    db = tmp_path / "orders.db"

    first = cli(["replay", "--consumer", "orders", "--db", str(db), "--json", str(source)])
    second = cli(["replay", "--consumer", "orders", "--db", str(db), "--json", str(source)])

    answers = [(line["eventId"], line.get("result") or line.get("rejected")) for line in json_lines(first.stdout)]
    assert answers == [(event_id_for(SOURCE, "order-1-r1"), "updated"), (event_id_for(SOURCE, "order-1-r2"),
                       "updated"), (event_id_for(SOURCE, "no-subject"), INVALID_ENVELOPE)]
    again = [line.get("result") or line.get("rejected") for line in json_lines(second.stdout)]
    assert again[:2] == ["duplicate:updated"] * 2
    assert read_rows(db, "orders", "order_id, revision, status") == [("order-1", 2, "paid")]
    assert any("attribute subject is missing" in reason for (reason,) in read_rows(db, "rejected", "reason"))

    traced = cli(["trace", "--consumer", "orders", "--db", str(db), "--ce-source", SOURCE, "order-1-r2"])
    assert traced.exit_code == 0 and event_id_for(SOURCE, "order-1-r2") in traced.stdout
    assert cli(["trace", "--consumer", "orders", "--db", str(db), "--ce-source", SOURCE]).exit_code == 2
    by_id = cli(["trace", "--consumer", "orders", "--db", str(db), "order-1-r2"])  # the id its producer knows
    assert by_id.exit_code == 0 and event_id_for(SOURCE, "order-1-r2") in by_id.stdout
    unknown = cli(["trace", "--consumer", "orders", "--db", str(db), "order-1-r9"])
    assert unknown.exit_code == 1 and "--ce-source" in unknown.stderr


header_names = st.one_of(st.text(max_size=30), st.sampled_from(
    ["ce-specversion", "CE-SpecVersion", "cloudEvents:specversion", "cloudEvents_specversion", "ce-id",
     "cloudEvents_specversionx", "x-ce-specversion", "specversion", "compression"]))


@given(headers=st.dictionaries(header_names, st.just("1.0"), max_size=6),
       content_type=st.sampled_from([None, "", "application/json", "application/cloudevents+json; charset=utf-8",
                                     "Application/CloudEvents-Batch+JSON", "text/plain"]))
def test_a_message_is_a_cloudevent_when_its_properties_say_so(headers: dict[str, str],
                                                              content_type: str | None) -> None:
    """is_cloudevent is true exactly for a structured content type or a specversion attribute under a prefix."""
    structured = media_type(content_type) in ("application/cloudevents+json", "application/cloudevents-batch+json")
    assert is_cloudevent(content_type, headers) == (structured or "specversion" in binary_attributes(headers))


def test_a_cloudevent_sent_again_from_another_trace_is_the_same_event() -> None:
    """The tracing extensions become meta, recorded but outside the fingerprint: only the fact counts."""
    first = parse_message(orjson.dumps(structured("x-1", "o-1", 1, correlationid="req-1")),
                          content_type="application/cloudevents+json", types=TYPES)
    again = parse_message(orjson.dumps(structured("x-1", "o-1", 1, traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736"
                                                                   "-00f067aa0ba902b7-01")),
                          content_type="application/cloudevents+json", types=TYPES)
    assert first.meta == {"correlationId": "req-1"} and again.meta is not None and "traceparent" in again.meta
    assert (first.event_id, first.fingerprint) == (again.event_id, again.fingerprint)
