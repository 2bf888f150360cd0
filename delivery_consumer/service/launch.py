"""Run a consumer from Python: the service ``delivery-consumer run`` starts, for a program's own supervisor or tests.

:func:`run_consumer` is ``run`` without the command line: the same two
processes (:func:`delivery_consumer.service.run.run`), the same handling of
SIGTERM/SIGINT (finish and ack the current batch, return 0) and the same exit
codes (2: a fatal error, told in one line on the ``delivery_consumer.run``
logger; 75: the database stayed unusable past the outage limit). The checks
both share (the consumer, its options, its partition) live here; the CLI only
parses options and prints. Design: docs/run.md, "From Python".
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from .. import consumers
from ..amqp.partitions import Identity, check_partition
from ..amqp.topology import DEFAULT_URL, Topology
from ..model.errors import BrokerError, BrokerUnavailable, ConfigError, DeliveryError, StoreOutage
from ..store.placement import database, stored_identity

if TYPE_CHECKING:
    from ..model.contract import ConsumerSpec

log = logging.getLogger("delivery_consumer.run")

#: Exit codes of ``run`` and of :func:`run_consumer`.
EXIT_OK: Final = 0
EXIT_FATAL: Final = 2
#: The database stayed unusable past the outage limit (sysexits' EX_TEMPFAIL):
#: unlike 2, worth a restart by a supervisor.
EXIT_TEMPFAIL: Final = 75


def checked_spec(consumer: str, consumer_options: dict[str, Any]) -> ConsumerSpec:
    """The registered consumer, its options checked (an external consumer's: e.g. a webhook URL); ConfigError."""
    spec = consumers.get(consumer)
    if spec.external is not None:
        spec.external(consumer_options)
    return spec


@dataclass(frozen=True)
class Spelling:
    """How the partition options are written where the caller took them from."""

    partition: str
    count: str
    count_n: str
    #: What serves the partition.
    server: str


#: ``run``'s command line, and :func:`~delivery_consumer.service.launch.run_consumer`'s arguments.
FLAGS = Spelling("--partition K", "--partitions", "--partitions N", "command")
ARGUMENTS = Spelling("partition=K", "partitions", "partitions=N", "run")


class CountUnknown(ConfigError):
    """A partition with no database yet, and no count given or recorded on the broker."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        #: The broker did not answer: not a configuration error, worth starting again.
        self.unavailable = unavailable


def partition_identity(consumer: str, partition: int | None, count: int | None, db: Path | None,
                       broker: tuple[str, Topology] | None = None, *,
                       spelling: Spelling = ARGUMENTS) -> Identity | None:
    """The partition a run serves, its count read from its database when not given, else (a first
    start) from the count the *broker* (url, the consumer's topology) records; None for an
    unpartitioned consumer. ConfigError (CountUnknown for an unknown count) in one line."""
    if partition is None:
        if count is not None:
            raise ConfigError(f"{spelling.count} needs {spelling.partition} "
                              f"(the partition this {spelling.server} serves)")
        return None
    path = database(consumer, partition, db)
    stored = stored_identity(path)
    if count is None:
        count = stored.count if stored is not None else _broker_count(path, broker, spelling)
    check_partition(partition, count)
    return Identity(partition, count)


def _broker_count(path: Path, broker: tuple[str, Topology] | None, spelling: Spelling) -> int:
    """The count the broker records, for a partition that has no database yet."""
    from ..amqp.partition_queues import recorded_count

    if broker is None:
        raise CountUnknown(f"{path}: no partition database yet; give {spelling.count_n} to create it")
    url, base = broker
    try:
        count = recorded_count(url, base)
    except BrokerError as exc:
        raise CountUnknown(f"{path}: no partition database yet, and the broker cannot tell the count ({exc}); "
                           f"give {spelling.count_n}, or start again when the broker answers",
                           unavailable=isinstance(exc, BrokerUnavailable)) from None
    if count is None:
        raise CountUnknown(f"{path}: no partition database yet, and the broker records no partition count for "
                           f"{base.consumer} ({base.count_marker} does not exist): run topology declare --consumer "
                           f"{base.consumer} --partitions N first, or give {spelling.count_n}")
    return count



def run_consumer(consumer: str, url: str = DEFAULT_URL, db: str | Path | None = None, *,
                 partition: int | None = None, partitions: int | None = None, **options: Any) -> int:
    """Run *consumer* until SIGTERM/SIGINT (or ``exit_when_idle_s``) and return ``run``'s exit code.

    *url*: the broker (``amqp://...``); *db*: its database (default
    ``state/<consumer>/inbox.db`` of the working directory), or a PostgreSQL
    URL (``postgresql://...``: docs/postgres-inbox.md); *partition* /
    *partitions*: serve one partition of a partitioned consumer. *options*:
    the other fields of :class:`~delivery_consumer.service.settings.RunConfig`
    (``exchange``, ``prefix``, ``batch``, ``prefetch``, ``exit_when_idle_s``,
    ``consumer_options``, ...; an unknown name is a TypeError).

    Call it from the main thread (it handles SIGTERM and SIGINT while it runs
    and restores the previous handlers); it forks the worker process. Logs go
    to the program's own logging configuration (loggers ``delivery_consumer.*``);
    pika's logger is silenced unless the program set its level (the toolkit
    words pika's failures itself, in one line).
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_consumer handles SIGTERM/SIGINT: call it from the main thread")
    from ..amqp.partitions import explain
    from ..observability.logs import quiet_pika

    quiet_pika()
    from .run import run
    from .settings import RunConfig

    config: RunConfig | None = None
    try:
        checked_spec(consumer, options.setdefault("consumer_options", {}))
        batch, prefetch = options.get("batch", RunConfig.batch), options.get("prefetch", RunConfig.prefetch)
        if batch > prefetch:
            raise ConfigError(f"batch {batch} cannot fill with prefetch {prefetch}; raise prefetch")
        # postgresql://...: the consumer's inbox in PostgreSQL (docs/postgres-inbox.md)
        db_url = db if isinstance(db, str) and db.startswith(("postgresql://", "postgres://")) else None
        db_path = Path(db) if db is not None and db_url is None else None
        options.setdefault("db_url", db_url)
        config = RunConfig(
            consumer=consumer, url=url,
            db_path=database(consumer, partition, db_path) if partition is not None else db_path, **options,
        )
        config.partition = partition_identity(consumer, partition, partitions, db_path,
                                              broker=(url, config.topology()))
        return run(config)
    except StoreOutage as exc:
        log.error("delivery-consumer: %s", exc)
        return EXIT_TEMPFAIL
    except BrokerError as exc:
        log.error("delivery-consumer: %s", explain(str(exc), config.topology()) if config else exc)
        return EXIT_FATAL
    except (DeliveryError, OSError) as exc:
        log.error("delivery-consumer: %s", exc)
        return EXIT_FATAL


__all__ = ["ARGUMENTS", "EXIT_FATAL", "EXIT_OK", "EXIT_TEMPFAIL", "FLAGS", "CountUnknown", "Spelling", "checked_spec",
           "partition_identity", "run_consumer"]
