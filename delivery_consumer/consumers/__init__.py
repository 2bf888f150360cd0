"""The registry of consumers: one module per domain effect.

A consumer is a :class:`ConsumerSpec`: a name, the forward-only migrations
that create its effect tables, the AMQP binding keys of its queue, and an
``apply`` function. ``apply`` receives an open connection *inside* the
store's transaction and the validated envelope, changes its own tables and
returns a result string (``updated``, ``recorded``, ...). It never commits,
rolls back or opens a transaction: the store owns the boundary. It raises
:class:`~delivery_consumer.errors.Rejection` for a permanent refusal and
:class:`~delivery_consumer.errors.TransientError` to ask for a retry.

Adding a consumer is one module plus its registration, in one of three ways:

* a built-in: a line in ``_BUILTINS`` below;
* an installed plugin: an entry point in the group
  ``delivery_consumer.consumers`` whose value is the module (or the spec);
* ad hoc: ``DELIVERY_PLUGINS=my.module,other.module`` (each module calls
  :func:`register` on import), or :func:`register` from Python.

A spec may carry a :class:`View` of its effect table, as data: the CLI then
offers ``delivery-consumer <name> list|show`` and ``trace`` shows the
consumer's own rows, with no code of the consumer's (see ``views.py``).
"""

from __future__ import annotations

import importlib
import os
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..envelope import Envelope
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..errors import Rejection
    from ..store import ConsumerDB, DeliveryMark, Outcome, WorkHooks

ApplyFn = Callable[[sqlite3.Connection, Envelope], str]
#: Applies several events at once (see ``ConsumerSpec.apply_many``).
ApplyManyFn = Callable[[sqlite3.Connection, Sequence[Envelope]], list[str]]
#: Applies a batch whose effect lives outside the database (fence.py): the
#: parsed deliveries (a Rejection for a body that did not parse), their
#: delivery marks and run's hooks (store.WorkHooks) in, one Outcome per delivery out.
ExternalBatchFn = Callable[
    ["ConsumerDB", Sequence["Envelope | Rejection"], Sequence["DeliveryMark"], "WorkHooks"], list["Outcome"]
]
#: Given the options of ``run`` (``RunConfig.consumer_options``), checks them
#: (ConfigError) and returns the batch function.
ExternalFactory = Callable[[Mapping[str, Any]], ExternalBatchFn]

ENTRY_POINT_GROUP = "delivery_consumer.consumers"
PLUGINS_ENV = "DELIVERY_PLUGINS"


@dataclass(frozen=True)
class View:
    """How ``<consumer> list|show`` and ``trace`` read one effect table.

    Columns are SQL column names of ``table``; rows come out keyed by their
    camelCase form (``article_id`` -> ``articleId``) unless ``rename`` says
    otherwise.
    """

    table: str
    columns: Sequence[str]
    #: ``list`` order: column names (``rowid`` too), ``-`` in front for descending.
    order: Sequence[str] = ()
    #: The unique column ``show KEY`` looks up; None: no ``show``.
    key: str | None = None
    #: The columns of ``list``'s text table (default: all); ``--json`` has all.
    brief: Sequence[str] = ()
    #: Option name -> column: ``list --NAME VALUE`` keeps the rows where it equals VALUE.
    filters: Mapping[str, str] = field(default_factory=dict)
    #: Default ``--limit`` of ``list``; 0 lists every row.
    limit: int = 0
    #: The column holding the articleId: ``show`` of a partitioned consumer
    #: reads the article's partition, ``trace`` shows the article's row.
    article: str | None = None
    #: The column holding the eventId that last wrote the row: ``trace`` finds
    #: the event's article by it.
    event: str | None = None
    #: Column -> output name, where camelCase is not the name wanted.
    rename: Mapping[str, str] = field(default_factory=dict)
    #: Column -> function applied to its stored value (``bool`` for a 0/1 flag).
    decode: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    #: What ``list`` prints when there is no row.
    empty: str = "no rows"


@dataclass(frozen=True)
class ConsumerSpec:
    """Everything the store and the broker need to know about one consumer."""

    name: str
    apply: ApplyFn
    #: Forward-only SQL scripts creating and evolving the effect tables; the
    #: store runs the ones a database has not seen yet, in order. Never edit
    #: or remove a published entry: append a new one.
    migrations: Sequence[str]
    #: Topic-exchange binding keys of the consumer's queue.
    binding_keys: Sequence[str] = ("#",)
    description: str = ""
    #: Optional: the same effect as ``apply`` for several events in one go
    #: (fewer statements). It receives events that have no receipt and
    #: distinct eventIds, in delivery order, and returns exactly the results
    #: ``apply`` would have returned called on each in turn; or it raises
    #: (any error, at any point, even after writing): the store then rolls
    #: the transaction back and applies the batch event by event.
    apply_many: ApplyManyFn | None = None
    #: Effect tables of the consumer (``trace`` shows their rows with an
    #: ``event_id`` column; ``repartition`` moves them by ``article_id``).
    tables: Sequence[str] = field(default_factory=tuple)
    #: For an effect outside the database (an HTTP call, see
    #: ``consumers/webhook.py``): ``run`` applies its batches with this instead
    #: of ``apply`` (the fence protocol of ``fence.py``). None for effects
    #: that live inside the store's transaction.
    external: ExternalFactory | None = None
    #: The view of ``<name> list|show`` and of ``trace``; None: no such commands.
    view: View | None = None


_BUILTINS: dict[str, str] = {
    "catalog": "delivery_consumer.consumers.catalog",
    "audit": "delivery_consumer.consumers.audit",
    "webhook": "delivery_consumer.consumers.webhook",
}
_REGISTRY: dict[str, ConsumerSpec] = {}
_plugins_loaded = False


def register(spec: ConsumerSpec, *, replace: bool = False) -> ConsumerSpec:
    """Make *spec* available by its name; refuses to shadow another spec."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec and not replace:
        raise ConfigError(f"consumer {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Forget a consumer registered at run time (for tests)."""
    _REGISTRY.pop(name, None)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{PLUGINS_ENV}: cannot import {module!r}: {exc}") from None
    # Imported here, not at the top: importlib.metadata costs ~20 ms of
    # start-up, and the built-in consumers never need it (bench/bench_replay.py).
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        loaded = ep.load()
        spec = loaded if isinstance(loaded, ConsumerSpec) else getattr(loaded, "SPEC", None)
        if isinstance(spec, ConsumerSpec):
            register(spec)


def get(name: str) -> ConsumerSpec:
    """The consumer called *name*, or ConfigError listing the known ones."""
    spec = _REGISTRY.get(name)
    if spec is not None:
        return spec
    if name in _BUILTINS:
        module = importlib.import_module(_BUILTINS[name])
        spec = module.SPEC
        return register(spec)
    _load_plugins()
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"unknown consumer {name!r} (known: {', '.join(names())})")
    return spec


def find(name: str) -> ConsumerSpec | None:
    """The consumer called *name*, or None; ConfigError only when a plugin
    cannot be loaded (a built-in never needs the plugins)."""
    if name not in _REGISTRY and name not in _BUILTINS:
        _load_plugins()
        if name not in _REGISTRY:
            return None
    return get(name)


def names() -> list[str]:
    """Names of every consumer that can be used, built-in and registered."""
    _load_plugins()
    return sorted(set(_BUILTINS) | set(_REGISTRY))


__all__ = [
    "ApplyFn", "ApplyManyFn", "ConsumerSpec", "ExternalBatchFn", "ExternalFactory", "View",
    "find", "get", "names", "register", "unregister",
]
