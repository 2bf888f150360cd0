"""Typed events: a type declared from a dataclass or a pydantic v2 model gives its data schema, a handler of that
type receives the model's value, and a consumer of per-type handlers is a ConsumerSpec like any other; nothing on
the wire changes (the envelope, its validation and its fingerprint are the declared type's)."""

from __future__ import annotations

import enum
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer import Consumer, Event, event_type
from delivery_consumer.inbox import ConsumerDB, apply_batch
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.envelope import fingerprint, parse
from delivery_consumer.model.errors import INVALID_ENVELOPE, ConfigError, Rejection
from delivery_consumer.model.event_types import EventType, EventTypes
from delivery_consumer.model.typed import data_of, decoder, envelope, model_schema


class Method(enum.Enum):
    CARD = "card"
    SEPA = "sepa"


@dataclass
class Card:
    last4: Annotated[str, {"pattern": "^[0-9]{4}$"}]


@dataclass
class Authorized:
    amountCents: Annotated[int, {"minimum": 1}]
    currency: Annotated[str, {"pattern": "^[A-Z]{3}$"}]
    method: Method = Method.CARD
    card: Card | None = None
    tags: list[str] = field(default_factory=list)
    at: datetime | None = None
    channel: Literal["web", "pos"] = "web"
    note_text: str = field(default="", metadata={"alias": "note"})


class Captured(pydantic.BaseModel):
    amountCents: int = pydantic.Field(ge=1)
    currency: str = pydantic.Field(pattern="^[A-Z]{3}$")
    card: CardModel | None = None

    @pydantic.field_validator("currency")
    @classmethod
    def not_test_money(cls, value: str) -> str:
        if value == "XTS":
            raise ValueError("XTS is the code reserved for tests")
        return value


class CardModel(pydantic.BaseModel):
    last4: str = pydantic.Field(pattern="^[0-9]{4}$")


Captured.model_rebuild()

AUTHORIZED = event_type("payment.authorized", Authorized, key="paymentId")
CAPTURED = event_type("payment.captured", Captured, key="paymentId")
TYPES = EventTypes([AUTHORIZED, CAPTURED])


def test_a_dataclass_gives_the_json_schema_of_its_fields() -> None:
    """Types, Annotated keywords, enums, literals, optional and nested dataclasses, lists, aliases and defaults
    (not required) become the JSON Schema of data; the type's doc line is its description."""
    schema = model_schema(Authorized)
    assert ["amountCents", "currency"] == schema["required"]
    props = schema["properties"]
    assert {"type": "integer", "minimum": 1} == props["amountCents"]
    assert {"type": "string", "pattern": "^[A-Z]{3}$"} == props["currency"]
    assert {"enum": ["card", "sepa"]} == props["method"]
    assert {"anyOf": [{"type": "object", "properties": {"last4": {"type": "string", "pattern": "^[0-9]{4}$"}},
                       "required": ["last4"]}, {"type": "null"}]} == props["card"]
    assert {"type": "array", "items": {"type": "string"}} == props["tags"]
    assert {"enum": ["web", "pos"]} == props["channel"]
    assert "note" in props and "note_text" not in props
    assert AUTHORIZED.model is Authorized and AUTHORIZED.data == schema


def test_a_pydantic_model_gives_its_own_json_schema() -> None:
    """A pydantic v2 model's schema is its model_json_schema, nested models in $defs, which the envelope schema
    carries at its root."""
    assert Captured.model_json_schema(mode="validation") == CAPTURED.data
    envelope_schema = TYPES.schema("payment.captured")
    assert "CardModel" in envelope_schema["$defs"]


def test_a_schema_keyword_refuses_what_the_model_refuses() -> None:
    """The envelope of a typed type is validated by the model's schema: a bad currency is invalid-envelope
    naming the field and its pattern, as for a type declared with a dict."""
    obj = envelope(AUTHORIZED, "pay-1", {"amountCents": 5, "currency": "eur"}, revision=1)
    with pytest.raises(Rejection) as refused:
        parse(orjson.dumps(obj), types=TYPES)
    assert (INVALID_ENVELOPE, "data.currency must match the pattern ^[A-Z]{3}$") == (
        refused.value.code, refused.value.reason)


@dataclass
class Plain:
    count: int
    ratio: float
    name: str
    flags: list[bool]
    labels: dict[str, str]
    parent: Card | None = None


@settings(max_examples=80, deadline=None)
@given(st.builds(Plain, count=st.integers(-(2**62), 2**62), ratio=st.floats(allow_nan=False, allow_infinity=False),
                 name=st.text(), flags=st.lists(st.booleans()), labels=st.dictionaries(st.text(), st.text()),
                 parent=st.none() | st.builds(Card, last4=st.from_regex(r"\A[0-9]{4}\Z"))))
def test_a_dataclass_value_goes_through_json_and_back(value: Plain) -> None:
    """For any value of a dataclass model: its data is valid for the type's schema, parses as an envelope, and the
    handler's decoder gives back an equal value."""
    declared = event_type("thing.made", Plain, key="thingId")
    obj = envelope(declared, "t-1", value, revision=1)
    env = parse(orjson.dumps(obj), types=EventTypes([declared]))
    assert decoder(Plain)(env.data) == value
    assert env.fingerprint == fingerprint(obj)


@settings(max_examples=60, deadline=None)
@given(st.builds(Captured, amountCents=st.integers(1, 10**12), currency=st.sampled_from(["EUR", "USD", "CHF"]),
                 card=st.none() | st.builds(CardModel, last4=st.from_regex(r"\A[0-9]{4}\Z"))))
def test_a_pydantic_value_goes_through_json_and_back(value: Captured) -> None:
    """For any value of a pydantic model: data_of is valid for its schema, and the decoder gives an equal value."""
    obj = envelope(CAPTURED, "pay-1", value, revision=2)
    env = parse(orjson.dumps(obj), types=TYPES)
    assert decoder(Captured)(env.data) == value


def ledger() -> tuple[Consumer, list[tuple[str, Any]]]:
    seen: list[tuple[str, Any]] = []
    payments = Consumer("typed-payments", types=TYPES, migrations=("CREATE TABLE seen (x TEXT) STRICT;",))

    @payments.on("payment.authorized")
    def authorized(conn: sqlite3.Connection, event: Event[Authorized]) -> str:
        seen.append((event.event_id, event.data))
        if event.data.amountCents > 10**6:
            raise Rejection("over-limit", "more than the card's limit")
        return "authorized"

    @payments.on("payment.captured")
    def captured(conn: sqlite3.Connection, event: Event[Captured]) -> str:
        seen.append((event.key, event.data))
        return f"captured:{event.revision}"

    return payments, seen


def test_each_handler_receives_its_types_model_value(register: Callable[[ConsumerSpec], ConsumerSpec],
                                                      open_db: Callable[..., ConsumerDB]) -> None:
    """A Consumer's spec dispatches by the event's type to its handler, which gets the typed event (the model's
    value in data; eventId, key, revision from the envelope); results, a consumer's own rejection and the
    receipt's fingerprint are those of any consumer (the envelope's, unchanged by the model)."""
    payments, seen = ledger()
    register(payments.spec)
    db = open_db("typed-payments")
    when = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
    first = envelope(AUTHORIZED, "pay-1", Authorized(500, "EUR", card=Card("4242"), at=when, note_text="n"),
                     revision=1)
    second = envelope(CAPTURED, "pay-1", Captured(amountCents=500, currency="EUR"), revision=2)
    big = envelope(AUTHORIZED, "pay-2", Authorized(10**7, "EUR"), revision=1)
    envs = [parse(orjson.dumps(obj), types=TYPES) for obj in (first, second, big)]
    outcomes = apply_batch(db, envs)
    assert ["authorized", "captured:2", "over-limit"] == [o.status for o in outcomes]
    assert (first["eventId"], Authorized(500, "EUR", card=Card("4242"), at=when, note_text="n")) == seen[0]
    assert ("pay-1", Captured(amountCents=500, currency="EUR")) == seen[1]
    assert fingerprint(first) == db.conn.execute("SELECT fingerprint FROM inbox WHERE event_id = ?",
                                                 (first["eventId"],)).fetchone()[0]
    assert first["data"]["note"] == "n" and first["data"]["at"] == "2026-12-02T10:00:00Z"


def test_a_model_refusing_beyond_its_schema_is_a_rejection_of_the_event(
        register: Callable[[ConsumerSpec], ConsumerSpec], open_db: Callable[..., ConsumerDB]) -> None:
    """A pydantic validator of the model's own (not in its JSON Schema) refuses data: the event is
    invalid-envelope, naming the model, the field and the validator's words, recorded with its eventId."""
    payments, seen = ledger()
    register(payments.spec)
    db = open_db("typed-payments")
    obj = envelope(CAPTURED, "pay-1", {"amountCents": 5, "currency": "XTS"}, revision=2)
    (outcome,) = apply_batch(db, [parse(orjson.dumps(obj), types=TYPES)])
    assert outcome.rejection is not None and INVALID_ENVELOPE == outcome.rejection.code
    assert outcome.rejection.reason.startswith("data does not fit Captured: currency: Value error, XTS is")
    assert [(obj["eventId"],)] == db.conn.execute("SELECT event_id FROM rejected").fetchall()
    assert [] == seen


@dataclass
class Unmapped:
    raw: bytes


def test_a_consumer_is_checked_when_it_is_written() -> None:
    """A handler of a type the consumer does not declare, a second handler of one type, and a type without any
    handler are each one ConfigError naming the type; binding keys default to the types' names."""
    payments = Consumer("p", types=TYPES, migrations=())
    with pytest.raises(ConfigError, match=r"'payment\.lost' is not one of its types"):
        payments.on("payment.lost")
    payments.on("payment.authorized")(lambda conn, event: "a")
    with pytest.raises(ConfigError, match=r"payment\.authorized has a handler already"):
        payments.on("payment.authorized")
    with pytest.raises(ConfigError, match=r"no handler for payment\.captured \(@consumer\.on\('payment\.captured'\)\)"):
        _ = payments.spec
    payments.on("payment.captured")(lambda conn, event: "c")
    assert ("payment.authorized", "payment.captured") == tuple(payments.spec.binding_keys)
    with pytest.raises(ConfigError, match="a model is a pydantic v2 model or a dataclass"):
        event_type("x.y", type("Bad", (), {}), key="k")
    with pytest.raises(ConfigError, match="no JSON Schema for this type"):
        event_type("x.y", Unmapped, key="k")
    assert data_of({"a": 1}) == {"a": 1}


def test_a_plain_type_hands_its_data_as_a_mapping() -> None:
    """A type declared with a dict schema (no model) gives its handler the data mapping itself."""
    plain = EventType("note.added", key="noteId", data={"type": "object"})
    assert {"x": 1} == decoder(plain.model)({"x": 1})


def test_dataclasses_need_no_extra_and_pydantic_is_never_imported_by_the_toolkit(tmp_path: Path) -> None:
    """The typed module works with dataclasses in a Python where pydantic cannot be imported, and importing the
    toolkit's typed events imports no pydantic."""
    blocker = tmp_path / "pydantic.py"
    blocker.write_text("raise ImportError('pydantic is not installed here')\n")
    script = (
        "import sys\n"
        "from dataclasses import dataclass\n"
        "from delivery_consumer import Consumer, event_type\n"
        "@dataclass\n"
        "class Noted:\n"
        "    text: str\n"
        "t = event_type('note.added', Noted, key='noteId')\n"
        "c = Consumer('notes', types=[t], migrations=())\n"
        "c.on('note.added')(lambda conn, event: event.data.text)\n"
        "assert c.spec.event_types.get('note.added').data['required'] == ['text']\n"
        "assert 'pydantic' not in sys.modules\n"
    )
    import subprocess

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert 0 == done.returncode, done.stderr
