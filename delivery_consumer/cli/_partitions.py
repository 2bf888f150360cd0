"""``--partition`` / ``--partitions`` of the commands that serve one partition."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ConfigError
from ..partition_store import partition_db, stored_identity
from ..partitions import SLOT_COUNT, Identity, check_partition
from ._common import F, Fatal


def partition_options(fn: F) -> F:
    fn = click.option("--partitions", type=click.IntRange(1, SLOT_COUNT), envvar="DELIVERY_PARTITIONS",
                      help="The consumer's partition count (default: the one the partition's database records; "
                           "needed to create it).")(fn)
    fn = click.option("--partition", type=click.IntRange(0, SLOT_COUNT - 1), envvar="DELIVERY_PARTITION",
                      help="Serve partition K of a partitioned consumer: queue <prefix>.<consumer>.p<K>, database "
                           "state/<consumer>/p<K>/inbox.db.")(fn)
    return fn


def partition_identity(consumer: str, partition: int | None, count: int | None, db: Path | None) -> Identity | None:
    """The partition a command serves, its count read from its database when
    not given; None for an unpartitioned consumer. Exits 2 with one line."""
    if partition is None:
        if count is not None:
            raise Fatal("--partitions needs --partition K (the partition this command serves)")
        return None
    path = partition_db(consumer, partition, db)
    try:
        stored = stored_identity(path)
        if count is None:
            if stored is None:
                raise Fatal(f"{path}: no partition database yet; give --partitions N to create it")
            count = stored.count
        check_partition(partition, count)
    except ConfigError as exc:
        raise Fatal(str(exc)) from None
    return Identity(partition, count)
