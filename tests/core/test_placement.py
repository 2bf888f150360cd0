"""placement.resolve is the one answer to where a consumer's databases are: one definition of a partition
directory, the same databases for the deployment view and the read commands, the count and the queues."""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delivery_consumer import consumers
from delivery_consumer.amqp.partitions import Identity
from delivery_consumer.model.errors import ConfigError, DatabaseError
from delivery_consumer.ops.deployment import parse
from delivery_consumer.store.placement import beside, database, partition_dirs, resolve, stored_identity


def make_partitions(directory: Path, count: int, consumer: str = "audit") -> None:
    """Real partition databases ``p0 .. p<count-1>/inbox.db`` of *consumer*, each recording its identity."""
    for k in range(count):
        consumers.open_db(directory / f"p{k}" / "inbox.db", consumer, create=True,
                          partition=Identity(k, count)).close()


def test_a_copy_named_p01_beside_the_partitions_is_not_a_partition(tmp_path: Path) -> None:
    """A directory holding partitions p0, p1 of 2 and a copy p01/ (and p²/, which int() cannot read): the
    deployment view and the read commands both see p0 and p1, the queues of each partition its own.

    The two scanners this replaces disagreed here: the deployment file's (``name[1:].isdigit()``) listed
    p01 as a third database served by p1's queues and raised ValueError on p²; the read commands'
    (``p(\\d+)``) counted three files for a count of 2 and refused them as an interrupted repartition."""
    directory = tmp_path / "audit"
    make_partitions(directory, 2)
    shutil.copytree(directory / "p1", directory / "p01")
    shutil.copytree(directory / "p1", directory / "p²")

    found = resolve("audit", directory, base=consumers.topology("audit"))
    assert found.databases == (("p0", directory / "p0" / "inbox.db"), ("p1", directory / "p1" / "inbox.db"))
    assert found.checked() == [directory / "p0" / "inbox.db", directory / "p1" / "inbox.db"]
    assert found.count() == 2
    queues = [topo.queue for _partition, _path, topo in found.topologies()]
    assert queues == ["delivery.audit.p0", "delivery.audit.p1"]

    file = tmp_path / "delivery.toml"
    dep = parse({"consumers": {"audit": {"db": "audit"}}}, file)
    assert dep.placement("audit").databases == found.databases


@settings(max_examples=60, deadline=None)
@given(st.sets(st.text(alphabet="p019²x", min_size=1, max_size=4), max_size=6))
def test_a_partition_directory_is_p_and_its_number_in_canonical_ascii(names: set[str]) -> None:
    """partition_dirs lists exactly the directories named p<k> with k written as str(k) would write it, by k."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in names:
            (root / name).mkdir()
        (root / "p7").touch()  # a file named like a partition is not one
        expected = sorted((int(n[1:]), root / n) for n in names
                          if n[:1] == "p" and n[1:].isascii() and n[1:].isdigit() and n == f"p{int(n[1:])}")
        assert partition_dirs(root) == expected


def test_the_declared_count_names_every_partition_before_it_exists(tmp_path: Path) -> None:
    """With the file's count, the databases are p0 .. p<N-1> of the directory, none of them on disk yet."""
    found = resolve("audit", tmp_path / "audit", declared=3, base=consumers.topology("audit", prefix="x"))
    assert found.paths() == [tmp_path / "audit" / f"p{k}" / "inbox.db" for k in range(3)]
    assert found.count() == 3 and found.partitioned
    assert [t.queue for _p, _d, t in found.topologies()] == ["x.audit.p0", "x.audit.p1", "x.audit.p2"]
    assert found.checked() is None  # nothing on disk to check


def test_without_a_path_the_plain_database_wins_and_the_partitions_beside_it_are_named(tmp_path: Path) -> None:
    """Under state/<consumer>/: the inbox.db when there is one (the partitions beside it are only named by
    beside()), the partitions when there is none, else the inbox.db to create."""
    state = tmp_path / "state"
    assert resolve("audit", root=state).databases == ((None, state / "audit" / "inbox.db"),)
    make_partitions(state / "audit", 2)
    partitioned = resolve("audit", root=state)
    assert partitioned.checked() == [state / "audit" / "p0" / "inbox.db", state / "audit" / "p1" / "inbox.db"]
    consumers.open_db(state / "audit" / "inbox.db", "audit", create=True).close()
    plain = resolve("audit", root=state)
    assert plain.databases == ((None, state / "audit" / "inbox.db"),) and not plain.partitioned
    assert plain.checked() is None and plain.count() is None
    assert beside(state / "audit" / "inbox.db") == partitioned.checked()


def test_partition_databases_that_disagree_on_their_count_are_refused(tmp_path: Path) -> None:
    """Two partitions of 3 in a directory (one missing): DatabaseError naming the directory and each file."""
    directory = tmp_path / "audit"
    for k in range(2):
        consumers.open_db(directory / f"p{k}" / "inbox.db", "audit", create=True,
                          partition=Identity(k, 3)).close()
    with pytest.raises(DatabaseError, match=f"the partition databases in {directory} do not agree"):
        resolve("audit", directory).checked()


def test_one_partition_database_is_inside_a_directory_or_the_file_given(tmp_path: Path) -> None:
    """database(): p<k>/inbox.db in a directory, the file as given, else state/<consumer>/p<k>/inbox.db."""
    (tmp_path / "d").mkdir()
    assert database("audit", 2, tmp_path / "d") == tmp_path / "d" / "p2" / "inbox.db"
    assert database("audit", 2, tmp_path / "f.db") == tmp_path / "f.db"
    assert database("audit", 2, None) == Path("state") / "audit" / "p2" / "inbox.db"
    assert database("audit", None, None) == Path("state") / "audit" / "inbox.db"


def test_the_queues_are_known_only_when_asked_for(tmp_path: Path) -> None:
    """A placement resolved from a database alone (no registered consumer's queues given) refuses to guess them."""
    found = resolve(None, tmp_path / "x.db")
    assert found.databases == ((None, tmp_path / "x.db"),) and not found.partitioned
    with pytest.raises(ConfigError, match="the queues of this database were not asked for"):
        found.topologies()


def test_a_partition_database_being_created_records_no_partition_yet(tmp_path: Path) -> None:
    """A standby started beside its active run reads a partition database that the run is still
    creating (the file exists, its tables not yet committed): it records no partition yet (the count
    then comes from the broker), never an error that stops the standby."""
    path = tmp_path / "catalog" / "p0" / "inbox.db"
    path.parent.mkdir(parents=True)
    creating = sqlite3.connect(path, isolation_level=None)
    creating.execute("PRAGMA journal_mode = WAL")
    assert stored_identity(path) is None  # the file alone
    creating.execute("BEGIN IMMEDIATE")
    creating.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    assert stored_identity(path) is None  # its tables in a transaction not committed yet
    creating.execute("ROLLBACK")
    creating.close()
    path.unlink()
    consumers.open_db(path, "catalog", create=True, partition=Identity(0, 4)).close()
    assert stored_identity(path) == Identity(0, 4)
