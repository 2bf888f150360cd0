"""The registry of consumers: one module per domain effect, found by name.

A consumer is a :class:`~delivery_consumer.model.contract.ConsumerSpec` (its
contract: ``contract.py``). The store never looks consumers up: whoever opens
a database by a consumer's name does it here (:func:`open_db`).

Adding a consumer is one module plus its registration, in one of three ways:

* a built-in: a line in ``_BUILTINS`` below;
* an installed plugin: an entry point in the group
  ``delivery_consumer.consumers`` whose value is the module (or the spec);
* ad hoc: ``DELIVERY_PLUGINS=my.module,other.module`` (each module imported,
  by the import path Python finds it at: its ``SPEC`` registered, or it calls
  :func:`register` on import), or :func:`register` from Python.

A spec may carry a ``View`` of its effect table, as data: the CLI then
offers ``delivery-consumer <name> list|show`` and ``trace`` shows the
consumer's own rows, with no code of the consumer's (see ``views.py``).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from ..amqp.partitions import Identity
from ..amqp.topology import DEFAULT_EXCHANGE, DEFAULT_PREFIX, Topology
from ..inbox.database import ConsumerDB
from ..model.contract import ConsumerSpec
from ..model.errors import ConfigError
from ..store.sqlite import DEFAULT_BUSY_TIMEOUT_MS

ENTRY_POINT_GROUP = "delivery_consumer.consumers"
PLUGINS_ENV = "DELIVERY_PLUGINS"

_BUILTINS: dict[str, str] = {
    "catalog": "delivery_consumer.consumers.catalog",
    "audit": "delivery_consumer.consumers.audit",
    "webhook": "delivery_consumer.consumers.webhook",
}
_REGISTRY: dict[str, ConsumerSpec] = {}
_modules_loaded = False
_entry_points_loaded = False


def register(spec: ConsumerSpec, *, replace: bool = False) -> ConsumerSpec:
    """Make *spec* available by its name; refuses to shadow another spec."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec and not replace:
        raise ConfigError(f"consumer {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def registered(name: str) -> ConsumerSpec | None:
    """The spec registered under *name* now, if any (no plugin is loaded to find it)."""
    return _REGISTRY.get(name)


def unregister(name: str) -> None:
    """Forget a consumer registered at run time (for tests)."""
    _REGISTRY.pop(name, None)


def _load_plugins(wanted: str | None = None) -> None:
    """Import the ``DELIVERY_PLUGINS`` modules, then the entry points unless
    those registered *wanted* (scanning the installed distributions takes
    tens of milliseconds of a run's start-up)."""
    global _modules_loaded, _entry_points_loaded
    if not _modules_loaded:
        _modules_loaded = True
        for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
            try:
                loaded = importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(f"{PLUGINS_ENV}: cannot import {module!r}: {exc}") from None
            spec = getattr(loaded, "SPEC", None)  # a module that names its spec needs no register() call
            if isinstance(spec, ConsumerSpec) and spec.name not in _REGISTRY:
                register(spec)
    if _entry_points_loaded or (wanted is not None and wanted in _REGISTRY):
        return
    _entry_points_loaded = True
    # Imported here, not at the top: importlib.metadata is slow to import, and
    # the built-in consumers never need it (bench/bench_replay.py measures start-up).
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
    _load_plugins(name)
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"unknown consumer {name!r} (known: {', '.join(names())})")
    return spec


def find(name: str) -> ConsumerSpec | None:
    """The consumer called *name*, or None; ConfigError only when a plugin
    cannot be loaded (a built-in never needs the plugins)."""
    if name not in _REGISTRY and name not in _BUILTINS:
        _load_plugins(name)
        if name not in _REGISTRY:
            return None
    return get(name)


def open_db(
    path: Path | str | None = None,
    consumer: str | None = None,
    *,
    create: bool = False,
    readonly: bool = False,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    partition: Identity | None = None,
    unpartitioned: bool = False,
    empty_ok: bool = False,
) -> ConsumerDB:
    """:meth:`ConsumerDB.open` by the consumer's name: the database of
    *consumer*, or of the consumer the database records when no name is given."""
    spec = None
    if consumer is not None and (path is None or not Path(path).is_dir()):
        spec = get(consumer)
    return ConsumerDB.open(path, spec, lookup=get, create=create, readonly=readonly,
                           busy_timeout_ms=busy_timeout_ms, partition=partition, unpartitioned=unpartitioned,
                           empty_ok=empty_ok)


def topology(consumer: str, exchange: str = DEFAULT_EXCHANGE, prefix: str = DEFAULT_PREFIX,
             **extra: Any) -> Topology:
    """The queues of *consumer* (its binding keys) under *exchange* and *prefix*."""
    return Topology(consumer=consumer, binding_keys=tuple(get(consumer).binding_keys), exchange=exchange,
                    prefix=prefix, **extra)


def names() -> list[str]:
    """Names of every consumer that can be used, built-in and registered."""
    _load_plugins()
    return sorted(set(_BUILTINS) | set(_REGISTRY))


__all__ = ["ENTRY_POINT_GROUP", "PLUGINS_ENV", "find", "get", "names", "open_db", "register", "registered", "topology",
           "unregister"]
