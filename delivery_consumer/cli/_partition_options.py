"""``--partition`` / ``--partitions`` of the commands that serve one partition."""

from __future__ import annotations

from pathlib import Path

import click

from ..amqp.partitions import SLOT_COUNT, Identity
from ..amqp.topology import Topology
from ..model.errors import ConfigError, DeliveryError
from ..store.placement import database, resolve
from ._common import F, Fatal, deployment


def partition_options(fn: F) -> F:
    fn = click.option("--partitions", type=click.IntRange(1, SLOT_COUNT), envvar="DELIVERY_PARTITIONS",
                      help="The consumer's partition count (default: the one the partition's database records; "
                           "needed to create it).")(fn)
    fn = click.option("--partition", type=click.IntRange(0, SLOT_COUNT - 1), envvar="DELIVERY_PARTITION",
                      help="Serve partition K of a partitioned consumer: queue <prefix>.<consumer>.p<K>, database "
                           "state/<consumer>/p<K>/inbox.db.")(fn)
    return fn


def partition_identity(consumer: str, partition: int | None, count: int | None, db: Path | None,
                       broker: tuple[str, Topology] | None = None) -> Identity | None:
    """:func:`~delivery_consumer.service.launch.partition_identity` in the command line's words:
    exit 2 in one line, 75 when only the broker's silence keeps the count unknown."""
    from ..service.launch import FLAGS, CountUnknown
    from ..service.launch import partition_identity as identity

    try:
        return identity(consumer, partition, count, db, broker, spelling=FLAGS)
    except CountUnknown as exc:
        raise (_Unavailable if exc.unavailable else Fatal)(str(exc)) from None
    except ConfigError as exc:
        raise Fatal(str(exc)) from None


class _Unavailable(Fatal):
    """The broker did not answer: not a configuration error, a supervisor may start the run again."""

    exit_code = 75  # EX_TEMPFAIL, as run's own for a store outage


def one_partition_option(fn: F) -> F:
    """``--partition K`` of a command that serves one partition's queues and database."""
    return click.option("--partition", type=click.IntRange(0, SLOT_COUNT - 1), envvar="DELIVERY_PARTITION",
                        help="Partition K of a partitioned consumer: its queues <prefix>.<consumer>.p<K>.* and "
                             "its database state/<consumer>/p<K>/inbox.db.")(fn)


def one_partition(consumer: str | None, db_path: Path | None, partition: int | None, what: str) -> Path | None:
    """The database a one-partition command uses; a partitioned consumer
    without --partition (or --db) is refused in one line. A PostgreSQL URL is its own
    answer: a partition's inbox there is the schema its ``?schema=`` names."""
    if isinstance(db_path, str):  # postgresql://... (docs/postgres-inbox.md)
        if partition is not None:
            from ..inbox.pg import redact

            raise Fatal(f"{redact(db_path)}: --partition names a file; name a partition's schema in the URL "
                        f"(?schema=dc_{consumer or '<consumer>'}_p<K>of<N>) to {what}")
        return db_path
    if partition is not None:
        return database(consumer or "", partition, db_path)
    if consumer is None:
        return db_path
    found = deployment()
    entry = found.consumer(consumer) if found is not None else None
    if found is not None and entry is not None and entry.partitions is not None and db_path in (None, entry.db):
        raise Fatal(f"{found.key(f'consumers.{consumer}')}: {consumer} is partitioned ({entry.partitions} "
                    f"partitions): give --partition K to {what} (each partition has its own queues and database)")
    if db_path is not None and not db_path.is_dir():
        return db_path
    try:  # the deployment file's directory, else --db's, else state/<consumer>/ of the working directory
        file = entry.db if entry is not None and isinstance(entry.db, Path) else None
        paths = resolve(consumer, db_path if db_path is not None else file).checked()
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None
    if paths is not None:
        raise Fatal(f"{consumer} is partitioned here ({len(paths)} partitions): give --partition K to {what} "
                    "(each partition has its own queues and database)")
    return db_path
