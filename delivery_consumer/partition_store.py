"""The databases of a partitioned consumer: where they are, what they say.

Layout: ``<root>/<consumer>/p<k>/inbox.db`` for k in 0 .. count-1, each
recording its consumer, partition and count (store.py refuses to open it as
another). Changing the count (:func:`repartition`) is in this module too.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import sqlite
from .errors import ConfigError, DatabaseError
from .partitions import SLOT_COUNT, Identity, check_count, partition_of, partition_of_slot
from .placement import STATE, resolve


def repartitioned_from(path: Path) -> str | None:
    """The count the partition database *path* was repartitioned from (``"unpartitioned"``
    from a plain consumer); None when it never was, or does not exist."""
    if not path.is_file():
        return None
    with sqlite.reading(path, what="read its former partition count") as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = 'repartitioned_from'").fetchone()
    return str(row[0]) if row else None


# -- changing the partition count ---------------------------------------------------------


@dataclass
class Moved:
    """What :func:`split_merge` wrote: rows per new partition and table."""

    old_count: int
    new_count: int
    rows: dict[int, dict[str, int]] = field(default_factory=dict)
    backup: Path | None = None
    #: The consumer was not partitioned before (state/<consumer>/inbox.db).
    from_unpartitioned: bool = False


#: Tables every partition keeps whole: the CloudEvents sources seen (trace looks an id up by them).
EVERYWHERE = ("ce_sources",)


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
    elif "article_id" in names:
        key = "t.article_id"
    elif "event_id" in names:
        key = "(SELECT i.partition_key FROM old.inbox i WHERE i.event_id = t.event_id)"
    else:
        key = "NULL"
    return columns, key


def split_merge(consumer: str, new_count: int, root: Path | None = None) -> Moved:
    """Rewrite the partition databases of *consumer* for *new_count* partitions.

    Every row follows its key: ``partition_key`` (receipts), ``article_id``
    (catalog, audit, fence) or, for a row that only names an event, the key
    of that event's receipt. A row without any key (a rejection of a body
    that never parsed, a delivery count of such a body) stays with a new
    partition that the old one's slots go to; a receipt without a key (one
    written before keys were stored) is copied to every such partition, so
    a redelivery is answered ``duplicate`` wherever it lands.

    An unpartitioned consumer (``<consumer>/inbox.db``) counts as one
    partition: this is how a consumer that outgrew one process is split.

    The new databases are built beside the old ones and swapped in by
    renaming directories; the old ones are kept in ``<consumer>/repartitioned-
    <old>to<new>-<time>/`` for the operator to delete. The caller has made sure
    nothing runs on them (the queues are drained and unconsumed).
    """
    from .consumers import open_db  # the store imports this package's partitions module
    from .inbox import counters

    check_count(new_count)
    base = (root if root is not None else STATE) / consumer
    paths = resolve(consumer, root=root).checked()
    plain = base / "inbox.db"
    if paths is None and plain.is_file():
        paths = [plain]
    if paths is None:
        raise ConfigError(f"{base}: no database of {consumer} here (inbox.db or p0/inbox.db ...)")
    old_count = len(paths)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    staging = base / f".repartition-{old_count}to{new_count}-{stamp}"
    moved = Moved(old_count, new_count, from_unpartitioned=paths == [plain])
    for k in range(new_count):
        open_db(staging / f"p{k}" / "inbox.db", consumer, create=True,
                        partition=Identity(k, new_count)).close()
    for k in range(new_count):
        conn = sqlite.connect(staging / f"p{k}" / "inbox.db")
        conn.create_function("dc_partition", 1, lambda key: partition_of(key, new_count) if key is not None else None,
                             deterministic=True)
        counts = moved.rows.setdefault(k, {})
        try:
            for old, path in enumerate(paths):
                keyless = _candidates(old, old_count, new_count)
                conn.execute("ATTACH DATABASE ? AS old", (str(path),))  # not inside a transaction
                with sqlite.transaction(conn, translated=False):  # worded below
                    tables = [r[0] for r in conn.execute(
                        "SELECT name FROM old.sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                        f" AND name NOT IN ('meta', {', '.join(repr(t) for t in counters.TABLES)})")]
                    for table in tables:
                        columns, key = _table_plan(conn, table)
                        cols = ", ".join(f'"{c}"' for c in columns)
                        picked = ", ".join(f't."{c}"' for c in columns)
                        # a keyless receipt: a copy in every candidate; any other keyless row: the first one
                        stays = k in keyless if table == "inbox" else k == keyless[0]
                        where = f"coalesce(dc_partition({key}) = {k}, {1 if stays else 0})"
                        if table in EVERYWHERE:
                            where = "1"
                        verb = "INSERT OR IGNORE" if table in ("deliveries", *EVERYWHERE) else "INSERT"
                        cur = conn.execute(f'{verb} INTO main."{table}" ({cols}) SELECT {picked} FROM old."{table}" t'
                                           f" WHERE {where}")
                        counts[table] = counts.get(table, 0) + max(cur.rowcount, 0)
                conn.execute("DETACH DATABASE old")
            with sqlite.transaction(conn, translated=False):  # the receipt counters of the receipts moved here
                counters.rebuild(conn)
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('repartitioned_from', ?)",
                         ("unpartitioned" if moved.from_unpartitioned else str(old_count),))
        except sqlite3.Error as exc:
            sqlite.rollback(conn)
            raise DatabaseError(f"{staging / f'p{k}' / 'inbox.db'}: cannot move rows: {exc}; "
                                f"the old databases are unchanged (delete {staging})") from None
        finally:
            conn.close()
    backup = base / f"repartitioned-{old_count}to{new_count}-{stamp}"
    backup.mkdir()
    if moved.from_unpartitioned:
        for name in ("inbox.db", "inbox.db-wal", "inbox.db-shm"):  # the WAL belongs with its database
            if (base / name).exists():
                (base / name).rename(backup / name)
    for k in range(0 if moved.from_unpartitioned else old_count):
        (base / f"p{k}").rename(backup / f"p{k}")
    for k in range(new_count):
        (staging / f"p{k}").rename(base / f"p{k}")
    staging.rmdir()
    moved.backup = backup
    return moved
