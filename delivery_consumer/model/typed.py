"""Typed events: an event type declared from a model, and a consumer written as one handler per type.

:func:`event_type` declares a type from a model of its ``data`` -- a
pydantic v2 model (pydantic is never imported here: any class with
``model_json_schema`` and ``model_validate`` is one) or a dataclass (no
extra needed): the model gives the type's JSON Schema, which validates the
envelope as any declared schema does (the wire, the fingerprint and the
hot path are those of ``event_types``), and turns a valid ``data`` into the
model's value.

:class:`Consumer` builds a :class:`~delivery_consumer.model.contract.ConsumerSpec`
from one handler per type (``@payments.on("payment.captured")``): its
``apply`` looks the handler up by the event's type and calls it with the
store's connection and an :class:`Event` whose ``data`` is the model's value
(a plain mapping for a type declared without a model). A handler is an
``apply``: inside the store's transaction, it returns the result string and
raises ``Rejection`` or ``TransientError``. :func:`envelope` writes a model's
value into an envelope, for producers and tests. docs/event-types.md.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Generic, TypeVar

from .contract import Connection, ConsumerSpec, View
from .envelope import Envelope
from .errors import INVALID_ENVELOPE, ConfigError, Rejection, safe_reason
from .event_ids import new_event_id
from .event_types import EventType, EventTypes

T = TypeVar("T")

#: A per-type handler: the store's connection and the typed event in, the result out.
Handler = Callable[[Connection, "Event[Any]"], str]
#: Field metadata key naming a dataclass field's JSON name (``field(metadata={"alias": "amountCents"})``).
ALIAS = "alias"
#: Field metadata key of JSON Schema keywords added to a field's schema (``{"schema": {"minimum": 1}}``).
SCHEMA = "schema"


@dataclass(frozen=True, slots=True)
class Event(Generic[T]):
    """An event as a handler receives it: ``data`` as its type's model, and the envelope."""

    data: T
    envelope: Envelope

    @property
    def event_id(self) -> str:
        return self.envelope.event_id

    @property
    def type(self) -> str:
        return self.envelope.type

    @property
    def key(self) -> str:
        """The value of the type's key field (``paymentId``: ``pay-1``)."""
        return self.envelope.key

    @property
    def revision(self) -> int:
        """The revision (0 for a type declared without one)."""
        return self.envelope.revision

    @property
    def occurred_at(self) -> str:
        return self.envelope.occurred_at

    @property
    def meta(self) -> Mapping[str, str] | None:
        return self.envelope.meta


# -- models -------------------------------------------------------------------------------


def is_pydantic(model: object) -> bool:
    """Whether *model* is a pydantic v2 model class (by what it offers: pydantic is not imported)."""
    return isinstance(model, type) and callable(getattr(model, "model_json_schema", None)) \
        and callable(getattr(model, "model_validate", None))


def model_schema(model: type[Any]) -> dict[str, Any]:
    """The JSON Schema of ``data`` that *model* (a pydantic v2 model or a dataclass) describes."""
    if is_pydantic(model):
        schema: dict[str, Any] = model.model_json_schema(mode="validation")
        return schema
    if dataclasses.is_dataclass(model):
        return _object_schema(model, ())
    raise ConfigError(f"{model!r}: a model is a pydantic v2 model or a dataclass")


def event_type(name: str, model: type[Any], *, key: str, revision: bool = True, description: str = "",
               extra: Mapping[str, Mapping[str, Any]] | None = None) -> EventType:
    """The :class:`~delivery_consumer.model.event_types.EventType` *name* whose ``data`` is *model*
    (its schema: :func:`model_schema`); handlers of :class:`Consumer` receive the model's value."""
    return EventType(name, key=key, data=model_schema(model), revision=revision, extra=dict(extra or {}),
                     description=description or (model.__doc__ or "").strip().split("\n")[0], model=model)


def decoder(model: type[T] | None) -> Callable[[Mapping[str, Any]], T]:
    """A function from a valid ``data`` to *model*'s value (None: the mapping itself).
    A value the model refuses beyond its schema (a validator of its own) is a Rejection."""
    if model is None:
        return lambda data: data  # type: ignore[return-value]
    name = model.__name__
    if is_pydantic(model):
        validate: Callable[[Any], T] = model.model_validate  # type: ignore[attr-defined]

        def from_pydantic(data: Mapping[str, Any]) -> T:
            try:
                return validate(data)
            except ValueError as exc:  # pydantic's ValidationError: its first error, without the input
                raise Rejection(INVALID_ENVELOPE, f"data does not fit {name}: {_pydantic_error(exc)}") from None

        return from_pydantic
    convert = _converter(model, ())

    def from_dataclass(data: Mapping[str, Any]) -> T:
        try:
            value: T = convert(data)
        except (TypeError, ValueError, KeyError) as exc:
            raise Rejection(INVALID_ENVELOPE, f"data does not fit {name}: {exc}") from None
        return value

    return from_dataclass


def data_of(value: Any) -> dict[str, Any]:
    """The ``data`` (JSON values) of a model's *value*: a pydantic model, a dataclass, or a mapping."""
    if is_pydantic(type(value)):
        dumped: dict[str, Any] = value.model_dump(mode="json", by_alias=True)
        return dumped
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        encoded = _encode(value)
        assert isinstance(encoded, dict)
        return encoded
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"data must be a model's value or a mapping, not {type(value).__name__}")


def envelope(declared: EventType, key: str, data: Any, *, revision: int | None = None, event_id: str | None = None,
             occurred_at: str | None = None, meta: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An envelope (a dict, as ``outbox.enqueue`` and ``publish`` take it) of type *declared* for
    *key*, *data* a model's value or a mapping. A fresh eventId (UUID version 7) and the present
    time unless given; *revision* is required by a type that carries one."""
    if declared.revision and revision is None:
        raise ConfigError(f"{declared.name} carries a revision: give revision=")
    obj: dict[str, Any] = {"eventId": event_id or new_event_id(), "type": declared.name, declared.key: key}
    if declared.revision:
        obj["revision"] = revision
    obj["occurredAt"] = occurred_at or datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    obj["data"] = data_of(data)
    if meta:
        obj["meta"] = dict(meta)
    return obj


def _pydantic_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    try:
        first = errors(include_input=False, include_url=False)[0] if callable(errors) else None
    except Exception:  # not pydantic's: its own words
        first = None
    if not isinstance(first, dict):
        return safe_reason(str(exc), 120)
    where = ".".join(str(part) for part in first.get("loc", ())) or "data"
    return f"{where}: {first.get('msg', 'invalid')}"


# -- dataclasses: their schema, their values ----------------------------------------------

_PRIMITIVES: dict[Any, dict[str, Any]] = {
    str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"}, bool: {"type": "boolean"},
    type(None): {"type": "null"}, Any: {}, object: {},
    datetime: {"type": "string", "format": "date-time"}, date: {"type": "string", "format": "date"},
}


def _fields(cls: type[Any]) -> list[tuple[dataclasses.Field[Any], str, Any]]:
    """(field, JSON name, resolved type) of each field of dataclass *cls*."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return [(f, f.metadata.get(ALIAS, f.name), hints[f.name]) for f in dataclasses.fields(cls)]


def _object_schema(cls: type[Any], seen: tuple[type[Any], ...]) -> dict[str, Any]:
    if cls in seen:
        raise ConfigError(f"{cls.__name__}: a dataclass that contains itself has no JSON Schema here")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f, name, hint in _fields(cls):
        schema = {**_schema_of(hint, (*seen, cls)), **f.metadata.get(SCHEMA, {})}
        properties[name] = schema
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(name)
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _schema_of(hint: Any, seen: tuple[type[Any], ...]) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        merged = _schema_of(args[0], seen)
        for extra in args[1:]:
            if isinstance(extra, Mapping):
                merged.update(extra)
        return merged
    if hint in _PRIMITIVES:
        return dict(_PRIMITIVES[hint])
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [member.value for member in hint]}
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _object_schema(hint, seen)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of(arg, seen) for arg in args]}
    if origin in (list, tuple, Sequence, set, frozenset) or origin is Iterable:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return {"type": "array", "prefixItems": [_schema_of(a, seen) for a in args], "minItems": len(args),
                    "maxItems": len(args)}
        return {"type": "array", "items": _schema_of(args[0], seen) if args else {}}
    if origin in (dict, Mapping):
        if args and args[0] is not str:
            raise ConfigError(f"{hint!r}: JSON object keys are strings")
        return {"type": "object", "additionalProperties": _schema_of(args[1], seen) if args else {}}
    raise ConfigError(f"{hint!r}: no JSON Schema for this type (str, int, float, bool, None, datetime, date, "
                      "Enum, Literal, list, tuple, dict[str, ...], unions and dataclasses have one)")


def _converter(hint: Any, seen: tuple[type[Any], ...]) -> Callable[[Any], Any]:
    """A function from a valid JSON value of *hint* to its Python value."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _converter(args[0], seen)
    if hint is float:
        return float
    if hint is datetime:
        return lambda text: datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in "Zz" else text)
    if hint is date:
        return date.fromisoformat
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if hint in seen:
            raise ConfigError(f"{hint.__name__}: a dataclass that contains itself")
        parts = [(f.name, name, _converter(h, (*seen, hint))) for f, name, h in _fields(hint) if f.init]
        cls = hint

        def build(data: Mapping[str, Any]) -> Any:  # fields the model does not name are left out
            return cls(**{attr: convert(data[name]) for attr, name, convert in parts if name in data})

        return build
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            inner = _converter(options[0], seen)
            return lambda value: None if value is None else inner(value)
        return lambda value: value  # several: the JSON value as it is
    if origin in (list, Sequence, Iterable, set, frozenset):
        item = _converter(args[0], seen) if args else (lambda value: value)
        make = origin if origin in (set, frozenset) else list
        return lambda values: make(item(v) for v in values)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            each = _converter(args[0], seen)
            return lambda values: tuple(each(v) for v in values)
        items = [_converter(a, seen) for a in args]
        return lambda values: tuple(convert(v) for convert, v in zip(items, values, strict=True))
    if origin in (dict, Mapping):
        inner = _converter(args[1], seen) if args else (lambda value: value)
        return lambda values: {k: inner(v) for k, v in values.items()}
    return lambda value: value


def _encode(value: Any) -> Any:
    """A dataclass value (and what it holds) as JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.metadata.get(ALIAS, f.name): _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_encode(v) for v in value]
    return value


# -- a consumer of per-type handlers ------------------------------------------------------


class Consumer:
    """A consumer written as one handler per event type; :attr:`spec` is its ConsumerSpec.

    *types*: the event types it handles (each needs a handler; those made by
    :func:`event_type` give handlers their model's value). The other
    arguments are :class:`~delivery_consumer.model.contract.ConsumerSpec`'s
    (``checks``: ``RevisionTable.check`` of its tables); ``binding_keys``
    defaults to the types' names.
    """

    def __init__(self, name: str, *, types: EventTypes | Iterable[EventType], migrations: Sequence[str],
                 tables: Sequence[str] = (), view: View | None = None, binding_keys: Sequence[str] | None = None,
                 description: str = "", checks: Sequence[Callable[[Connection], None]] = ()) -> None:
        self.name = name
        self.checks = tuple(checks)
        self.types = types if isinstance(types, EventTypes) else EventTypes(types)
        self.migrations = tuple(migrations)
        self.tables = tuple(tables)
        self.view = view
        self.binding_keys = tuple(binding_keys) if binding_keys is not None else self.types.names
        self.description = description
        self._handlers: dict[str, tuple[Handler, Callable[[Mapping[str, Any]], Any]]] = {}
        self._spec: ConsumerSpec | None = None

    def on(self, *type_names: str) -> Callable[[Handler], Handler]:
        """Decorate the handler of *type_names* (one handler may take several types)."""
        if not type_names:
            raise ConfigError(f"consumer {self.name}: on() names the event types the handler takes")
        for type_name in type_names:
            declared = self.types.get(type_name)
            if declared is None:
                raise ConfigError(f"consumer {self.name}: {type_name!r} is not one of its types "
                                  f"({', '.join(self.types.names)})")
            if type_name in self._handlers:
                raise ConfigError(f"consumer {self.name}: {type_name} has a handler already")
        if self._spec is not None:
            raise ConfigError(f"consumer {self.name}: its spec was taken; add every handler before")

        def register(handler: Handler) -> Handler:
            for type_name in type_names:
                declared = self.types.get(type_name)
                assert declared is not None
                self._handlers[type_name] = (handler, decoder(declared.model))
            return handler

        return register

    def apply(self, conn: Connection, env: Envelope) -> str:
        """The consumer's effect: the handler of the event's type, given the typed event."""
        handler, decode = self._handlers[env.type]  # parsing admitted only the declared types
        return handler(conn, Event(decode(env.data), env))

    @property
    def spec(self) -> ConsumerSpec:
        """The :class:`~delivery_consumer.model.contract.ConsumerSpec` (every type has its handler, or ConfigError)."""
        if self._spec is None:
            missing = [name for name in self.types.names if name not in self._handlers]
            if missing:
                raise ConfigError(f"consumer {self.name}: no handler for {', '.join(missing)} "
                                  f"(@consumer.on({missing[0]!r}))")
            self._spec = ConsumerSpec(
                name=self.name, apply=self.apply, migrations=self.migrations, binding_keys=self.binding_keys,
                description=self.description, tables=self.tables, view=self.view, event_types=self.types,
                checks=self.checks)
        return self._spec


__all__ = [
    "ALIAS",
    "SCHEMA",
    "Consumer",
    "Event",
    "Handler",
    "data_of",
    "decoder",
    "envelope",
    "event_type",
    "is_pydantic",
    "model_schema",
]
