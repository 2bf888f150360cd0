"""The AsyncAPI 3.0 document of a deployment, of one consumer or of one producer.

What the toolkit knows about the wire, written as a contract other teams'
tools read (``delivery-consumer asyncapi``): the broker (its URL without
credentials), one channel per event type on the topic exchange (routing
key = type), one per consumer queue (each partition's when partitioned)
and per dead queue, the operations (a producer sends each of its types, a
consumer receives its types from its queue, acking after its commit, and
sends the copies it cannot apply to its dead queue), and each type's
message: the JSON Schema of its whole envelope (``EventTypes.schema``:
the type's data schema inside the common fields), its eventId as the
correlation id. Schemas that a type's data schema defines under
``$defs``/``definitions`` move to ``components.schemas`` (a reference in an
AsyncAPI document starts at the document's root). Pure: nothing is asked
of the broker or the databases. docs/asyncapi.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from .. import consumers
from ..amqp.topology import (
    DEFAULT_EXCHANGE,
    DEFAULT_PREFIX,
    DEFAULT_URL,
    H_ATTEMPTS,
    H_ERROR_CODE,
    H_ERROR_REASON,
    AddressError,
    Topology,
    addresses,
)
from ..model.event_types import EventTypes, default_types
from ..version import __version__
from .deployment import Deployment

ASYNCAPI_VERSION = "3.0.0"
#: The AMQP bindings' version the document uses.
AMQP_BINDING = "0.3.0"
_KEY = re.compile(r"[^\w.\-]")


@dataclass(frozen=True)
class Party:
    """A consumer (its queues: one topology, or one per partition) or a producer (its types)."""

    name: str
    types: EventTypes
    queues: Sequence[tuple[str | None, Topology]] = ()


def for_deployment(dep: Deployment, *, consumer: str | None = None, producer: str | None = None,
                   version: str | None = None) -> dict[str, Any]:
    """The document of *dep*'s consumers and producers; only *consumer*'s or *producer*'s when named.
    A producer sends the types it may send (``event_types.default_types()``: the material types,
    the installed ones and those declared)."""
    names = [consumer] if consumer is not None else list(dep.consumers) if producer is None else []
    parties = [Party(name, consumers.get(name).event_types,
                     [(partition, topo) for partition, _, topo in dep.placement(name).topologies()])
               for name in names]
    senders = [producer] if producer is not None else list(dep.producers) if consumer is None else []
    what = (f"consumer {consumer}" if consumer is not None else f"producer {producer}" if producer is not None
            else f"the deployment {dep.path}")
    return document(parties, [Party(name, default_types()) for name in senders], url=dep.amqp_url,
                    exchange=dep.exchange, title=f"delivery-consumer: {what}", version=version)


def for_consumer(name: str, *, url: str = DEFAULT_URL, exchange: str = DEFAULT_EXCHANGE,
                 prefix: str = DEFAULT_PREFIX, version: str | None = None) -> dict[str, Any]:
    """The document of the consumer *name* alone, its queues under *exchange* and *prefix*."""
    spec = consumers.get(name)
    topo = consumers.topology(name, exchange, prefix)
    return document([Party(name, spec.event_types, [(None, topo)])], [], url=url, exchange=exchange,
                    title=f"delivery-consumer: consumer {name}", version=version,
                    description=spec.description)


def document(receivers: Sequence[Party], senders: Sequence[Party], *, url: str = DEFAULT_URL,
             exchange: str = DEFAULT_EXCHANGE, title: str = "delivery-consumer", version: str | None = None,
             description: str = "") -> dict[str, Any]:
    """The AsyncAPI 3.0 document of *receivers* (consumers) and *senders* (producers); one server per
    node when *url* names several (``rabbitmq``, ``rabbitmq-2``, ...)."""
    try:
        urls = addresses(url)
    except AddressError:
        urls = [url]
    vhost = _vhost(urls[0])
    types: dict[str, Any] = {}
    for party in (*receivers, *senders):
        for declared in party.types:
            types.setdefault(declared.name, (declared, party.types))
    schemas: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for name, (declared, of_set) in sorted(types.items()):
        key = _key(name)
        schemas[key] = _hoisted(of_set.schema(name), key, schemas)
        payload = {"$ref": f"#/components/schemas/{key}"}
        messages[key] = _message(name, declared.description, payload)
        messages[f"{key}.dead"] = _message(name, f"{name} dead-lettered by a consumer", payload, dead=True)
        channels[key] = {
            "address": name,
            "title": f"{name} on {exchange}",
            "description": f"Events of type {name}, published to the topic exchange {exchange} with the routing "
                           "key of their type.",
            "messages": {key: {"$ref": f"#/components/messages/{key}"}},
            "bindings": {"amqp": {"is": "routingKey", "exchange": {"name": exchange, "type": "topic",
                                                                   "durable": True, "autoDelete": False,
                                                                   "vhost": vhost},
                                  "bindingVersion": AMQP_BINDING}},
        }
    for party in senders:
        for declared in party.types:
            key = _key(declared.name)
            operations[_key(f"{party.name}.send.{declared.name}")] = {
                "action": "send",
                "title": f"{party.name} publishes {declared.name}",
                "description": "Published from the producer's outbox after its transaction commits: persistent, "
                               "mandatory, confirmed; message_id = eventId.",
                "channel": {"$ref": f"#/channels/{key}"},
                "messages": [{"$ref": f"#/channels/{key}/messages/{key}"}],
                "bindings": {"amqp": {"deliveryMode": 2, "mandatory": True, "bindingVersion": AMQP_BINDING}},
            }
    for party in receivers:
        for partition, topo in party.queues:
            label = party.name if partition is None else f"{party.name}.{partition}"
            names = [_key(t.name) for t in party.types]
            queue, dead = _key(f"{label}.queue"), _key(f"{label}.dead")
            channels[queue] = _queue_channel(topo.queue, vhost, {k: {"$ref": f"#/components/messages/{k}"}
                                                                for k in names},
                                             f"The queue of {label}, bound to {exchange} by "
                                             f"{', '.join(topo.queue_binding_keys)}.")
            channels[dead] = _queue_channel(topo.dead_queue, vhost, {f"{k}.dead": {
                "$ref": f"#/components/messages/{k}.dead"} for k in names},
                f"The dead queue of {label}: the copies it refused or could not apply, with why in their "
                "headers (delivery-consumer dead list|requeue|purge).")
            operations[_key(f"{label}.receive")] = {
                "action": "receive",
                "title": f"{label} consumes its events",
                "description": "Each delivery is applied in the consumer's SQLite transaction (receipt check, "
                               "effect, receipt) and acknowledged only after the commit; a duplicate is "
                               "answered from its receipt. A body that is a CloudEvent (structured, or binary "
                               "with cloudEvents:/cloudEvents_/ce- headers) is mapped to the envelope "
                               "(docs/envelope.md, CloudEvents in).",
                "channel": {"$ref": f"#/channels/{queue}"},
                "messages": [{"$ref": f"#/channels/{queue}/messages/{k}"} for k in names],
                "bindings": {"amqp": {"ack": True, "bindingVersion": AMQP_BINDING}},
            }
            operations[_key(f"{label}.deadLetter")] = {
                "action": "send",
                "title": f"{label} dead-letters what it cannot apply",
                "description": "A rejection (a code: invalid-envelope, event-id-reused, a consumer's own...) or "
                               "retries exhausted: the original body, with the failure in its headers, "
                               "confirmed before the delivery is acked.",
                "channel": {"$ref": f"#/channels/{dead}"},
                "messages": [{"$ref": f"#/channels/{dead}/messages/{k}.dead"} for k in names],
                "bindings": {"amqp": {"deliveryMode": 2, "mandatory": True, "bindingVersion": AMQP_BINDING}},
            }
    doc: dict[str, Any] = {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": title,
            "version": version or __version__,
            "description": (description + "\n\n" if description else "")
            + f"Written by delivery-consumer {__version__} from the declared event types. Every message is an "
              "envelope: eventId, type, the type's key, revision (when the type has one), occurredAt, data and "
              "an optional meta; its fingerprint is the SHA-256 of its canonical JSON without meta "
              "(docs/envelope.md).",
        },
        "defaultContentType": "application/json",
        "servers": {"rabbitmq" if i == 0 else f"rabbitmq-{i + 1}": _server(one) for i, one in enumerate(urls)},
        "channels": channels,
        "operations": operations,
        "components": {"schemas": schemas, "messages": messages},
    }
    return doc


def _key(name: str) -> str:
    """*name* as a key of the document's maps (letters, digits, ``.``, ``-``, ``_``)."""
    return _KEY.sub("_", name)


def _vhost(url: str) -> str:
    path = urlparse(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def _server(url: str) -> dict[str, Any]:
    """The broker, never its credentials."""
    parsed = urlparse(url)
    secure = parsed.scheme == "amqps"
    host = parsed.hostname or "localhost"
    port = parsed.port or (5671 if secure else 5672)
    server: dict[str, Any] = {"host": f"{host}:{port}", "protocol": "amqps" if secure else "amqp",
                              "protocolVersion": "0.9.1", "description": "RabbitMQ"}
    if len(parsed.path) > 1:
        server["pathname"] = parsed.path
    return server


def _queue_channel(queue: str, vhost: str, messages: Mapping[str, Any], description: str) -> dict[str, Any]:
    return {
        "address": queue,
        "description": description,
        "messages": dict(messages),
        "bindings": {"amqp": {"is": "queue", "queue": {"name": queue, "durable": True, "exclusive": False,
                                                       "autoDelete": False, "vhost": vhost},
                              "bindingVersion": AMQP_BINDING}},
    }


def _message(name: str, description: str, payload: Mapping[str, Any], *, dead: bool = False) -> dict[str, Any]:
    message: dict[str, Any] = {
        "name": name,
        "title": name,
        "contentType": "application/json",
        "payload": dict(payload),
        "correlationId": {"description": "The eventId: one fact, whatever the copies (receipts key on it).",
                          "location": "$message.payload#/eventId"},
        "bindings": {"amqp": {"messageType": name, "bindingVersion": AMQP_BINDING}},
    }
    if description:
        message["summary"] = description
    if dead:
        message["headers"] = {
            "type": "object",
            "properties": {
                H_ERROR_CODE: {"type": "string", "description": "The rejection code"},
                H_ERROR_REASON: {"type": "string", "description": "Why, in one line that never quotes the payload"},
                H_ATTEMPTS: {"type": "integer", "minimum": 1, "description": "Attempts made"},
                "x-failed-at": {"type": "string", "description": "When it was dead-lettered (UTC)"},
                "x-consumer": {"type": "string", "description": "The consumer that refused it"},
            },
        }
    return message


def _hoisted(schema: Mapping[str, Any], prefix: str, schemas: dict[str, Any]) -> dict[str, Any]:
    """*schema* with the schemas it defines (``$defs``, ``definitions``) moved to *schemas* under
    ``<prefix>.<name>``, and every reference to them rewritten to point there."""
    defined: dict[str, Any] = {}
    for where in ("$defs", "definitions"):
        for name, sub in (schema.get(where) or {}).items():
            defined[f"#/{where}/{name}"] = (f"{prefix}.{_key(name)}", sub)
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}

    def rewrite(node: Any) -> Any:
        if isinstance(node, Mapping):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref in defined:
                return {**{k: rewrite(v) for k, v in node.items() if k != "$ref"},
                        "$ref": f"#/components/schemas/{defined[ref][0]}"}
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    for target, sub in defined.values():
        schemas[target] = rewrite(sub)
    out: dict[str, Any] = rewrite(body)
    return out


def event_type_names(doc: Mapping[str, Any]) -> list[str]:
    """The event types a document describes (its messages' names), sorted."""
    return sorted({m["name"] for m in doc.get("components", {}).get("messages", {}).values()})


__all__ = ["AMQP_BINDING", "ASYNCAPI_VERSION", "Party", "document", "event_type_names", "for_consumer",
           "for_deployment"]
