"""``delivery-consumer asyncapi``: the AsyncAPI 3.0 document of a deployment, a consumer or a producer, valid against
the official AsyncAPI 3.0.0 JSON Schema (tests/asyncapi/, no network), every reference resolving, and each
message's schema accepting exactly what the consumer accepts of its type."""

from __future__ import annotations

import copy
import functools
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orders_consumer
import orjson
import pydantic
import pytest
from support import cli, new_event

from delivery_consumer import event_type
from delivery_consumer.model import envelope
from delivery_consumer.model.event_types import EventTypes
from delivery_consumer.ops import asyncapi

SCHEMA = Path(__file__).resolve().parents[1] / "asyncapi" / "asyncapi-3.0.0.schema.json"


@functools.cache
def validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(orjson.loads(SCHEMA.read_bytes()))


def errors(doc: dict[str, Any]) -> list[str]:
    """The official schema's complaints about *doc*, and every $ref of it that names nothing."""
    found = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator().iter_errors(doc)]
    for ref in refs(doc):
        try:
            resolve(doc, ref)
        except (KeyError, IndexError, ValueError):
            found.append(f"unresolved $ref {ref}")
    return found


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[int(part)] if isinstance(node, list) else node[part.replace("~1", "/").replace("~0", "~")]
    return node


def payload_schema(doc: dict[str, Any], message: str) -> dict[str, Any]:
    """The JSON Schema of a message's payload, standalone: the document's components.schemas inlined."""
    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                return inline(resolve(doc, node["$ref"]))
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    schema: dict[str, Any] = inline(doc["components"]["messages"][message]["payload"])
    return schema


@pytest.fixture
def deployment(tmp_path: Path) -> Path:
    """A deployment file with the built-in consumers, the orders consumer (two partitions) and a producer."""
    config = tmp_path / "delivery.toml"
    config.write_text('amqp_url = "amqps://user:s3cret@rabbit.example:5671/shop"\nexchange = "shop.events"\n'
                      'queue_prefix = "shop"\n[consumers.catalog]\ndb = "state/catalog/inbox.db"\n'
                      '[consumers.orders]\ndb = "state/orders"\npartitions = 2\n'
                      '[producers.app]\ndb = "app.db"\n', "utf-8")
    return config


def test_the_document_of_a_deployment_is_valid_asyncapi_3(deployment: Path) -> None:
    """The whole deployment's document validates against the official schema, every $ref resolves, the broker is
    there without its credentials, each partition's queue and dead queue is a channel, and each type has a
    send of the producer, a channel on the exchange and its message."""
    done = cli(["--config", str(deployment), "asyncapi"], env={"DELIVERY_PLUGINS": "orders_consumer"})
    assert 0 == done.exit_code, done.output
    doc = orjson.loads(done.stdout)
    assert [] == errors(doc)
    assert {"host": "rabbit.example:5671", "protocol": "amqps", "protocolVersion": "0.9.1", "pathname": "/shop",
            "description": "RabbitMQ"} == doc["servers"]["rabbitmq"]
    assert "s3cret" not in done.stdout
    assert {"shop.orders.p0", "shop.orders.p1", "shop.orders.p0.dead", "shop.catalog", "shop.catalog.dead",
            "order.placed", "material.published"} <= {c["address"] for c in doc["channels"].values()}
    assert {"exchange": {"name": "shop.events", "type": "topic", "durable": True, "autoDelete": False,
                         "vhost": "shop"}, "is": "routingKey", "bindingVersion": "0.3.0"} == doc["channels"][
        "order.placed"]["bindings"]["amqp"]
    ops = doc["operations"]
    assert {"app.send.order.placed", "orders.p0.receive", "orders.p1.deadLetter", "catalog.receive"} <= set(ops)
    assert ["material.published", "material.withdrawn", "order.changed", "order.placed"] == (
        asyncapi.event_type_names(doc))


def test_each_message_schema_accepts_what_the_consumer_accepts_of_its_type(deployment: Path) -> None:
    """A message's payload schema (with the document's components inlined) is a valid JSON Schema that accepts a
    real envelope of its type and refuses one the consumer refuses (a key the type does not have)."""
    doc = orjson.loads(cli(["--config", str(deployment), "asyncapi", "--consumer", "orders"],
                           env={"DELIVERY_PLUGINS": "orders_consumer"}).stdout)
    assert [] == errors(doc)
    schema = payload_schema(doc, "order.placed")
    jsonschema.Draft7Validator.check_schema(schema)
    order = {"eventId": str(uuid.uuid4()), "type": "order.placed", "orderId": "order-1", "revision": 1,
             "occurredAt": "2026-12-02T10:00:00Z", "data": {"status": "placed", "totalCents": 5}}
    envelope.parse(orjson.dumps(order), types=orders_consumer.TYPES)  # the consumer takes it
    jsonschema.validate(order, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**order, "articleId": "x"}, schema)
    assert {"orders.p0.receive", "orders.p0.deadLetter", "orders.p1.receive", "orders.p1.deadLetter"} == set(
        doc["operations"])


class Refund(pydantic.BaseModel):
    amountCents: int = pydantic.Field(ge=1)
    card: Card


class Card(pydantic.BaseModel):
    last4: str = pydantic.Field(pattern="^[0-9]{4}$")


Refund.model_rebuild()


def test_a_models_nested_schemas_move_to_the_documents_components() -> None:
    """A pydantic model's $defs become components.schemas (a $ref in AsyncAPI starts at the document's root),
    every reference rewritten: the document stays valid and its payload still validates a real envelope."""
    types = EventTypes([event_type("payment.refunded", Refund, key="paymentId")])
    doc = asyncapi.document([asyncapi.Party("payments", types)], [asyncapi.Party("app", types)])
    assert [] == errors(doc)
    assert "payment.refunded.Card" in doc["components"]["schemas"]
    refund = {**new_event(), "type": "payment.refunded", "paymentId": "pay-1",
              "data": {"amountCents": 5, "card": {"last4": "4242"}}}
    del refund["articleId"]
    jsonschema.validate(refund, payload_schema(doc, "payment.refunded"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**refund, "data": {"amountCents": 5, "card": {"last4": "42"}}},
                            payload_schema(doc, "payment.refunded"))


def test_the_official_schema_refuses_a_broken_document() -> None:
    """The check is not vacuous: a server without protocol, an operation without channel and an AMQP binding of
    an unknown kind are each refused by the official schema."""
    doc = asyncapi.for_consumer("catalog")
    assert [] == errors(doc)
    for path, value in ((("servers", "rabbitmq", "protocol"), None), (("operations", "catalog.receive", "channel"),
                                                                       None),
                        (("channels", "catalog.queue", "bindings", "amqp", "is"), "topic")):
        broken = copy.deepcopy(doc)
        node = broken
        for part in path[:-1]:
            node = node[part]
        if value is None:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        assert errors(broken), path


def test_usage_mistakes_are_one_line(deployment: Path, tmp_path: Path) -> None:
    """Both --consumer and --producer, a name the file does not have, or no file and no consumer: exit 2 with one
    line; --output writes the file and says what is in it."""
    both = cli(["--config", str(deployment), "asyncapi", "--consumer", "catalog", "--producer", "app"])
    assert 2 == both.exit_code and "not both" in both.output
    unknown = cli(["--config", str(deployment), "asyncapi", "--consumer", "payments"])
    assert 2 == unknown.exit_code and "no consumer payments" in unknown.output
    nothing = cli(["asyncapi"], env={"DELIVERY_CONFIG": str(tmp_path / "missing.toml")})
    assert 2 == nothing.exit_code
    written = cli(["--config", str(deployment), "asyncapi", "--producer", "app", "--version", "7.1.0", "-o",
                   str(tmp_path / "app.json")])
    assert 0 == written.exit_code, written.output
    doc = orjson.loads((tmp_path / "app.json").read_bytes())
    assert [] == errors(doc) and "7.1.0" == doc["info"]["version"]
    assert {"app.send.material.published", "app.send.material.withdrawn"} <= set(doc["operations"])
    assert "AsyncAPI 3.0.0" in written.output


if __name__ == "__main__":  # validate a document: python tests/cli/test_asyncapi.py FILE
    problems = errors(orjson.loads(Path(sys.argv[1]).read_bytes()))
    print("\n".join(problems) or "valid")
    sys.exit(1 if problems else 0)
