"""The databases of a partitioned consumer: where they are, what they say.

Layout: ``<root>/<consumer>/p<k>/inbox.db`` for k in 0 .. count-1, each
recording its consumer, partition and count (store.py refuses to open it as
another). Changing the count (:func:`repartition`) is in this module too.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from urllib.parse import quote

from .errors import DatabaseError
from .partitions import Identity, identity_from_meta
from .partitions import db_path as partition_db_path

_PARTITION_DIR = re.compile(r"p(\d+)")


def stored_identity(path: Path) -> Identity | None:
    """The partition identity *path* records; None when it records none or does not exist."""
    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT key, value FROM meta WHERE key IN ('partition', 'partition_count')")
            return identity_from_meta(dict(rows.fetchall()))
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise DatabaseError(f"{path}: cannot read its partition: {exc}") from None


def partition_paths(consumer: str, root: Path | None = None) -> list[Path]:
    """The partition databases of *consumer* under *root* (``state``), by partition."""
    base = (root if root is not None else Path("state")) / consumer
    if not base.is_dir():
        return []
    found = sorted((int(m.group(1)), d / "inbox.db") for d in base.iterdir()
                   if (m := _PARTITION_DIR.fullmatch(d.name)) and (d / "inbox.db").is_file())
    return [path for _k, path in found]


def partitioned_paths(consumer: str | None, db_path: Path | None, root: Path | None = None) -> list[Path] | None:
    """For a command given only ``--consumer``: the partition databases when
    the consumer is partitioned here (no ``state/<consumer>/inbox.db``, some
    ``p<k>/inbox.db``), else None. Checks that they agree on the count."""
    if consumer is None or db_path is not None:
        return None
    base = root if root is not None else Path("state")
    if (base / consumer / "inbox.db").exists():
        return None
    paths = partition_paths(consumer, root)
    if not paths:
        return None
    identities = [stored_identity(p) for p in paths]
    counts = {i.count for i in identities if i is not None}
    if len(counts) != 1 or len(paths) != counts.pop() or any(i is None for i in identities):
        found = ", ".join(f"{p}: {i.describe() if i else 'no partition'}"
                          for p, i in zip(paths, identities, strict=True))
        raise DatabaseError(f"the partition databases of {consumer} do not agree ({found}); "
                            "a repartition may have been interrupted: run it again")
    return [partition_db_path(consumer, k, root) for k in range(len(paths))]
