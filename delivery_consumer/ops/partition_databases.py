"""The databases of a partitioned consumer: where they are, what they say.

Layout: ``<root>/<consumer>/p<k>/inbox.db`` for k in 0 .. count-1, each
recording its consumer, partition and count (store.py refuses to open it as
another). Changing the count (:func:`split_merge`) is in this module too.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..amqp.partitions import SLOT_COUNT, Identity, check_count, partition_of, partition_of_slot
from ..model.errors import ConfigError, DatabaseError
from ..store import sqlite
from ..store.placement import STATE, resolve

#: The ``meta`` key of a database ``repartition`` wrote whose broker side has not finished yet: the
#: layout it moves to (a count, or ``unpartitioned``). ``run`` refuses the database meanwhile.
PENDING_KEY = "repartition_pending"


def _meta_value(path: Path, key: str) -> str | None:
    if not path.is_file():
        return None
    with sqlite.reading(path, what="read its partition layout") as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return str(row[0]) if row else None


def repartitioned_from(path: Path) -> str | None:
    """The count the database *path* was repartitioned from (``"unpartitioned"``
    from a plain consumer); None when it never was, or does not exist."""
    return _meta_value(path, "repartitioned_from")


def pending_layout(path: Path) -> str | None:
    """The layout (a count, or ``unpartitioned``) of a repartition whose broker side has not
    finished, as the database *path* records it; None when there is none."""
    return _meta_value(path, PENDING_KEY)


def pending_words(layout: str) -> tuple[str, str]:
    """A pending layout (:func:`pending_layout`) in words, and the ``repartition`` option that finishes it."""
    if layout == "unpartitioned":
        return "one unpartitioned consumer", "--unpartitioned"
    return f"{layout} partition" + ("" if layout == "1" else "s"), f"--partitions {layout}"


def finish(paths: list[Path]) -> None:
    """Record in every database of the new layout that its repartition has finished."""
    for path in paths:
        conn = sqlite.connect(path)
        try:
            with sqlite.transaction(conn):
                conn.execute("DELETE FROM meta WHERE key = ?", (PENDING_KEY,))
        finally:
            conn.close()


# -- changing the partition count ---------------------------------------------------------


@dataclass
class Moved:
    """What :func:`split_merge` wrote: rows per new partition and table."""

    old_count: int
    #: None: merged into an unpartitioned consumer.
    new_count: int | None
    rows: dict[int, dict[str, int]] = field(default_factory=dict)
    backup: Path | None = None
    #: The consumer was not partitioned before (state/<consumer>/inbox.db).
    from_unpartitioned: bool = False


#: Tables every partition keeps whole: the CloudEvents sources seen (trace looks an id up by them).
EVERYWHERE = ("ce_sources",)
#: (table, a column's name in an older schema) -> its name now: a database not yet
#: migrated is copied into the new ones under the new name.
RENAMED = {("fence", "article_id"): "entity_key"}


def _candidates(old: int, old_count: int, new_count: int) -> list[int]:
    """The new partitions that slots of old partition *old* go to."""
    slots = [s for s in range(SLOT_COUNT) if partition_of_slot(s, old_count) == old]
    return sorted({partition_of_slot(s, new_count) for s in slots})


def _table_plan(conn: sqlite3.Connection, table: str) -> tuple[list[str], str]:
    """Columns to copy (an INTEGER PRIMARY KEY gets new values) and the key expression."""
    info = conn.execute(f'PRAGMA old.table_info("{table}")').fetchall()
    names = [row[1] for row in info]
    pks = [row for row in info if row[5]]
    rowid_alias = len(pks) == 1 and str(pks[0][2]).upper() == "INTEGER"
    columns = [row[1] for row in info if not (rowid_alias and row[5])]
    if "partition_key" in names:
        key = "t.partition_key"
    elif "entity_key" in names:
        key = "t.entity_key"
    elif "article_id" in names:
        key = "t.article_id"
    elif "event_id" in names:
        key = "(SELECT i.partition_key FROM old.inbox i WHERE i.event_id = t.event_id)"
    else:
        key = "NULL"
    return columns, key


def split_merge(consumer: str, new_count: int | None, root: Path | None = None) -> Moved:
    """Rewrite the databases of *consumer* for *new_count* partitions (None: unpartitioned).

    Every row follows its key: ``partition_key`` (receipts), ``entity_key``
    (fence), ``article_id`` (catalog, audit) or, for a row that only names an event, the key
    of that event's receipt. A row without any key (a rejection of a body
    that never parsed, a delivery count of such a body) stays with a new
    partition that the old one's slots go to; a receipt without a key (one
    written before keys were stored) is copied to every such partition, so
    a redelivery is answered ``duplicate`` wherever it lands (merged again,
    those copies are one receipt).

    An unpartitioned consumer (``<consumer>/inbox.db``) counts as one
    partition: this is how a consumer that outgrew one process is split, and
    what partitions are merged into with *new_count* None.

    The new databases are built beside the old ones and swapped in by
    renaming directories; the old ones are kept in ``<consumer>/repartitioned-
    <old>to<new>-<time>/`` for the operator to delete. Each new one records
    that the broker side is still to do (:data:`PENDING_KEY`; :func:`finish`).
    The caller has made sure nothing runs on them (no consumer on any queue).
    """
    from ..consumers import open_db  # the store imports this package's partitions module
    from ..inbox import counters

    if new_count is not None:
        check_count(new_count)
    base = (root if root is not None else STATE) / consumer
    paths = resolve(consumer, root=root).checked()
    plain = base / "inbox.db"
    if paths is None and plain.is_file():
        paths = [plain]
    if paths is None:
        raise ConfigError(f"{base}: no database of {consumer} here (inbox.db or p0/inbox.db ...)")
    old_count = len(paths)
    from_unpartitioned = paths == [plain]
    if new_count is None and from_unpartitioned:
        raise ConfigError(f"{consumer} is not partitioned: nothing to merge")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = "unpartitioned" if new_count is None else str(new_count)
    staging = base / f".repartition-{old_count}to{target}-{stamp}"
    moved = Moved(old_count, new_count, from_unpartitioned=from_unpartitioned)
    news = [staging / "inbox.db"] if new_count is None else [staging / f"p{k}" / "inbox.db" for k in range(new_count)]
    for k, path in enumerate(news):
        open_db(path, consumer, create=True, partition=None if new_count is None else Identity(k, new_count)).close()
    for k, path in enumerate(news):
        conn = sqlite.connect(path)
        conn.create_function("dc_partition", 1,
                             lambda key: (0 if new_count is None else partition_of(key, new_count))
                             if key is not None else None, deterministic=True)
        counts = moved.rows.setdefault(k, {})
        try:
            for old, old_path in enumerate(paths):
                keyless = [0] if new_count is None else _candidates(old, old_count, new_count)
                conn.execute("ATTACH DATABASE ? AS old", (str(old_path),))  # not inside a transaction
                with sqlite.transaction(conn, translated=False):  # worded below
                    tables = [r[0] for r in conn.execute(
                        "SELECT name FROM old.sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                        f" AND name NOT IN ('meta', {', '.join(repr(t) for t in counters.TABLES)})")]
                    for table in tables:
                        columns, key = _table_plan(conn, table)
                        cols = ", ".join(f'"{RENAMED.get((table, c), c)}"' for c in columns)
                        picked = ", ".join(f't."{c}"' for c in columns)
                        if table in EVERYWHERE:  # whole in every partition
                            cur = conn.execute(f'INSERT OR IGNORE INTO main."{table}" ({cols}) SELECT {picked}'
                                               f' FROM old."{table}" t')
                            counts[table] = counts.get(table, 0) + max(cur.rowcount, 0)
                            continue
                        verb = "INSERT OR IGNORE" if table == "deliveries" else "INSERT"
                        cur = conn.execute(f'{verb} INTO main."{table}" ({cols}) SELECT {picked} FROM old."{table}" t'
                                           f" WHERE dc_partition({key}) = {k}")
                        counts[table] = counts.get(table, 0) + max(cur.rowcount, 0)
                        # a keyless receipt: a copy in every candidate (once); any other keyless row: the first one
                        if k in keyless if table == "inbox" else k == keyless[0]:
                            verb = "INSERT OR IGNORE" if table in ("inbox", "deliveries") else "INSERT"
                            cur = conn.execute(f'{verb} INTO main."{table}" ({cols}) SELECT {picked}'
                                               f' FROM old."{table}" t WHERE {key} IS NULL')
                            counts[table] = counts.get(table, 0) + max(cur.rowcount, 0)
                conn.execute("DETACH DATABASE old")
            with sqlite.transaction(conn, translated=False):  # the receipt counters of the receipts moved here
                counters.rebuild(conn)
                conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [
                    ("repartitioned_from", "unpartitioned" if from_unpartitioned else str(old_count)),
                    (PENDING_KEY, target)])
        except sqlite3.Error as exc:
            sqlite.rollback(conn)
            raise DatabaseError(f"{path}: cannot move rows: {exc}; "
                                f"the old databases are unchanged (delete {staging})") from None
        finally:
            conn.close()
    backup = base / f"repartitioned-{old_count}to{target}-{stamp}"
    backup.mkdir()
    if from_unpartitioned:
        _move_database(plain, backup / "inbox.db")
    for k in range(0 if from_unpartitioned else old_count):
        (base / f"p{k}").rename(backup / f"p{k}")
    if new_count is None:
        _move_database(staging / "inbox.db", plain)
    for k in range(new_count or 0):
        (staging / f"p{k}").rename(base / f"p{k}")
    staging.rmdir()
    moved.backup = backup
    return moved


def _move_database(path: Path, to: Path) -> None:
    """Rename a database file with its WAL and shared memory, which belong with it."""
    for suffix in ("", "-wal", "-shm"):
        source = path.with_name(path.name + suffix)
        if source.exists():
            source.rename(to.with_name(to.name + suffix))
