"""What ``run`` logs about an event names it as the people searching the logs know it: the eventId (also of a
rejection the consumer raised with a code of its own), the key of a rejected event, and the id and source of a
CloudEvent; in text and in JSON lines. The worker runs in this process on the in-memory link."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from delivery_consumer.amqp.topology import DEFAULT_EXCHANGE
from delivery_consumer.model.cloudevents import event_id_for
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.deliveries import OutMessage
from delivery_consumer.model.envelope import Envelope
from delivery_consumer.model.errors import Rejection, TransientError
from delivery_consumer.model.event_types import EventType, EventTypes
from delivery_consumer.observability.logs import JsonFormatter
from delivery_consumer.service.memory_link import MemoryLink, MemoryQueues
from delivery_consumer.service.settings import RunConfig
from delivery_consumer.service.worker import Worker

SOURCE = "/payments"
TYPES = EventTypes([EventType("payment.captured", key="paymentId", data={
    "type": "object", "required": ["amountCents"], "properties": {"amountCents": {"type": "integer"}}})])
FAILED: dict[str, int] = {}


def _capture(conn: sqlite3.Connection, env: Envelope) -> str:
    amount = env.data["amountCents"]
    if amount == 0:
        raise Rejection("payment-declined", "nothing to capture")  # the consumer's own code, no eventId given
    if amount < 0 and FAILED.setdefault(env.event_id, 0) < 1:
        FAILED[env.event_id] += 1
        raise TransientError("the ledger is closing")
    return "captured"


def binary(ce_id: str, amount: int) -> OutMessage:
    """A CloudEvent in binary mode as a foreign producer sends it: no message_id, attributes in headers."""
    headers = {"cloudEvents_specversion": "1.0", "cloudEvents_id": ce_id, "cloudEvents_source": SOURCE,
               "cloudEvents_type": "payment.captured", "cloudEvents_subject": f"pay-{ce_id}",
               "cloudEvents_revision": 1, "cloudEvents_time": 1796205600123}
    return OutMessage("payment.captured", orjson.dumps({"amountCents": amount}), DEFAULT_EXCHANGE, None, headers)


def envelope(event_id: str, amount: int) -> OutMessage:
    body = {"eventId": event_id, "type": "payment.captured", "paymentId": "pay-e", "revision": 1,
            "occurredAt": "2026-12-02T10:00:00Z", "data": {"amountCents": amount}}
    return OutMessage("payment.captured", orjson.dumps(body), DEFAULT_EXCHANGE, event_id)


@pytest.fixture
def run_payments(tmp_path: Path, register: Callable[[ConsumerSpec], ConsumerSpec]) -> Callable[[list[OutMessage]],
                                                                                                 MemoryQueues]:
    """Run the worker of a payments consumer over the messages until nothing is left (retries included)."""
    register(ConsumerSpec("payments", _capture, ("CREATE TABLE p (x TEXT) STRICT;",), event_types=TYPES,
                          binding_keys=("payment.*",)))
    FAILED.clear()

    def run(messages: list[OutMessage]) -> MemoryQueues:
        config = RunConfig(consumer="payments", url="memory:", db_path=tmp_path / "payments.db",
                           retry_delays_ms=(10,), log_each_event=True)
        queues = MemoryQueues(config.topology())
        for message in messages:
            assert queues.publish(message)
        worker = Worker(config)
        worker.io = MemoryLink(queues, worker, stop_when_drained=True)
        worker.start()
        worker.join(60)
        assert not worker.is_alive() and worker.error is None, worker.error
        return queues

    return run


def test_a_consumers_own_rejection_is_logged_with_its_event_id_and_key(
        run_payments: Callable[[list[OutMessage]], MemoryQueues], caplog: pytest.LogCaptureFixture) -> None:
    """The dead-letter line of a Rejection the consumer raised without an eventId names the event (text and
    JSON), so that logs can be searched by eventId for business rejections too."""
    event_id = "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11"
    with caplog.at_level(logging.INFO, logger="delivery_consumer.run"):
        queues = run_payments([envelope(event_id, 0)])
    assert 1 == len(queues.dead)
    (record,) = [r for r in caplog.records if getattr(r, "outcome", None) == "dead-lettered"]
    assert record.getMessage().startswith(f"event {event_id} rejected payment-declined: nothing to capture")
    line = orjson.loads(JsonFormatter("payments").format(record))
    assert (event_id, "payment-declined", "pay-e") == (line["eventId"], line["code"], line["key"])


def test_a_cloudevents_lines_carry_its_id_and_source(run_payments: Callable[[list[OutMessage]], MemoryQueues],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Each line about a CloudEvent -- applied, retried, dead-lettered -- gives the eventId it maps to and the id
    and source its producer sent ('(CloudEvent c-1 from /payments)'; ceId and ceSource in JSON), also for a
    binary-mode message that carries no message_id."""
    with caplog.at_level(logging.INFO, logger="delivery_consumer.run"):
        run_payments([binary("c-1", 5), binary("c-2", -5), binary("c-3", 0)])
    by_outcome: dict[str, list[logging.LogRecord]] = {}
    for record in caplog.records:
        by_outcome.setdefault(str(getattr(record, "outcome", "")), []).append(record)
    for ce_id, outcome in (("c-1", "captured"), ("c-2", "retry"), ("c-2", "captured"), ("c-3", "dead-lettered")):
        event_id = event_id_for(SOURCE, ce_id)
        found = [r for r in by_outcome[outcome] if getattr(r, "eventId", None) == event_id]
        assert found, (ce_id, outcome, [r.getMessage() for r in caplog.records])
        assert f"{event_id} (CloudEvent {ce_id} from {SOURCE})" in found[0].getMessage()
        line = orjson.loads(JsonFormatter("payments").format(found[0]))
        assert (event_id, ce_id, SOURCE) == (line["eventId"], line["ceId"], line["ceSource"])
