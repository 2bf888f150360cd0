"""CloudEvents from the official SDK, through RabbitMQ, into a declared non-material type, consumed by
``run``: both content modes applied exactly once, what is missing dead-lettered with the attribute named,
trace by source + id."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import orders_consumer  # noqa: F401  (registers the orders consumer in this process: its topology)
import orjson
import pika
import pytest
from brokerkit import Namespace
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from partitionkit import Cluster
from support import read_rows, wait_until

from delivery_consumer.amqp.partitions import partition_of
from delivery_consumer.amqp.topology import H_ERROR_CODE, H_ERROR_REASON
from delivery_consumer.model.cloudevents import event_id_for

pytestmark = pytest.mark.broker

SOURCE = "/shop/orders"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(autouse=True)
def _plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CLI process of the test loads the orders consumer (ns.env copies the environment)."""
    monkeypatch.setenv("DELIVERY_PLUGINS", "orders_consumer")


def event(event_id: str, order: str | None, revision: int | None, status: str, total: int,
          **extensions: Any) -> CloudEvent:
    attributes: dict[str, Any] = {
        "id": event_id, "source": SOURCE, "type": "order.placed" if revision in (None, 1) else "order.changed",
        "subject": order, "revision": revision, "datacontenttype": "application/json",
        "time": datetime(2026, 12, 2, 10, 0, 0, 123000, tzinfo=UTC), **extensions,
    }
    return CloudEvent(attributes={k: v for k, v in attributes.items() if v is not None},
                      data={"status": status, "totalCents": total})


def amqp_message(mode: str, ce: CloudEvent) -> tuple[bytes, pika.BasicProperties]:
    """What a producer using the SDK's bindings sends: the AMQP binding (``cloudEvents_`` application
    properties, the time in milliseconds) or the RabbitMQ binding (``ce-`` headers), each structured or binary."""
    if mode.startswith("amqp-"):
        message = (ce_amqp.to_structured if mode == "amqp-structured" else ce_amqp.to_binary)(ce, JSONFormat())
        return message.application_data, pika.BasicProperties(
            content_type=message.properties.get("content-type"), headers=dict(message.application_properties),
            delivery_mode=2)
    rabbit = (ce_rabbitmq.to_structured if mode == "rabbitmq-structured" else ce_rabbitmq.to_binary)(ce, JSONFormat())
    return rabbit.body, pika.BasicProperties(content_type=rabbit.content_type, headers=dict(rabbit.headers),
                                             delivery_mode=2)


def publish_with_pika(ns: Namespace, messages: list[tuple[str, bytes, pika.BasicProperties]]) -> None:
    """Publish as a producer that is not ours would: pika, a confirm channel, routing key = the CloudEvent's type."""
    declared = ns.cli("topology", "declare", "--consumer", "orders")  # its queue is bound before anything is published
    assert 0 == declared.returncode, declared.stderr
    conn, ch = ns.channel()
    try:
        ch.confirm_delivery()
        for routing_key, body, props in messages:
            ch.basic_publish(ns.exchange, routing_key, body, props, mandatory=True)
    finally:
        conn.close()


def test_sdk_cloudevents_in_both_modes_are_applied_exactly_once(ns: Namespace) -> None:
    """Structured and binary CloudEvents (both SDK bindings), a UUID id and others, each published twice:
    one receipt each under the mapped eventId, the latest revision per order, duplicates answered as such;
    a missing subject or revision is dead-lettered naming the attribute; trace finds an event by source + id."""
    uuid_id = str(uuid.UUID(int=7, version=4))
    good = [
        ("amqp-structured", event("order-1-r1", "order-1", 1, "placed", 100, correlationid="req-1",
                                  traceparent=TRACEPARENT)),
        ("amqp-binary", event(uuid_id, "order-2", 1, "placed", 200)),
        ("rabbitmq-structured", event("order-1-r2", "order-1", 2, "paid", 100)),
        ("rabbitmq-binary", event("order-3-r1", "order-3", 1, "placed", 300, correlationid="req-3")),
        ("amqp-binary", event("order-2-r2", "order-2", 2, "shipped", 200)),
    ]
    bad = [
        ("rabbitmq-structured", event("no-subject", None, 1, "placed", 1)),
        ("amqp-binary", event("no-revision", "order-4", None, "placed", 1)),
    ]
    messages = []
    for mode, ce in [*good, *bad, *good]:  # every good one twice: the duplicate of the same CloudEvent
        body, props = amqp_message(mode, ce)
        messages.append((ce.get_type(), body, props))
    publish_with_pika(ns, messages)

    done = ns.run_until_idle("orders", idle=1.0)
    assert 0 == done.returncode, done.stderr[-2000:]
    inbox = ns.db("orders")
    assert read_rows(inbox, "orders", "order_id, revision, status, total_cents") == [
        ("order-1", 2, "paid", 100), ("order-2", 2, "shipped", 200), ("order-3", 1, "placed", 300)]
    mapped = {event_id_for(SOURCE, ce.get_id()): ce for _, ce in good}
    assert uuid_id in mapped and event_id_for(SOURCE, "order-1-r1") != event_id_for("/other", "order-1-r1")
    receipts = dict(read_rows(inbox, "inbox", "event_id, meta"))
    assert set(receipts) == set(mapped)
    assert orjson.loads(receipts[event_id_for(SOURCE, "order-1-r1")]) == {"correlationId": "req-1",
                                                                          "traceparent": TRACEPARENT}
    duplicates = read_rows(inbox, "deliveries", "event_id", "last_outcome LIKE 'duplicate:%'")
    assert sorted(row[0] for row in duplicates) == sorted(mapped)

    listed = ns.cli("dead", "list", "--consumer", "orders", "--json")  # reads each dead body as a CloudEvent
    assert 0 == listed.returncode, listed.stderr
    listed_letters = orjson.loads(listed.stdout)["messages"]
    assert sorted(m["eventId"] for m in listed_letters) == sorted(
        event_id_for(SOURCE, i) for i in ("no-subject", "no-revision"))
    # refused before they mapped to an envelope, they still name their type and their CloudEvent
    assert sorted((m["type"], m["cloudEvent"]["id"]) for m in listed_letters) == [
        ("order.placed", "no-revision"), ("order.placed", "no-subject")]
    dead = ns.drain(ns.topology("orders").dead_queue)
    reasons = sorted((p.headers[H_ERROR_CODE], p.headers[H_ERROR_REASON]) for p, _ in dead)
    assert len(reasons) == 2, reasons
    assert all(code == "invalid-envelope" for code, _ in reasons)
    assert any("attribute subject is missing" in reason for _, reason in reasons), reasons
    assert any("attribute revision is missing" in reason for _, reason in reasons), reasons
    rejected = read_rows(inbox, "rejected", "event_id, code")
    assert sorted(rejected) == sorted((event_id_for(SOURCE, i), "invalid-envelope")
                                      for i in ("no-subject", "no-revision"))

    traced = ns.cli("trace", "--consumer", "orders", "--db", str(inbox), "--ce-source", SOURCE, "order-1-r1")
    assert 0 == traced.returncode, traced.stderr
    assert event_id_for(SOURCE, "order-1-r1") in traced.stdout
    assert "req-1" in traced.stdout
    unknown = ns.cli("trace", "--consumer", "orders", "--db", str(inbox), "--ce-source", "/elsewhere",
                     "order-1-r1")
    assert 1 == unknown.returncode, unknown.stdout + unknown.stderr


def test_cloudevents_without_slot_headers_are_rerouted_by_their_subject(ns: Namespace) -> None:
    """A partitioned consumer: CloudEvents from a producer that sets no slot headers wait in unrouted;
    reroute finds each one's key in its subject (binary and structured), and each partition applies its own."""
    cluster = Cluster(ns, "orders", 2)
    cluster.declare()
    try:
        sent = [("rabbitmq-binary", event(f"order-{i}-r1", f"order-{i}", 1, "placed", i)) for i in range(4)]
        sent += [("amqp-structured", event(f"order-{i}-r2", f"order-{i}", 2, "paid", i)) for i in range(4)]
        conn, ch = ns.channel()
        try:
            ch.confirm_delivery()
            for mode, ce in sent:
                body, props = amqp_message(mode, ce)
                ch.basic_publish(ns.exchange, ce.get_type(), body, props, mandatory=True)
        finally:
            conn.close()
        unrouted = f"{ns.prefix}.orders.unrouted"
        wait_until("the CloudEvents in unrouted", lambda: ns.count(unrouted) == len(sent), 30)

        moved = ns.cli("reroute", "--consumer", "orders")
        assert moved.returncode == 0, moved.stderr
        assert sorted(moved.stdout.split()) == sorted(["rerouted"] * len(sent) + [
            event_id_for(SOURCE, ce.get_id()) for _, ce in sent])
        for k in range(2):
            cluster.start(k)
        wait_until("every CloudEvent applied", lambda: cluster.receipts() == len(sent), 60, cluster.procs)
        for k in range(2):
            rows = read_rows(cluster.db(k), "orders", "order_id, revision, status")
            assert rows == [(f"order-{i}", 2, "paid") for i in range(4) if partition_of(f"order-{i}", 2) == k]
    finally:
        cluster.stop()
        cluster.delete()


def test_one_cloudevent_sent_in_both_modes_is_one_event_known_by_its_id(ns: Namespace) -> None:
    """The same SDK CloudEvent sent structured and then binary (the AMQP binding writes time as milliseconds) is
    applied once and its second copy is a duplicate, not event-id-reused; a copy of it with another body is
    dead-lettered, and: the JSON log names its CloudEvent id and source, dead list shows them with its type and
    (with the consumer's database) that its eventId is applied with another body, trace finds it by the id its
    producer knows and a published file line of a structured CloudEvent arrives as one."""
    first = event("pay-000123-cap", "order-5", 1, "placed", 500)
    other = event("pay-000123-cap", "order-5", 1, "placed", 999)  # the same id and source, another body
    messages = []
    for mode, ce in (("amqp-structured", first), ("amqp-binary", first), ("rabbitmq-binary", first),
                     ("amqp-binary", other)):
        body, props = amqp_message(mode, ce)
        messages.append((ce.get_type(), body, props))
    publish_with_pika(ns, messages)
    line = {"specversion": "1.0", "id": "order-6-r1", "source": SOURCE, "type": "order.placed", "subject": "order-6",
            "revision": 1, "time": "2026-12-02T10:00:00Z", "data": {"status": "placed", "totalCents": 6}}
    (ns.workdir / "line.ndjson").write_bytes(orjson.dumps(line) + b"\n")
    published = ns.cli("publish", "--consumer", "orders", "line.ndjson")
    assert 0 == published.returncode, published.stderr

    done = ns.run_until_idle("orders", "--log-format", "json", idle=1.0)
    assert 0 == done.returncode, done.stderr[-2000:]
    inbox, event_id = ns.db("orders"), event_id_for(SOURCE, "pay-000123-cap")
    assert [("updated",)] == read_rows(inbox, "inbox", "result", "event_id = ?", (event_id,))
    outcomes = [outcome for (outcome,) in read_rows(inbox, "deliveries", "last_outcome", "event_id = ?", (event_id,))]
    assert "duplicate:updated" in outcomes and outcomes.count("event-id-reused") == 1  # that of the other body only
    assert [("event-id-reused",)] == read_rows(inbox, "rejected", "code")
    assert [(6,)] == read_rows(inbox, "orders", "total_cents", "order_id = 'order-6'")  # published as a CloudEvent
    logged = [orjson.loads(text) for text in done.stderr.splitlines() if text.startswith("{")]
    dead = [entry for entry in logged if entry.get("outcome") == "dead-lettered"]
    assert [(event_id, "pay-000123-cap", SOURCE, "order-5")] == [
        (entry["eventId"], entry["ceId"], entry["ceSource"], entry["key"]) for entry in dead]

    listed = ns.cli("dead", "list", "--consumer", "orders", "--db", str(inbox), "--json")
    assert 0 == listed.returncode, listed.stderr
    (letter,) = orjson.loads(listed.stdout)["messages"]
    assert (event_id, {"id": "pay-000123-cap", "source": SOURCE}, "order.placed") == (
        letter["eventId"], letter["cloudEvent"], letter["type"])
    assert {"result": "updated", "sameBody": False} == letter["receipt"]  # its eventId applied, with the first body
    text = ns.cli("dead", "list", "--consumer", "orders", "--db", str(inbox))
    assert f"pay-000123-cap from {SOURCE}" in text.stdout and "updated (another body)" in text.stdout, text.stdout

    traced = ns.cli("trace", "--consumer", "orders", "--db", str(inbox), "pay-000123-cap")
    assert 0 == traced.returncode, traced.stderr
    assert f"cloudEvent: pay-000123-cap from {SOURCE}" in traced.stdout
    assert f"CloudEvent pay-000123-cap from {SOURCE}: eventId {event_id}" in traced.stderr
