"""``--partition`` / ``--partitions`` of the commands that serve one partition."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ConfigError, DeliveryError
from ..partition_store import partition_db, partitioned_paths, stored_identity
from ..partitions import SLOT_COUNT, Identity, check_partition
from ..topology import Topology
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
    """The partition a command serves, its count read from its database when
    not given, else (a first start) from the count the *broker* (url, the
    consumer's topology) records; None for an unpartitioned consumer.
    Exits 2 with one line."""
    if partition is None:
        if count is not None:
            raise Fatal("--partitions needs --partition K (the partition this command serves)")
        return None
    path = partition_db(consumer, partition, db)
    try:
        stored = stored_identity(path)
        if count is None:
            if stored is None:
                count = _broker_count(path, broker)
            else:
                count = stored.count
        check_partition(partition, count)
    except ConfigError as exc:
        raise Fatal(str(exc)) from None
    return Identity(partition, count)


class _Unavailable(Fatal):
    """The broker did not answer: not a configuration error, a supervisor may start the run again."""

    exit_code = 75  # EX_TEMPFAIL, as run's own for a store outage


def _broker_count(path: Path, broker: tuple[str, Topology] | None) -> int:
    """The count the broker records, for a partition that has no database yet."""
    from ..errors import BrokerError, BrokerUnavailable
    from ..partition_queues import recorded_count

    if broker is None:
        raise Fatal(f"{path}: no partition database yet; give --partitions N to create it")
    url, base = broker
    try:
        count = recorded_count(url, base)
    except BrokerError as exc:
        error = _Unavailable if isinstance(exc, BrokerUnavailable) else Fatal
        raise error(f"{path}: no partition database yet, and the broker cannot tell the count ({exc}); "
                    "give --partitions N, or start again when the broker answers") from None
    if count is None:
        raise Fatal(f"{path}: no partition database yet, and the broker records no partition count for "
                    f"{base.consumer} ({base.count_marker} does not exist): run topology declare --consumer "
                    f"{base.consumer} --partitions N first, or give --partitions N")
    return count


def one_partition_option(fn: F) -> F:
    """``--partition K`` of a command that serves one partition's queues and database."""
    return click.option("--partition", type=click.IntRange(0, SLOT_COUNT - 1), envvar="DELIVERY_PARTITION",
                        help="Partition K of a partitioned consumer: its queues <prefix>.<consumer>.p<K>.* and "
                             "its database state/<consumer>/p<K>/inbox.db.")(fn)


def one_partition(consumer: str | None, db_path: Path | None, partition: int | None, what: str) -> Path | None:
    """The database a one-partition command uses; a partitioned consumer
    without --partition (or --db) is refused in one line."""
    if partition is not None:
        return partition_db(consumer or "", partition, db_path)
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
        paths = partitioned_paths(consumer, db_path if db_path is not None else entry.db if entry else None)
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None
    if paths is not None:
        raise Fatal(f"{consumer} is partitioned here ({len(paths)} partitions): give --partition K to {what} "
                    "(each partition has its own queues and database)")
    return db_path
