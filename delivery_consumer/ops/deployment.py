"""The deployment file: one deployment's broker, consumers and producers.

``delivery.toml`` (read with :mod:`tomllib`) names where everything lives, so
that the system-wide commands (``trace``, ``status``, ``console``) can look
at every database and queue at once, and so that every other command finds
its database and broker without flags::

    amqp_url = "amqp://guest:guest@127.0.0.1:5672/%2F"   # exchange / queue_prefix optional
    # or several nodes: amqp_url = ["amqp://..@rabbit1:5672/%2F", "amqp://..@rabbit2:5672/%2F"]
    # amqp_order = "shuffle"                             # default "in-order"
    [consumers.catalog]
    db = "state/catalog/inbox.db"       # a file, or a directory of partitions p<k>/inbox.db
    [consumers.webhook]
    db = "state/webhook/inbox.db"
    webhook_url = "http://127.0.0.1:8080/notify"
    [consumers.audit]
    db = "state/audit"                  # a partitioned consumer: its directory,
    partitions = 4                      # and its partition count
    [producers.material]
    db = "producer.db"                  # a database holding an outbox (or postgresql://user@host/db)
    [status]
    outbox_max_age = "5m"               # an unpublished row older than this needs a person

Relative paths are relative to the file. Every mistake is one
:class:`ConfigError` naming the file and the key. Which file: ``--config``,
else ``$DELIVERY_CONFIG``, else ``./delivery.toml`` when it exists (the only
one that may be absent). See docs/system-view.md.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

from ..amqp.partitions import SLOT_COUNT
from ..amqp.topology import AMQP_ORDERS, DEFAULT_EXCHANGE, DEFAULT_PREFIX, DEFAULT_URL, AddressError, addresses
from ..model.errors import ConfigError, DeliveryError
from ..store.placement import Placement, resolve

DEFAULT_NAME = "delivery.toml"
ENV = "DELIVERY_CONFIG"
#: Environment variables that override the file's broker settings, as they do
#: for the broker commands' options: ``status``, ``trace`` and the console must
#: look at the broker and queues that ``run`` and ``dispatch`` use.
BROKER_ENV = {"amqp_url": "DELIVERY_AMQP_URL", "exchange": "DELIVERY_EXCHANGE", "queue_prefix": "DELIVERY_QUEUE_PREFIX"}
#: An unpublished outbox row older than this makes ``status`` ask for a person.
DEFAULT_OUTBOX_MAX_AGE_S = 300.0
#: A backlog with consumers listed and no receipt for longer than this makes ``status`` ask for a person.
DEFAULT_RECEIPT_MAX_AGE_S = 120.0
#: The management API's URL from the environment (over the file's ``management_url``).
MANAGEMENT_ENV = "DELIVERY_MANAGEMENT_URL"

_TOP_KEYS = ("amqp_url", "amqp_order", "exchange", "queue_prefix", "management_url", "consumers", "producers", "status")
#: Keys of ``[consumers.NAME]``, with the CLI option each one stands for.
CONSUMER_KEYS: Mapping[str, str] = {"db": "db_path", "webhook_url": "webhook_url", "metrics_port": "metrics_port",
                                    "partitions": "partitions"}
_PRODUCER_KEYS = ("db",)
_STATUS_KEYS = ("outbox_max_age", "backlog_max", "receipt_max_age")


@dataclass(frozen=True)
class ConsumerEntry:
    """``[consumers.NAME]``: the consumer's database (file or partition directory, or a
    PostgreSQL URL as a str: docs/postgres-inbox.md) and its options."""

    name: str
    db: Path | str
    options: dict[str, Any] = field(default_factory=dict)
    #: The partition count the file gives (``partitions = N``): *db* is then the
    #: directory of ``p<k>/inbox.db``, whether they exist yet or not.
    partitions: int | None = None


@dataclass(frozen=True)
class ProducerEntry:
    """``[producers.NAME]``: a database holding an outbox: a SQLite file, or a PostgreSQL URL (a str)."""

    name: str
    db: Path | str


@dataclass(frozen=True)
class Deployment:
    """A parsed deployment file."""

    path: Path
    #: One AMQP URL or several separated by commas (amqp.connection.addresses).
    amqp_url: str = DEFAULT_URL
    #: The order in which several addresses are tried (AMQP_ORDERS); None: the environment's, else in order.
    amqp_order: str | None = None
    exchange: str = DEFAULT_EXCHANGE
    queue_prefix: str = DEFAULT_PREFIX
    management_url: str | None = None
    consumers: dict[str, ConsumerEntry] = field(default_factory=dict)
    producers: dict[str, ProducerEntry] = field(default_factory=dict)
    outbox_max_age_s: float = DEFAULT_OUTBOX_MAX_AGE_S
    #: Ready messages above which a queue with no consumer connected needs a person.
    backlog_max: int = 0
    #: Seconds without a receipt after which a backlog with consumers listed needs a person.
    receipt_max_age_s: float = DEFAULT_RECEIPT_MAX_AGE_S

    def key(self, dotted: str) -> str:
        """``<file>: <key>``, the prefix of every message about the file."""
        return f"{self.path}: {dotted}"

    def consumer(self, name: str) -> ConsumerEntry | None:
        return self.consumers.get(name)

    def placement(self, name: str) -> Placement:
        """Where ``[consumers.<name>]`` lives: its databases by partition and its queues."""
        from ..consumers import topology  # the registry imports the store, which imports the config's placement

        entry = self.consumers[name]
        db = entry.db if isinstance(entry.db, Path) else None  # a PostgreSQL inbox: one schema per partition
        return resolve(name, db, declared=entry.partitions, base=topology(name, self.exchange, self.queue_prefix))

    def single_producer(self) -> ProducerEntry | None:
        """The producer, when the file names exactly one (the producer commands' default)."""
        return next(iter(self.producers.values())) if len(self.producers) == 1 else None


def locate(explicit: str | Path | None = None, *, cwd: Path | None = None) -> tuple[Path | None, bool]:
    """Which file to read: ``(path, required)``; ``(None, False)`` when there is none."""
    if explicit:
        return Path(explicit), True
    env = os.environ.get(ENV)
    if env:
        return Path(env), True
    default = (cwd or Path.cwd()) / DEFAULT_NAME
    return (Path(DEFAULT_NAME), False) if default.is_file() else (None, False)


def load(explicit: str | Path | None = None) -> Deployment | None:
    """The deployment named by ``--config`` / ``$DELIVERY_CONFIG`` / ``./delivery.toml``, or None;
    its broker settings overridden by those of the environment (:data:`BROKER_ENV`)."""
    path, required = locate(explicit)
    if path is None:
        return None
    if not path.is_file():
        how = "--config" if explicit else f"${ENV}" if required else "the default"
        raise ConfigError(f"{path}: no such deployment file (named by {how})")
    found = parse_file(path)
    given = {key: os.environ.get(var) or getattr(found, key) for key, var in BROKER_ENV.items()}
    return replace(found, amqp_url=given["amqp_url"], exchange=given["exchange"], queue_prefix=given["queue_prefix"],
                   management_url=os.environ.get(MANAGEMENT_ENV) or found.management_url)


def parse_file(path: Path) -> Deployment:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    return parse(raw, path)


def _table(value: Any, path: Path, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key}: must be a table ([{key}])")
    return value


def _known(table: Mapping[str, Any], allowed: Any, path: Path, prefix: str) -> None:
    for key in table:
        if key not in allowed:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{path}: {where}: unknown key (known: {', '.join(allowed)})")


def _addresses(raw: Mapping[str, Any], path: Path) -> str | None:
    """``amqp_url``: one URL (several separated by commas) or a list of them, as one address string."""
    value = raw.get("amqp_url")
    if isinstance(value, list):
        if not value or not all(isinstance(one, str) and one.strip() for one in value):
            raise ConfigError(f"{path}: amqp_url: must be a URL or a non-empty list of URLs")
        value = ",".join(one.strip() for one in value)
    elif value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{path}: amqp_url: must be a URL or a non-empty list of URLs")
    if value is not None:
        try:
            addresses(value)
        except AddressError as exc:
            raise ConfigError(f"{path}: amqp_url: {exc}") from None
    return value


def _string(table: Mapping[str, Any], key: str, path: Path, where: str) -> str | None:
    value = table.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{path}: {where}: must be a non-empty string")
    return value


def _is_pg(value: object) -> TypeGuard[str]:
    """Whether a ``db`` value is a PostgreSQL URL rather than a file."""
    return isinstance(value, str) and value.startswith(("postgresql://", "postgres://"))


def _db(table: Mapping[str, Any], base: Path, path: Path, where: str) -> Path:
    text = _string(table, "db", path, f"{where}.db")
    if text is None:
        raise ConfigError(f"{path}: {where}.db: missing (the database path)")
    db = Path(text).expanduser()
    return db if db.is_absolute() else base / db


def _http_url(text: str, path: Path, where: str) -> None:
    """Refuse what httpx cannot ask (status would only show the count as unknown, silently)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{path}: {where}: {text!r} is not an http(s) URL such as http://127.0.0.1:15672")


def parse(raw: Mapping[str, Any], path: Path) -> Deployment:
    """Check *raw* (the file's tables) and resolve its paths against the file's directory."""
    from .. import consumers as registry
    from ..model.durations import parse as parse_duration

    _known(raw, _TOP_KEYS, path, "")
    base = path.parent
    top = {key: _string(raw, key, path, key) for key in ("exchange", "queue_prefix", "management_url")}
    top["amqp_url"] = _addresses(raw, path)
    order = _string(raw, "amqp_order", path, "amqp_order")
    if order is not None and order not in AMQP_ORDERS:
        raise ConfigError(f"{path}: amqp_order: must be one of {', '.join(AMQP_ORDERS)}")
    if top["management_url"] is not None:
        _http_url(top["management_url"], path, "management_url")
    found: dict[str, ConsumerEntry] = {}
    for name, table in _table(raw.get("consumers", {}), path, "consumers").items():
        where = f"consumers.{name}"
        table = _table(table, path, where)
        _known(table, CONSUMER_KEYS, path, where)
        try:
            registry.get(name)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {where}: {exc}") from None
        options = {k: v for k, v in table.items() if k not in ("db", "partitions")}
        if "webhook_url" in options:
            _string(table, "webhook_url", path, f"{where}.webhook_url")
        port = options.get("metrics_port")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535):
            raise ConfigError(f"{path}: {where}.metrics_port: must be a port number (0-65535)")
        partitions = table.get("partitions")
        if partitions is not None and (not isinstance(partitions, int) or isinstance(partitions, bool)
                                       or not 1 <= partitions <= SLOT_COUNT):
            raise ConfigError(f"{path}: {where}.partitions: must be a partition count (1-{SLOT_COUNT})")
        url = table.get("db")
        db: Path | str = url if _is_pg(url) else _db(table, base, path, where)
        found[name] = ConsumerEntry(name, db, options, partitions)
    producers: dict[str, ProducerEntry] = {}
    for name, table in _table(raw.get("producers", {}), path, "producers").items():
        where = f"producers.{name}"
        table = _table(table, path, where)
        _known(table, _PRODUCER_KEYS, path, where)
        url = table.get("db")
        if _is_pg(url):
            producers[name] = ProducerEntry(name, url)
        else:
            producers[name] = ProducerEntry(name, _db(table, base, path, where))
    status = _table(raw.get("status", {}), path, "status")
    _known(status, _STATUS_KEYS, path, "status")
    ages = {"outbox_max_age": DEFAULT_OUTBOX_MAX_AGE_S, "receipt_max_age": DEFAULT_RECEIPT_MAX_AGE_S}
    for key in ages:
        if key not in status:
            continue
        value = status[key]
        # a TOML number is a bare number: seconds, as on the command line
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigError(f'{path}: status.{key}: must be a duration: a string such as "5m", '
                              "or a number of seconds")
        try:
            ages[key] = parse_duration(str(value))
        except ValueError as exc:
            raise ConfigError(f"{path}: status.{key}: {exc}") from None
    backlog = status.get("backlog_max", 0)
    if not isinstance(backlog, int) or isinstance(backlog, bool) or backlog < 0:
        raise ConfigError(f"{path}: status.backlog_max: must be a whole number >= 0")
    seen: dict[Path | str, str] = {}
    for where, db in [*((f"consumers.{n}.db", c.db) for n, c in found.items()),
                      *((f"producers.{n}.db", p.db) for n, p in producers.items())]:
        resolved = db.resolve() if isinstance(db, Path) else db
        if resolved in seen:
            raise ConfigError(f"{path}: {where}: the same database as {seen[resolved]}")
        seen[resolved] = where
    return Deployment(
        path=path,
        amqp_url=top["amqp_url"] or DEFAULT_URL,
        amqp_order=order,
        exchange=top["exchange"] or DEFAULT_EXCHANGE,
        queue_prefix=top["queue_prefix"] or DEFAULT_PREFIX,
        management_url=top["management_url"],
        consumers=found,
        producers=producers,
        outbox_max_age_s=ages["outbox_max_age"],
        backlog_max=backlog,
        receipt_max_age_s=ages["receipt_max_age"],
    )


def _read(path: Path, sql: str) -> list[Any] | None:
    """The rows *sql* reads in *path* (opened read-only), or None when it cannot be read."""
    from ..store import sqlite

    try:
        with sqlite.reading(path) as conn:
            return conn.execute(sql).fetchall()
    except DeliveryError:
        return None


def producer_database(path: Path) -> str | None:
    """``<path>: this is a producer's database ...`` when *path* holds an outbox and no
    consumer inbox (named where a consumer's database belongs), else None."""
    rows = _read(path, "SELECT name FROM sqlite_schema WHERE type = 'table'")
    if rows is None:
        return None
    names = {row[0] for row in rows}
    if "outbox" in names and "meta" not in names:
        return f"{path}: this is a producer's database (it holds an outbox), not a consumer's inbox"
    return None


def stored_owner(path: Path) -> str | None:
    """The consumer a consumer database records (``meta``), or None when it records none or cannot be read."""
    rows = _read(path, "SELECT value FROM meta WHERE key = 'consumer'")
    return str(rows[0][0]) if rows else None


def foreign_databases(deployment: Deployment) -> list[str]:
    """Each database the file gives to a consumer that is another consumer's or a producer's,
    one line naming the file and the key: a mistake in the file, not a state of the system."""
    problems = []
    for entry in deployment.consumers.values():
        for partition, db_path in deployment.placement(entry.name).databases:
            if not db_path.is_file():
                continue
            where = deployment.key(f"consumers.{entry.name}.db" + (f" ({partition})" if partition else ""))
            owner = stored_owner(db_path)
            if owner is not None and owner != entry.name:
                problems.append(f"{where}: {db_path}: this database belongs to consumer {owner!r}, "
                                f"not {entry.name!r}")
            elif owner is None and (foreign := producer_database(db_path)):
                problems.append(f"{where}: {foreign}")
    for name, producer in deployment.producers.items():
        if isinstance(producer.db, Path) and producer.db.is_file() and stored_owner(producer.db) is not None:
            problems.append(f"{deployment.key(f'producers.{name}.db')}: {producer.db}: this is a consumer's inbox "
                            "database, not a producer's")
    return problems


def check_database(deployment: Deployment, entry: ConsumerEntry) -> list[str]:
    """Problems of one consumer's databases (each one line naming the file and key); [] when fine.

    A database not created yet is fine (``run`` creates it); one of another
    consumer, or not a consumer database at all, is not.
    """
    from ..consumers import open_db

    problems = []
    for partition, db_path in deployment.placement(entry.name).databases:
        if not db_path.exists():
            continue
        where = f"consumers.{entry.name}.db" + (f" ({partition})" if partition else "")
        try:
            open_db(db_path, entry.name, readonly=True).close()
        except Exception as exc:  # a DatabaseError, or sqlite3's own for a damaged file
            problems.append(f"{deployment.key(where)}: {exc}")
            continue
        if partition is not None:
            problems += _partition_mismatch(deployment, entry, int(partition[1:]), db_path)
    return problems


def _partition_mismatch(deployment: Deployment, entry: ConsumerEntry, partition: int, db_path: Path) -> list[str]:
    """A partition database that records another place than the one the file gives it."""
    from ..store.placement import stored_identity

    where = f"consumers.{entry.name}.partitions" if entry.partitions else f"consumers.{entry.name}.db"
    try:
        identity = stored_identity(db_path)
    except DeliveryError as exc:
        return [f"{deployment.key(where)}: {exc}"]
    if identity is None:
        return [f"{deployment.key(where)}: {db_path}: records no partition (an unpartitioned consumer's database)"]
    if identity.partition != partition or (entry.partitions is not None and identity.count != entry.partitions):
        said = f"partition {partition} of {entry.partitions}" if entry.partitions else f"partition {partition}"
        return [f"{deployment.key(where)}: {db_path}: records {identity.describe()}, the file makes it {said} "
                "(repartition changes the count)"]
    return []


__all__ = [
    "CONSUMER_KEYS",
    "DEFAULT_NAME",
    "ENV",
    "ConsumerEntry",
    "Deployment",
    "ProducerEntry",
    "check_database",
    "foreign_databases",
    "load",
    "locate",
    "parse",
    "parse_file",
    "producer_database",
    "stored_owner",
]
