"""Declared event types: what an envelope of each type looks like, and the compiled check of it.

A consumer (``ConsumerSpec.event_types``) and a producer (``outbox.enqueue``,
``publish``) declare the types they handle as :class:`EventType` values: the
JSON Schema of ``data``, the envelope field that names the entity the event
changes (its *key*: ``articleId``, ``orderId``, ...) and whether it carries a
``revision``. Every envelope has ``eventId``, ``type``, its key, ``occurredAt``
and ``data``; ``revision`` when declared; optionally ``meta``
(``correlationId``, ``causationId``, ``traceparent``); nothing else unless
declared in ``extra``. The limits of the common fields are those of
``schemas/envelope.schema.json`` (the key has the articleId's).

:class:`EventTypes` is a set of declarations compiled once: a dict from type
name to its checks, so that parsing looks the type up and never loops over
the types. Each type gets a check generated as Python source for its exact
shape that answers "certainly valid" for the usual envelope; anything else
goes to fastjsonschema compiled from the type's whole envelope schema, which
decides every refusal and its reason. The material types are
:data:`MATERIAL`, the declaration the built-in consumers use.

Producers that are not a consumer declare their types with :func:`declare`
or with an entry point in the group :data:`ENTRY_POINT_GROUP` (value: an
EventType, an EventTypes or a module with ``TYPES``); :func:`default_types`
is the material types plus those.

What the compiled checks produce and need lives here too, below
``envelope.py`` (which parses bytes with these types): :class:`Envelope`,
the shipped schema file (:func:`load_schema`), the eventId and timestamp
checks and the wording of a schema refusal.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Final, NamedTuple

import fastjsonschema
import orjson

from .errors import INVALID_ENVELOPE, UNKNOWN_TYPE, ConfigError, Rejection

#: Entry-point group of installed event types (for producers and tools).
ENTRY_POINT_GROUP: Final = "delivery_consumer.model.event_types"
#: Top-level names with a fixed meaning: no key or extra field may take them.
CORE_FIELDS: Final = frozenset({"eventId", "type", "revision", "occurredAt", "data", "meta"})
#: The fields of ``meta``.
META_FIELDS: Final = frozenset({"correlationId", "causationId", "traceparent"})
ENVELOPE_SCHEMA: Final = "envelope.schema.json"
#: The shipped schema's eventId and occurredAt patterns: the quick check tests
#: these without the regex engine (:func:`_is_uuid`, :func:`_occurred_check`).
_UUID_PATTERN: Final = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
_OCCURRED_PATTERN: Final = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
#: Each byte of an eventId -> x for a lowercase hex digit, itself for "-", ? otherwise.
_UUID_BYTES: Final = bytes(
    ord("x") if chr(b) in "0123456789abcdef" else b if chr(b) == "-" else ord("?") for b in range(256)
)
_UUID_SHAPE: Final = b"xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
_FRACTION = re.compile(r"\.[0-9]+")
_FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
#: Keywords that only document.
_ANNOTATIONS: Final = frozenset({"$schema", "$id", "$comment", "title", "description", "examples"})


@dataclass(frozen=True)
class EventType:
    """One declared event type.

    *name*: the ``type`` string (also the default routing key). *key*: the
    top-level field naming the entity the event changes (its value routes
    the event to a partition and keys the consumer's state). *data*: the JSON
    Schema of ``data`` (an object schema; ``"type": "object"`` is implied).
    *revision*: whether envelopes carry a ``revision`` (an integer >= 1
    ordering the states of one key). *extra*: optional top-level fields
    beyond the common ones, name -> JSON Schema. *model*: the class of
    ``data`` the schema was made from (``typed.event_type``), or None.
    """

    name: str
    key: str
    data: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})
    revision: bool = True
    extra: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    description: str = ""
    model: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 1 <= len(self.name.encode("utf-8")) <= 255 \
                or not self.name.isprintable() or self.name != self.name.strip():
            raise ConfigError(f"event type name {self.name!r}: 1 to 255 bytes of printable text")
        for what, name in [("key", self.key), *(("extra field", n) for n in self.extra)]:
            if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name) or name in CORE_FIELDS:
                raise ConfigError(f"event type {self.name}: {what} {name!r} must be a field name (letters, digits, _)"
                                  f" other than {', '.join(sorted(CORE_FIELDS))}")
        if self.key in self.extra:
            raise ConfigError(f"event type {self.name}: {self.key!r} is the key, not an extra field")
        if not isinstance(self.data, Mapping) or self.data.get("type", "object") != "object":
            raise ConfigError(f"event type {self.name}: the data schema must describe a JSON object")

    def __hash__(self) -> int:  # the schemas are dicts
        return hash((self.name, self.key, self.revision))

    def data_schema(self) -> dict[str, Any]:
        """The schema of ``data`` with ``"type": "object"`` made explicit."""
        return {"type": "object", **self.data}

    def envelope_schema(self, names: Iterable[str] = ()) -> dict[str, Any]:
        """The JSON Schema of a whole envelope of this type. *names*: the
        ``type`` values the schema's enum lists (default: this type's)."""
        common = load_schema()["properties"]
        properties: dict[str, Any] = {
            "eventId": common["eventId"],
            "type": {"type": "string", "enum": list(names) or [self.name]},
            self.key: common["articleId"],
        }
        if self.revision:
            properties["revision"] = common["revision"]
        properties["occurredAt"] = common["occurredAt"]
        properties["data"] = self.data_schema()
        properties["meta"] = common["meta"]
        properties.update({name: dict(schema) for name, schema in self.extra.items()})
        required = ["eventId", "type", self.key, *(["revision"] if self.revision else []), "occurredAt", "data"]
        schema: dict[str, Any] = {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "title": f"{self.name} envelope",
            "type": "object",
            "additionalProperties": False,
            "required": required,
            "properties": properties,
        }
        # "#/definitions/..." in the data schema means its own root: put them at the envelope's.
        schema.update({k: self.data[k] for k in ("definitions", "$defs") if k in self.data})
        return schema


class CloudEventId(NamedTuple):
    """A CloudEvent's identity as its producer sent it: ``source`` and ``id``
    (the eventId is derived from them: ``cloudevents.event_id_for``)."""

    source: str
    id: str

    def to_json(self) -> str:
        """``{"id": ..., "source": ...}``, as the receipt and the rejection keep it."""
        return orjson.dumps({"id": self.id, "source": self.source}).decode()


class Envelope(NamedTuple):
    """A validated event: its fields, its canonical bytes and its fingerprint.

    Immutable. A NamedTuple rather than a frozen dataclass: one is built per
    event, and a frozen dataclass's ``__init__`` calls ``object.__setattr__``
    once per field.
    """

    event_id: str
    type: str
    #: The value of the type's key field (``articleId``, ``orderId``, ...).
    key: str
    #: 0 when the type declares no revision.
    revision: int
    occurred_at: str
    data: Mapping[str, Any]
    #: The whole envelope as decoded (``meta`` included).
    fields: Mapping[str, Any]
    #: The canonical JSON of the whole envelope (what a producer sends).
    canonical: bytes
    #: SHA-256 of the canonical JSON of the envelope without ``meta``.
    fingerprint: str
    #: The declaration the envelope was validated against.
    event_type: EventType | None = None
    #: The CloudEvent the envelope was mapped from (None: it came as an envelope).
    cloudevent: CloudEventId | None = None
    #: Fingerprints an earlier release computed for this same event (a
    #: CloudEvent's ``time`` it kept verbatim): a receipt holding one of them
    #: is this event's, so its copy is a duplicate (docs/envelope.md).
    earlier_fingerprints: tuple[str, ...] = ()

    @property
    def article_id(self) -> str:
        """Deprecated (removed in the next release): :attr:`key`, the key of any type."""
        _deprecated("article_id", "key")
        return self.key

    @property
    def key_field(self) -> str:
        """The name of the key field (``articleId`` when the type is unknown here)."""
        return "articleId" if self.event_type is None else self.event_type.key

    @property
    def meta(self) -> Mapping[str, str] | None:
        """The envelope's ``meta`` (correlationId, causationId, traceparent), if any."""
        meta: Mapping[str, str] | None = self.fields.get("meta")
        return meta

    @property
    def title(self) -> str:
        """Deprecated (removed in the next release): ``data["title"]`` (a material type's field)."""
        _deprecated("title", 'data["title"]')
        return str(self.data["title"])

    @property
    def url(self) -> str:
        """Deprecated (removed in the next release): ``data["url"]`` (a material type's field)."""
        _deprecated("url", 'data["url"]')
        return str(self.data["url"])


def _deprecated(name: str, instead: str) -> None:
    # stacklevel 3: the line that read the property, not the property.
    warnings.warn(f"Envelope.{name} is deprecated: use Envelope.{instead}", DeprecationWarning, stacklevel=3)


# For anything that came from JSON this writes exactly what
# orjson.dumps(obj, option=OPT_SORT_KEYS) writes; the passthrough flags only
# make Python callers' datetimes and dataclasses an error instead of a
# silently chosen spelling.
_CANONICAL: Final = (
    orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
)


def schema_dir() -> Path:
    """Where the JSON Schema files are: inside the installed package, or in
    the source checkout's top-level ``schemas/`` when running from a clone."""
    # The package directory itself rather than importlib.resources: the same
    # place for any install on a file system, without importing that machinery.
    package = Path(__file__).resolve().parents[1]
    shipped = package / "schemas"
    if (shipped / ENVELOPE_SCHEMA).is_file():
        return shipped
    checkout = package.parent / "schemas"
    if (checkout / ENVELOPE_SCHEMA).is_file():
        return checkout
    raise FileNotFoundError(
        f"{ENVELOPE_SCHEMA} not found in {shipped} nor in {checkout}: broken install"
    )


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The envelope schema as a dict (read once per process)."""
    schema: dict[str, Any] = orjson.loads((schema_dir() / ENVELOPE_SCHEMA).read_bytes())
    return schema


def is_rfc3339(value: Any) -> bool:
    """True when *value* is an RFC 3339 date-time that names a real instant."""
    if not isinstance(value, str) or len(value) > 64:
        return False
    text = value.upper()
    if len(text) < 20 or text[10] != "T":
        return False
    # An offset's minutes are 00-59 (datetime would take +00:75 as 75 minutes).
    if text[-6] in "+-" and text[-3] == ":" and text[-2:] > "59":
        return False
    # datetime has no leap second; RFC 3339 allows :60, which is still an instant.
    if text[17:19] == "60":
        text = text[:17] + "59" + text[19:]
    # Python 3.11 accepts at most microseconds; RFC 3339 allows more digits.
    # (The test spares the regex for the usual whole-second timestamp.)
    if "." in text:
        text = _FRACTION.sub(_first_fraction_digits, text, count=1)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return False
    return parsed.tzinfo is not None


def _first_fraction_digits(match: re.Match[str]) -> str:
    return match.group(0)[:7]


def _occurred_check(pattern: str) -> Callable[[str], bool]:
    """For a str: whether it matches the schema's occurredAt *pattern* and names
    an instant (:func:`is_rfc3339`).

    With the shipped pattern, ``YYYY-MM-DDTHH:MM:SS[.fff]Z`` in ASCII skips
    the regex: with its separators in place, ``datetime.fromisoformat`` reads
    it only when every other character is an ASCII digit, which is what the
    pattern asks. (``:60`` goes the long way: datetime has no leap second.)
    """
    search = _pattern(pattern)
    if pattern != _OCCURRED_PATTERN:
        return lambda text: search(text) is not None and is_rfc3339(text)
    fromisoformat = datetime.fromisoformat

    def occurred_ok(text: str) -> bool:
        size = len(text)
        if ((size == 20 and text[4::3] == "--T::Z") or (size == 24 and text[4:20:3] == "--T::." and text[23] == "Z")) \
                and text[17] != "6" and text.isascii():
            try:
                fromisoformat(text)
            except ValueError:
                return False
            return True
        return search(text) is not None and is_rfc3339(text)

    return occurred_ok


def _is_uuid(text: str) -> bool:
    """Whether *text* matches :data:`_UUID_PATTERN`, without the regex engine."""
    return text.isascii() and text.encode().translate(_UUID_BYTES) == _UUID_SHAPE


def is_event_id(value: object) -> bool:
    """Whether *value* is an eventId as the contract spells it (a lowercase 8-4-4-4-12 UUID)."""
    return isinstance(value, str) and _is_uuid(value)


def _event_id_of(obj: Mapping[str, Any]) -> str | None:
    value = obj.get("eventId")
    return value if is_event_id(value) else None


def _schema_reason(exc: fastjsonschema.JsonSchemaValueException, *, key: str = "articleId") -> str:
    """A reason naming the field and the rule, never the offending value
    (*key*: the name of the type's key field)."""
    field = (exc.name or "data").removeprefix("data").lstrip(".") or "envelope"
    rule = exc.rule or "schema"
    definition: Any = exc.rule_definition
    value = exc.value
    if rule == "required" and isinstance(value, dict) and isinstance(definition, list):
        missing = [k for k in definition if k not in value]
        where = "" if field == "envelope" else f" in {field}"
        return f"missing field{'s' if len(missing) > 1 else ''}{where}: {', '.join(missing)}"
    if rule == "additionalProperties" and isinstance(value, dict):
        allowed = set((exc.definition or {}).get("properties", {}))
        extra = sorted(str(k)[:40] for k in value if k not in allowed)
        where = "" if field == "envelope" else f" in {field}"
        return f"unexpected field{'s' if len(extra) > 1 else ''}{where}: {', '.join(extra[:5])}"
    if rule == "type":
        return f"{field} must be of type {definition}"
    if rule in ("minLength", "maxLength", "minimum", "maximum"):
        words = {
            "minLength": "at least {} characters long",
            "maxLength": "at most {} characters long",
            "minimum": ">= {}",
            "maximum": "<= {}",
        }
        return f"{field} must be {words[rule].format(definition)}"
    if field == "eventId":
        return "eventId must be a UUID in canonical lowercase form"
    if field == "occurredAt":
        return "occurredAt must be an RFC 3339 timestamp with an offset"
    if field in (key, "meta.correlationId", "meta.causationId") and rule == "pattern":
        return f"{field} must not contain control characters (U+0000 to U+001F)"
    if field == "meta.traceparent":
        return "meta.traceparent must be a W3C traceparent: 00-<32 hex>-<16 hex>-<2 hex>, ids not all zeros"
    # The schema's own words (never the value): the pattern or the values a declared type allows.
    if rule == "pattern" and isinstance(definition, str):
        return f"{field} must match the pattern {definition[:80]}"
    if rule == "enum" and isinstance(definition, list):
        shown = ", ".join(orjson.dumps(item).decode()[:40] for item in definition[:10])
        return f"{field} must be one of: {shown}{', ...' if len(definition) > 10 else ''}"
    if rule == "const":
        return f"{field} must be {orjson.dumps(definition, default=str).decode()[:80]}"
    if rule in ("minItems", "maxItems"):
        return f"{field} must have {'at least' if rule == 'minItems' else 'at most'} {definition} items"
    return f"{field} violates the schema rule '{rule}'"


#: Compiled validators by their schema's canonical JSON: types that share a
#: schema (order.placed and order.changed) share one compilation.
_COMPILED: dict[bytes, Callable[[Any], Any]] = {}


def _compile(schema: Mapping[str, Any], name: str = "") -> Callable[[Any], Any]:
    try:
        key = orjson.dumps({k: v for k, v in schema.items() if k != "title"}, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON: fastjsonschema says what is wrong
        key = b""
    validate = _COMPILED.get(key) if key else None
    if validate is None:
        # use_default=False: a "default" in a user's schema must never change
        # an envelope after its fingerprint was taken.
        try:
            validate = fastjsonschema.compile(dict(schema), formats={"date-time": is_rfc3339}, use_default=False)
        except fastjsonschema.JsonSchemaDefinitionException as exc:
            raise ConfigError(f"event type {name}: its schema is not valid JSON Schema: {exc}") from None
        if key:
            _COMPILED[key] = validate
    return validate


def _pattern(regex: str) -> Callable[[str], re.Match[str] | None]:
    """*regex* as fastjsonschema applies it (search; every unescaped ``$`` ends the string)."""
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", regex)).search


# -- the quick acceptance check, generated per type ---------------------------

def _data_terms(schema: Mapping[str, Any]) -> list[str] | None:
    """Python expressions over ``d`` (the data dict) that together accept
    only objects *schema* accepts; None when *schema* uses a keyword this
    does not mirror (the compiled validator then checks ``data``)."""
    if set(schema) - _ANNOTATIONS - {"type", "properties", "required", "additionalProperties"}:
        return None
    props = schema.get("properties", {})
    required = schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    if not isinstance(props, Mapping) or not isinstance(required, list) or not isinstance(extra, bool) \
            or not all(isinstance(name, str) for name in [*props, *required]):
        return None
    terms: list[str] = []
    if extra is False:
        terms.append(f"d.keys() <= {frozenset(props)!r}")
    for name in required:
        if name not in props:
            terms.append(f"{name!r} in d")
    for i, (name, sub) in enumerate(props.items()):
        # The value read once, into v0, v1, ...: its first test binds it.
        got = f"d.get({name!r})" if name in required else f"d[{name!r}]"
        term = _value_term(sub, f"v{i}", f"(v{i} := {got})")
        if term is None:
            return None
        terms.append(term if name in required else f"({name!r} not in d or {term})")
    return terms


def _value_term(schema: Any, v: str, first: str) -> str | None:
    """An expression accepting only values *schema* accepts, or None: *first*
    the expression of the value in its first test (which binds the name *v*), *v* after."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    rules = set(schema) - _ANNOTATIONS - {"type"}
    bounds = {rule: schema[rule] for rule in rules - {"enum"}}
    if any(type(value) is not int for value in bounds.values()):
        return None
    if kind == "string" and rules <= {"minLength", "maxLength"}:
        low, high = bounds.get("minLength", 0), bounds.get("maxLength")
        length = (f"{low} <= " if low else "") + f"len({v})" + (f" <= {high}" if high is not None else "")
        return f"(type({first}) is str and {length})" if (low or high is not None) else f"type({first}) is str"
    if kind == "integer" and rules <= {"minimum", "maximum"}:
        low, high = bounds.get("minimum"), bounds.get("maximum")
        checks = [f"{low} <= {v}" if low is not None else "", f"{v} <= {high}" if high is not None else ""]
        return f"(type({first}) is int" + "".join(f" and {c}" for c in checks if c) + ")"
    if kind == "string" and rules == {"enum"} and isinstance(schema["enum"], list) \
            and all(type(item) is str for item in schema["enum"]):
        return f"(type({first}) is str and {v} in {frozenset(schema['enum'])!r})"
    if kind == "boolean" and not rules:
        return f"type({first}) is bool"
    return None


def _meta_check() -> Callable[[Any], bool]:
    """True only for a ``meta`` the schema accepts (False for some it accepts too)."""
    props = load_schema()["properties"]["meta"]["properties"]
    low, high = props["correlationId"]["minLength"], props["correlationId"]["maxLength"]
    assert (low, high) == (props["causationId"]["minLength"], props["causationId"]["maxLength"])
    traceparent_ok = _pattern(props["traceparent"]["pattern"])
    fields = META_FIELDS

    def certainly_valid(meta: Any) -> bool:
        if type(meta) is not dict or not meta.keys() <= fields:
            return False
        for name, value in meta.items():
            if type(value) is not str:
                return False
            if name == "traceparent":
                if traceparent_ok(value) is None:
                    return False
            elif not (low <= len(value) <= high and value.isprintable()):
                return False
        return True

    return certainly_valid


def quick_check(event_type: EventType) -> Callable[[Mapping[str, Any]], bool]:
    """A check that returns True only for envelopes of *event_type* its
    schema accepts (and False for some it accepts too: those go to the
    compiled validator). Generated as Python source for this type's fields."""
    common = load_schema()["properties"]
    key, event_id, occurred, revision = (common[k] for k in ("articleId", "eventId", "occurredAt", "revision"))
    required = {"eventId", "type", event_type.key, "occurredAt", "data", *(["revision"] if event_type.revision else [])}
    namespace: dict[str, Any] = {
        "UUID_BYTES": _UUID_BYTES, "UUID_SHAPE": _UUID_SHAPE, "meta_ok": _meta_check(),
        "event_id_ok": _pattern(event_id["pattern"]),
        "key_ok": _pattern(key["pattern"]), "occurred_ok": _occurred_check(occurred["pattern"]),
    }
    data = _data_terms(event_type.data_schema())
    if data is None:
        validate = _compile(event_type.data_schema(), event_type.name)

        def data_ok(value: Any) -> bool:
            try:
                validate(value)
            except fastjsonschema.JsonSchemaValueException:
                return False
            return True

        namespace["data_ok"] = data_ok
        data = ["data_ok(d)"]
    # _is_uuid, inline (no call per event) when the pattern is the shipped one
    uuid_ok = ("event_id.isascii() and event_id.encode().translate(UUID_BYTES) == UUID_SHAPE"
               if event_id["pattern"] == _UUID_PATTERN else "event_id_ok(event_id) is not None")
    terms = [
        # its own type only: a check is asked for the type the envelope names, but stands alone
        f"obj.get('type') == {event_type.name!r}",
        f"type(event_id) is str and {uuid_ok}",
        f"type(key) is str and {key['minLength']} <= len(key) <= {key['maxLength']}",
        # printable text has no control character: the pattern's search only for the rest
        "(key.isprintable() or key_ok(key) is not None)",
        *([f"type(revision) is int and {revision['minimum']} <= revision <= {revision['maximum']}"]
          if event_type.revision else []),
        f"type(occurred) is str and len(occurred) <= {occurred['maxLength']}",
        "occurred_ok(occurred)",
        *data,
    ]
    source = "\n".join([
        "def certainly_valid(obj):",
        # Exactly the required fields (and meta): as many fields, and each
        # required one read by get() below and tested for its type, which
        # None (absent) fails. Cheaper than comparing the set of keys.
        "    size = len(obj)",
        f"    if size != {len(required)} and (size != {len(required) + 1} or not meta_ok(obj.get('meta'))):",
        "        return False",
        "    d = obj.get('data')",
        "    if type(d) is not dict:",
        "        return False",
        f"    event_id, key, occurred = obj.get('eventId'), obj.get({event_type.key!r}), obj.get('occurredAt')",
        *(["    revision = obj.get('revision')"] if event_type.revision else []),
        "    return (",
        "        " + "\n        and ".join(terms),
        "    )",
    ])
    exec(compile(source, f"<quick check of {event_type.name}>", "exec"), namespace)
    check: Callable[[Mapping[str, Any]], bool] = namespace["certainly_valid"]
    return check


# -- a compiled set of types ----------------------------------------------------

class _Compiled:
    """One type's checks (the validator compiled at its first refusal)."""

    __slots__ = ("_validate", "key", "names", "quick", "revision", "type")

    def __init__(self, event_type: EventType, names: tuple[str, ...]) -> None:
        self.type = event_type
        self.key = event_type.key
        self.revision = event_type.revision
        self.names = names
        self.quick = quick_check(event_type)
        self._validate: Callable[[Any], Any] | None = None
        if event_type not in _SHIPPED:  # a declaration's mistake shows now, not at its first refusal
            self._validator()

    def _validator(self) -> Callable[[Any], Any]:
        if self._validate is None:
            self._validate = _compile(self.type.envelope_schema(self.names), self.type.name)
        return self._validate

    def validate(self, obj: Any) -> None:
        self._validator()(obj)


_new_tuple = tuple.__new__


def _meta_free_digest(obj: Mapping[str, Any]) -> str:
    """The fingerprint of an envelope carrying ``meta``: that of the envelope without it."""
    return hashlib.sha256(orjson.dumps({k: v for k, v in obj.items() if k != "meta"}, option=_CANONICAL)).hexdigest()


class EventTypes:
    """An immutable set of declared event types, compiled for parsing.

    ``types.get(name)`` gives a declaration (its ``key`` and ``revision`` are
    what a mapper from another format needs); ``types.from_mapping(obj)``
    validates an envelope; ``a | b`` is the union (the same name declared
    twice differently is a ConfigError).
    """

    def __init__(self, types: Iterable[EventType] = ()) -> None:
        declared: dict[str, EventType] = {}
        for event_type in types:
            if not isinstance(event_type, EventType):
                raise ConfigError(f"not an EventType: {event_type!r}")
            other = declared.get(event_type.name)
            if other is not None and other != event_type:
                raise ConfigError(f"event type {event_type.name!r} is declared twice, differently")
            declared[event_type.name] = event_type
        self._types = declared
        names = tuple(declared)
        self._compiled = {name: _Compiled(t, names) for name, t in declared.items()}

    def __iter__(self) -> Iterator[EventType]:
        return iter(self._types.values())

    def __len__(self) -> int:
        return len(self._types)

    def __contains__(self, name: object) -> bool:
        return name in self._types

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EventTypes) and self._types == other._types

    def __hash__(self) -> int:
        return hash(frozenset(self._types.values()))

    def __or__(self, other: EventTypes) -> EventTypes:
        return EventTypes([*self, *other])

    def __repr__(self) -> str:
        return f"EventTypes({', '.join(self._types)})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._types)

    def get(self, name: str) -> EventType | None:
        """The declaration of *name*, or None."""
        return self._types.get(name)

    def schema(self, name: str) -> dict[str, Any]:
        """The JSON Schema of a whole envelope of type *name* (KeyError if undeclared)."""
        return self._types[name].envelope_schema(self.names)

    def from_mapping(self, obj: Mapping[str, Any]) -> Envelope:
        """Validate a decoded envelope and return its Envelope, or raise Rejection."""
        # The hot path of every delivery: keep it lean (bench/bench_replay.py).
        try:
            canonical = orjson.dumps(obj, option=_CANONICAL)
        except (orjson.JSONEncodeError, TypeError) as exc:  # only reachable from Python callers
            raise Rejection(
                INVALID_ENVELOPE, f"envelope cannot be written as JSON: {exc}", event_id=_event_id_of(obj)
            ) from None
        digest = hashlib.sha256(canonical).hexdigest() if "meta" not in obj else _meta_free_digest(obj)
        kind: Any = obj.get("type")  # a str once checked
        compiled = self._compiled.get(kind) if type(kind) is str else None
        if compiled is None or not compiled.quick(obj):
            compiled = self._check(obj, digest, compiled)
        # tuple.__new__ is what Envelope(...) calls, without its Python frame.
        # A type without revision has no "revision" field (the schema refuses one).
        return _new_tuple(Envelope, (
            obj["eventId"], kind, obj[compiled.key], obj.get("revision", 0), obj["occurredAt"], obj["data"],
            obj, canonical, digest, compiled.type, None, (),
        ))

    def _check(self, obj: Mapping[str, Any], digest: str, compiled: _Compiled | None) -> _Compiled:
        """The rejection of an envelope the quick check did not accept, if
        it is refused: an unknown type first, then the schema, then a
        revision written as a float. Returns the type's checks otherwise."""
        kind = obj.get("type")
        if compiled is None and isinstance(kind, str):
            compiled = self._compiled.get(kind)
            if compiled is None:
                raise Rejection(UNKNOWN_TYPE, f"type {kind[:64]!r} is not a known event type",
                                event_id=_event_id_of(obj), fingerprint=digest)
        # A type that is not a string: any type's schema names what is wrong.
        checks = compiled or next(iter(self._compiled.values()), None)
        if checks is None:
            raise Rejection(INVALID_ENVELOPE, "type must be a string naming an event type",
                            event_id=_event_id_of(obj), fingerprint=digest)
        try:
            checks.validate(obj)
        except fastjsonschema.JsonSchemaValueException as exc:
            raise Rejection(INVALID_ENVELOPE, _schema_reason(exc, key=checks.key),
                            event_id=_event_id_of(obj), fingerprint=digest) from None
        assert compiled is not None  # the schema's enum holds only declared names
        if compiled.revision and type(obj["revision"]) is not int:  # 1.0 passes JSON Schema's "integer"
            raise Rejection(INVALID_ENVELOPE, "revision must be written as a JSON integer",
                            event_id=_event_id_of(obj), fingerprint=digest)
        return compiled


def _material(name: str) -> EventType:
    return EventType(name, key="articleId", data=load_schema()["properties"]["data"], revision=True,
                     description="the state of one material at one revision")


#: Declarations whose schema is the shipped file's: compiled at their first
#: refusal only (start-up time counts; bench/bench_replay.py).
_SHIPPED: Final = frozenset({_material("material.published"), _material("material.withdrawn")})
#: The material types (``material.published``, ``material.withdrawn``), keyed
#: by ``articleId``, with a revision: the built-in consumers' declaration.
MATERIAL: Final = EventTypes(sorted(_SHIPPED, key=lambda t: t.name))

_declared: list[EventType] = []
_default: EventTypes | None = None


def declare(*types: EventType) -> None:
    """Add *types* to :func:`default_types` (a producer's own types)."""
    global _default
    EventTypes([*(_default or MATERIAL), *_declared, *types])  # refuses a conflict now
    _declared.extend(types)
    _default = None


def default_types() -> EventTypes:
    """The types a producer may send when it names none: :data:`MATERIAL`,
    the installed ones (entry points of :data:`ENTRY_POINT_GROUP`) and those
    given to :func:`declare`."""
    global _default
    if _default is None:
        _default = EventTypes([*MATERIAL, *_installed(), *_declared])
    return _default


def _installed() -> list[EventType]:
    # Imported here: importlib.metadata is slow to import, and consumers never need it.
    from importlib.metadata import entry_points

    found: list[EventType] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
        except Exception as exc:
            raise ConfigError(f"event types entry point {ep.name!r} ({ep.value}): cannot load: {exc}") from None
        loaded = getattr(loaded, "TYPES", loaded)
        items = [loaded] if isinstance(loaded, EventType) else list(loaded) if isinstance(loaded, Iterable) else []
        if not items or not all(isinstance(item, EventType) for item in items):
            raise ConfigError(f"event types entry point {ep.name!r} ({ep.value}): not an EventType,"
                              " EventTypes or module with TYPES")
        found.extend(items)
    return found


__all__ = [
    "CORE_FIELDS",
    "ENTRY_POINT_GROUP",
    "MATERIAL",
    "META_FIELDS",
    "CloudEventId",
    "EventType",
    "EventTypes",
    "declare",
    "default_types",
    "quick_check",
]
