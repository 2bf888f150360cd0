"""CloudEvents 1.0 in: what the official SDK writes maps to one envelope, and what is missing is named."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given
from hypothesis import strategies as st

from delivery_consumer.model import cloudevents
from delivery_consumer.model.envelope import is_event_id
from delivery_consumer.model.errors import INVALID_ENVELOPE, MALFORMED_JSON, UNKNOWN_TYPE, Rejection


@dataclass(frozen=True)
class Shape:
    key: str
    revision: bool


TYPES = {"order.placed": Shape("orderId", True), "order.noted": Shape("orderId", False)}


def lookup(name: str) -> Shape | None:
    return TYPES.get(name)


def sdk_event(**overrides: Any) -> CloudEvent:
    attributes: dict[str, Any] = {
        "id": "order-7-r3", "source": "/shop/orders", "type": "order.placed", "subject": "order-7",
        "time": datetime(2026, 12, 2, 10, 0, 0, 123000, tzinfo=UTC), "datacontenttype": "application/json",
        "revision": 3,
    }
    attributes.update(overrides)
    attributes = {k: v for k, v in attributes.items() if v is not None}
    return CloudEvent(attributes=attributes, data={"total": 42, "currency": "EUR"})


def amqp_binary(event: CloudEvent) -> tuple[bytes, str | None, dict[str, Any]]:
    message = ce_amqp.to_binary(event, JSONFormat())
    return message.application_data, message.properties.get("content-type"), dict(message.application_properties)


def amqp_structured(event: CloudEvent) -> tuple[bytes, str | None, dict[str, Any]]:
    message = ce_amqp.to_structured(event, JSONFormat())
    return message.application_data, message.properties.get("content-type"), dict(message.application_properties)


def test_structured_mode_maps_every_attribute() -> None:
    """A structured CloudEvent from the SDK maps type, subject, time, revision and data; a non-UUID id becomes v5."""
    body, content_type, headers = amqp_structured(sdk_event())
    assert cloudevents.is_cloudevent(content_type, headers)
    mapped = cloudevents.from_message(body, content_type, headers, lookup)
    expected_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "/shop/orders\norder-7-r3"))
    assert {"eventId": expected_id, "type": "order.placed", "orderId": "order-7",
            "occurredAt": "2026-12-02T10:00:00.123Z", "revision": 3,
            "data": {"total": 42, "currency": "EUR"}} == mapped


def test_binary_mode_maps_every_attribute_both_prefixes() -> None:
    """Binary mode with the SDK's cloudEvents_ headers, and the binding's cloudEvents: spelling, map alike."""
    body, content_type, headers = amqp_binary(sdk_event())
    assert all(name.startswith("cloudEvents_") for name in headers)
    underscore = cloudevents.from_message(body, content_type, headers, lookup)
    colon_headers = {"cloudEvents:" + name[len("cloudEvents_"):]: value for name, value in headers.items()}
    colon = cloudevents.from_message(body, content_type, colon_headers, lookup)
    assert underscore == colon
    assert "2026-12-02T10:00:00.123Z" == underscore["occurredAt"]  # the SDK writes time as milliseconds
    assert 3 == underscore["revision"]
    assert "order-7" == underscore["orderId"]


def test_rabbitmq_binding_headers_map_too() -> None:
    """The SDK's RabbitMQ binding (ce- headers, every value a string) maps to the same fields."""
    message = ce_rabbitmq.to_binary(sdk_event(), JSONFormat())
    mapped = cloudevents.from_message(message.body, message.content_type, message.headers, lookup)
    assert 3 == mapped["revision"]  # "3" in a header is read as the integer
    assert "2026-12-02T10:00:00.123Z" == mapped["occurredAt"]  # in UTC to the millisecond, as in binary mode


def test_a_uuid_id_is_the_event_id() -> None:
    """A canonical UUID id is used as the eventId unchanged."""
    event_id = "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11"
    body, content_type, headers = amqp_structured(sdk_event(id=event_id))
    assert event_id == cloudevents.from_message(body, content_type, headers, lookup)["eventId"]


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_event_id_mapping_is_stable_and_separates_sources(source: str, other: str, event_id: str) -> None:
    """The same source and id always give the same eventId; two sources never share one (unless the id is a UUID)."""
    first = cloudevents.event_id_for(source, event_id)
    assert first == cloudevents.event_id_for(source, event_id)
    assert uuid.UUID(first)
    if source != other and not is_event_id(event_id):
        assert first != cloudevents.event_id_for(other, event_id)


def test_trace_context_and_correlation_go_to_meta() -> None:
    """The traceparent, correlationid and causationid extensions become the envelope's meta."""
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    body, content_type, headers = amqp_binary(
        sdk_event(traceparent=traceparent, correlationid="req-1", causationid="cmd-9"))
    mapped = cloudevents.from_message(body, content_type, headers, lookup)
    assert {"traceparent": traceparent, "correlationId": "req-1", "causationId": "cmd-9"} == mapped["meta"]


def test_unrevisioned_type_has_no_revision() -> None:
    """A type declared without a revision maps without one, and needs no revision attribute."""
    body, content_type, headers = amqp_structured(sdk_event(type="order.noted", revision=None))
    assert "revision" not in cloudevents.from_message(body, content_type, headers, lookup)


@pytest.mark.parametrize(("overrides", "code", "named"), [
    ({"subject": None}, INVALID_ENVELOPE, "subject"),
    ({"revision": None}, INVALID_ENVELOPE, "revision"),
    ({"revision": "three"}, INVALID_ENVELOPE, "revision"),
    ({"time": None}, INVALID_ENVELOPE, "time"),
    ({"datacontenttype": "application/xml"}, INVALID_ENVELOPE, "datacontenttype"),
    ({"type": "order.unknown"}, UNKNOWN_TYPE, "order.unknown"),
])
@pytest.mark.parametrize("mode", [amqp_structured, amqp_binary])
def test_what_a_type_needs_is_refused_by_name(overrides: dict[str, Any], code: str, named: str, mode: Any) -> None:
    """A CloudEvent missing what its type needs is refused with a code and a reason naming the attribute."""
    event = sdk_event(**overrides)
    if overrides.get("datacontenttype") == "application/xml":
        event = CloudEvent(attributes=event.get_attributes(), data="<order/>")
    body, content_type, headers = mode(event)
    if "time" in overrides:  # the SDK stamps a time on every event: take it out of the message
        headers.pop("cloudEvents_time", None)
        if not headers:
            body = orjson.dumps({k: v for k, v in orjson.loads(body).items() if k != "time"})
    with pytest.raises(Rejection) as caught:
        cloudevents.from_message(body, content_type, headers, lookup)
    assert code == caught.value.code
    assert named in caught.value.reason
    assert cloudevents.event_id_for("/shop/orders", "order-7-r3") == caught.value.event_id


def test_other_spec_versions_batches_and_binary_data_are_refused() -> None:
    """specversion 0.3, a batch and data_base64 are refused in one line each; broken JSON is malformed-json."""
    body = orjson.dumps({"specversion": "0.3", "id": "1", "source": "/s", "type": "order.placed"})
    with pytest.raises(Rejection, match=r"specversion '0\.3' is not supported"):
        cloudevents.from_message(body, cloudevents.STRUCTURED_CONTENT_TYPE, {}, lookup)
    with pytest.raises(Rejection, match="batches are not accepted"):
        cloudevents.from_message(b"[]", "application/cloudevents-batch+json", {}, lookup)
    event = {"specversion": "1.0", "id": "1", "source": "/s", "type": "order.placed", "data_base64": "AAAA"}
    with pytest.raises(Rejection, match="data_base64"):
        cloudevents.from_message(orjson.dumps(event), cloudevents.STRUCTURED_CONTENT_TYPE, {}, lookup)
    with pytest.raises(Rejection) as caught:
        cloudevents.from_message(b"{not json", cloudevents.STRUCTURED_CONTENT_TYPE, {}, lookup)
    assert MALFORMED_JSON == caught.value.code


def test_plain_messages_are_not_cloudevents() -> None:
    """A message with no CloudEvents content type or specversion header is not taken for one."""
    assert not cloudevents.is_cloudevent("application/json", {"x-attempts": 1})
    assert not cloudevents.is_cloudevent(None, None)
    assert cloudevents.looks_structured({"specversion": "1.0"})
    assert not cloudevents.looks_structured({"eventId": "x"})


@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_a_duplicate_key_in_a_cloudevent_is_refused_by_name(mode: str) -> None:
    """A CloudEvent whose JSON repeats a key (in the event or in its data) is malformed-json naming the key."""
    if mode == "structured":
        body = (b'{"specversion": "1.0", "id": "1", "source": "/s", "type": "order.placed", "subject": "o-1",'
                b' "time": "2026-12-02T10:00:00Z", "revision": 1, "revision": 2, "data": {}}')
        content_type, headers = cloudevents.STRUCTURED_CONTENT_TYPE, {}
    else:
        body = b'{"total": 1, "total": 2}'
        content_type = "application/json"
        headers = {"cloudEvents_specversion": "1.0", "cloudEvents_id": "1", "cloudEvents_source": "/s",
                   "cloudEvents_type": "order.placed", "cloudEvents_subject": "o-1",
                   "cloudEvents_time": "2026-12-02T10:00:00Z", "cloudEvents_revision": 1}
    with pytest.raises(Rejection) as caught:
        cloudevents.from_message(body, content_type, headers, lookup)
    assert MALFORMED_JSON == caught.value.code
    assert "duplicate key" in caught.value.reason
    assert ("revision" if mode == "structured" else "total") in caught.value.reason
