"""What the store records of an event its consumer refuses or cannot store: a consumer's own rejection
carries the event's identity, and a value the consumer's tables can never hold is a rejection at once,
while the database's own failures stay the environment's."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence

import orjson
import pytest
from flaky_consumer import disk_full
from support import new_event

from delivery_consumer.inbox import ConsumerDB, apply_batch
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.envelope import Envelope, parse
from delivery_consumer.model.errors import Rejection, StoreUnavailable
from delivery_consumer.model.event_types import EventType, EventTypes

TYPES = EventTypes([EventType("payment.captured", key="paymentId", data={
    "type": "object", "required": ["amountCents"], "properties": {"amountCents": {"type": "integer"}}})])
MIGRATIONS = ("CREATE TABLE captures (payment_id TEXT PRIMARY KEY, amount_cents INTEGER NOT NULL) STRICT;",)


def _capture(conn: sqlite3.Connection, env: Envelope) -> str:
    if env.data["amountCents"] == 0:
        raise Rejection("payment-declined", "nothing to capture")  # a code of its own, no eventId given
    conn.execute("INSERT INTO captures VALUES (?, ?)", (env.key, env.data["amountCents"]))
    return "captured"


def _capture_many(conn: sqlite3.Connection, envs: Sequence[Envelope]) -> list[str]:
    return [_capture(conn, env) for env in envs]


def payment(key: str, amount: int | str) -> Envelope:
    """The parsed event capturing *amount* (a JSON number's text as it is on the wire, or an int) of *key*."""
    body = {**new_event(), "type": "payment.captured", "paymentId": key, "data": {"amountCents": 0}}
    del body["articleId"]
    raw = orjson.dumps(body).replace(b'"amountCents":0', f'"amountCents":{amount}'.encode())
    return parse(raw, types=TYPES)


@pytest.fixture(params=["apply", "apply_many"])
def payments(request: pytest.FixtureRequest, register: Callable[[ConsumerSpec], ConsumerSpec],
             open_db: Callable[..., ConsumerDB]) -> ConsumerDB:
    """A consumer of its own type whose table is STRICT, with or without a batch effect."""
    register(ConsumerSpec("payments", _capture, MIGRATIONS, event_types=TYPES, tables=("captures",),
                          apply_many=_capture_many if request.param == "apply_many" else None))
    return open_db("payments")


@pytest.mark.parametrize("batch", [1, 3])
def test_a_consumers_own_rejection_carries_the_events_id_key_and_fingerprint(payments: ConsumerDB,
                                                                             batch: int) -> None:
    """A Rejection raised with a code of the consumer's own and no eventId is recorded, and answered, with the
    event's eventId, fingerprint and key filled in by the store (logs and trace find it by them)."""
    declined = payment("pay-1", 0)
    items = [payment("pay-0", 5), declined, payment("pay-2", 7)][:batch] if batch > 1 else [declined]
    outcomes = apply_batch(payments, items)
    refused = next(o for o in outcomes if o.rejection is not None)
    assert refused.rejection is not None
    assert ("payment-declined", declined.event_id, declined.fingerprint, "pay-1") == (
        refused.rejection.code, refused.rejection.event_id, refused.rejection.fingerprint, refused.rejection.key)
    assert [(declined.event_id, "payment-declined", "pay-1")] == payments.conn.execute(
        "SELECT event_id, code, partition_key FROM rejected").fetchall()


@pytest.mark.parametrize("amount", ["9223372036854775808", "100000000000000000000", "1e20"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_value_the_table_cannot_hold_is_rejected_at_once_not_retried(payments: ConsumerDB, amount: str,
                                                                       batch: int) -> None:
    """An integer past SQLite's 64 bits, or a number JSON Schema calls an integer that a STRICT INTEGER column
    refuses (1e20 is a float to the parser), is unstorable-value at once, naming the consumer and the cause:
    never a transient error to retry; the events beside it are applied."""
    bad = payment("pay-9", amount)
    items = [payment("pay-1", 1), bad, payment("pay-2", 2)] if batch > 1 else [bad]
    outcomes = apply_batch(payments, items)
    assert [o.transient for o in outcomes] == [None] * len(items)
    refused = next(o.rejection for o in outcomes if o.event_id == bad.event_id)
    assert refused is not None and "unstorable-value" == refused.code
    assert refused.reason.startswith("payments cannot store a value of this event: ")
    assert ("pay-9", bad.event_id) == (refused.key, refused.event_id)
    applied = payments.conn.execute("SELECT payment_id FROM captures ORDER BY 1").fetchall()
    assert [("pay-1",), ("pay-2",)] == applied if batch > 1 else [] == applied


def _sqlite_error(cls: type[sqlite3.Error], message: str, code: int, name: str) -> sqlite3.Error:
    error = cls(message)
    error.sqlite_errorcode = code  # type: ignore[attr-defined]
    error.sqlite_errorname = name  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize("error", [
    disk_full(),
    _sqlite_error(sqlite3.OperationalError, "database is locked", 5, "SQLITE_BUSY"),
    _sqlite_error(sqlite3.OperationalError, "attempt to write a readonly database", 8, "SQLITE_READONLY"),
    _sqlite_error(sqlite3.OperationalError, "disk I/O error", 10, "SQLITE_IOERR"),
], ids=["full", "busy", "read-only", "io"])
def test_the_databases_own_failure_is_never_the_events(payments: ConsumerDB, error: sqlite3.Error) -> None:
    """A full, busy, read-only or failing database raised from inside an effect is not a value of the event:
    the batch fails as a whole (StoreUnavailable: nothing rejected, no attempt spent)."""
    spec = payments.spec

    def failing(conn: sqlite3.Connection, env: Envelope) -> str:
        raise error

    payments.spec = ConsumerSpec(spec.name, failing, spec.migrations, event_types=TYPES, tables=spec.tables)
    with pytest.raises(StoreUnavailable):
        apply_batch(payments, [payment("pay-1", 1)])
    assert [] == payments.conn.execute("SELECT * FROM rejected").fetchall()
