"""Placement: which databases, partitions and queues a consumer has.

One answer, :func:`resolve`, for every reader and writer: ``run``, the
read commands, ``trace``/``status``/``config check`` and the console. Its
inputs are the consumer, the database the command line, the environment or
the deployment file named (a file, or a directory of partitions), and the
partition count the file gives; without a database, the consumer's place
under ``state/``. Layout and rationale: docs/partitions.md.

A partition directory is a directory named ``p<k>``, *k* written in ASCII
digits without a leading zero (``p0``, ``p12``; not ``p01`` nor ``p²``),
holding the partition's ``inbox.db`` (or not yet).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..amqp.partitions import Identity, identity_from_meta, partition_topology
from ..amqp.topology import Topology
from ..model.errors import ConfigError, DatabaseError, DeliveryError
from . import sqlite

#: Where the consumers' databases live unless told otherwise (relative to the working directory).
STATE = Path("state")
#: The database file of a consumer, and of each of its partition directories.
DB_NAME = "inbox.db"

_PARTITION_DIR = re.compile(r"p(0|[1-9][0-9]*)")


def default_db(consumer: str, root: Path | None = None) -> Path:
    """``state/<consumer>/inbox.db`` (under *root* instead of ``state``)."""
    return (root if root is not None else STATE) / consumer / DB_NAME


def partition_db(consumer: str, partition: int, root: Path | None = None) -> Path:
    """``state/<consumer>/p<k>/inbox.db`` (under *root* instead of ``state``)."""
    return in_directory((root if root is not None else STATE) / consumer, partition)


def in_directory(directory: Path, partition: int) -> Path:
    """The database of *partition* in a consumer's *directory*: ``<directory>/p<k>/inbox.db``."""
    return directory / f"p{partition}" / DB_NAME


def partition_dirs(directory: Path) -> list[tuple[int, Path]]:
    """``(k, p<k>/)`` of every partition directory in *directory*, by partition."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in directory.iterdir()
             if (m := _PARTITION_DIR.fullmatch(d.name)) and d.is_dir()]
    return sorted(found)


def stored_identity(path: Path) -> Identity | None:
    """The partition identity the database *path* records; None when it records none, does not exist
    or has no tables yet (another process is creating it: a standby started beside its active run)."""
    if not path.is_file():
        return None
    with sqlite.reading(path, what="read its partition") as conn:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
            return None
        rows = conn.execute("SELECT key, value FROM meta WHERE key IN ('partition', 'partition_count')")
        return identity_from_meta(dict(rows.fetchall()))


def database(consumer: str, partition: int | None, db: Path | None) -> Path:
    """The database a command serving one partition (or the whole unpartitioned consumer) uses:
    *db* as given when it is a file, ``p<k>/inbox.db`` inside it when it is a directory,
    else ``state/<consumer>/p<k>/inbox.db`` (``state/<consumer>/inbox.db`` without a partition)."""
    if partition is None:
        return db if db is not None else default_db(consumer)
    if db is None:
        return partition_db(consumer, partition)
    return in_directory(db, partition) if db.is_dir() else db


@dataclass(frozen=True)
class Placement:
    """Where one consumer lives: its databases by partition (``None`` for an unpartitioned
    consumer's one database, ``"p<k>"`` for a partition's), the partition count the
    deployment file (or a flag) declares, and the queues of the whole consumer."""

    #: None when only a database was named (a read command's ``--db``).
    consumer: str | None
    databases: tuple[tuple[str | None, Path], ...]
    #: The count declared (``partitions = N``), whether the databases exist yet or not; else None.
    declared: int | None = None
    #: The directory the partitions were looked for in (None: a database file was named).
    directory: Path | None = None
    #: The consumer's own queues, when they were asked for (``consumers.topology``).
    base: Topology | None = None

    @property
    def partitioned(self) -> bool:
        return any(partition is not None for partition, _path in self.databases)

    def paths(self) -> list[Path]:
        return [path for _partition, path in self.databases]

    def topology(self) -> Topology:
        """The consumer's own queues."""
        if self.base is None:
            raise ConfigError(f"the queues of {self.consumer or 'this database'} were not asked for")
        return self.base

    def topologies(self) -> list[tuple[str | None, Path, Topology]]:
        """``(partition, database, queues)`` of each database: the consumer's own queues,
        or for a partition ``p<k>`` the queues ``<consumer>.p<k>``."""
        base = self.topology()
        return [(partition, path, base if partition is None else partition_topology(base, int(partition[1:])))
                for partition, path in self.databases]

    def count(self) -> int | None:
        """The partition count: the declared one, else the one the partition databases record
        (the first that can be read); None for an unpartitioned consumer."""
        if self.declared is not None:
            return self.declared
        if not self.partitioned:
            return None
        for identity in self._identities(strict=False):
            if identity is not None:
                return identity.count
        return None

    def checked(self) -> list[Path] | None:
        """The partition databases found in the directory, when they agree on their count
        and none is missing; None for an unpartitioned consumer. DatabaseError when they disagree (a
        repartition interrupted)."""
        if not self.partitioned or self.directory is None:
            return None
        paths = [d / DB_NAME for _k, d in partition_dirs(self.directory) if (d / DB_NAME).is_file()]
        if not paths:
            return None
        identities = self._identities(strict=True, paths=paths)
        counts = {i.count for i in identities if i is not None}
        if len(counts) != 1 or len(paths) != counts.pop() or any(i is None for i in identities):
            found = ", ".join(f"{p}: {i.describe() if i else 'no partition'}"
                              for p, i in zip(paths, identities, strict=True))
            raise DatabaseError(f"the partition databases in {self.directory} do not agree ({found}); "
                                "a repartition may have been interrupted: run it again")
        return [in_directory(self.directory, k) for k in range(len(paths))]

    def _identities(self, *, strict: bool, paths: list[Path] | None = None) -> list[Identity | None]:
        found: list[Identity | None] = []
        for path in paths if paths is not None else self.paths():
            try:
                found.append(stored_identity(path))
            except DeliveryError:
                if strict:
                    raise
        return found


def resolve(consumer: str | None, db: Path | None = None, *, declared: int | None = None,
            base: Topology | None = None, root: Path | None = None) -> Placement:
    """The placement of *consumer*.

    *db*: the database named (a file, or a consumer's directory of partitions); *declared*:
    the partition count the deployment file gives (*db* is then the directory, whether its
    partitions exist yet or not); *base*: the consumer's queues (``consumers.topology``).
    Without *db*, ``<root>/<consumer>/`` (root ``state``): its ``inbox.db`` when it has one,
    else its partition databases, else the ``inbox.db`` to create. A directory named as *db*
    holds partitions unless it holds only an ``inbox.db`` (kept as named, so that opening it
    says what is wrong rather than finding no database).
    """
    def placed(databases: Sequence[tuple[str | None, Path]], directory: Path | None = None) -> Placement:
        return Placement(consumer, tuple(databases), declared, directory, base)

    if db is None:
        if consumer is None:
            raise ConfigError("give --consumer NAME or --db PATH")
        directory = (root if root is not None else STATE) / consumer
        plain = directory / DB_NAME
        if declared is None:
            found = [] if plain.exists() else [(f"p{k}", d / DB_NAME) for k, d in partition_dirs(directory)]
            if any(path.is_file() for _p, path in found):
                return placed(found, directory)
            return placed([(None, plain)])
        db = directory
    if declared is not None:
        return placed([(f"p{k}", in_directory(db, k)) for k in range(declared)], db)
    if not db.is_dir():
        return placed([(None, db)])
    found = [(f"p{k}", d / DB_NAME) for k, d in partition_dirs(db)]
    if found or not (db / DB_NAME).is_file():
        return placed(found, db)
    return placed([(None, db)])


def beside(path: Path) -> list[Path]:
    """The partition databases (``p<k>/inbox.db``) in the directory of the unpartitioned database *path*:
    a consumer partitioned beside its old database, read by mistake through the old one."""
    if path.name != DB_NAME:
        return []
    return [d / DB_NAME for _k, d in partition_dirs(path.parent) if (d / DB_NAME).is_file()]


__all__ = ["DB_NAME", "STATE", "Placement", "beside", "database", "default_db", "in_directory",
           "partition_db", "partition_dirs", "resolve", "stored_identity"]
