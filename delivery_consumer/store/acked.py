"""What a consumer acknowledged into its database, recorded outside it: ``<db>.acked``.

A database restored from an older backup, or a new one where the old was
lost, forgets events the broker was told were done: they are gone from the
queue, and nothing inside the restored file can say so. So ``run`` keeps,
beside the real file, a one-line record of the newest receipt it has
acknowledged -- the database's identity (``meta.database_id``) and the rowid
of that receipt (receipts only go up the rowid: prune keeps the newest) --
written at most every second after an ack and at exit, by an atomic rename
(not synced: after a power loss it may be a little behind, never ahead).

At start (:func:`judge`), a database whose newest receipt is older than the
record, or a new empty database where the record names receipts, is
refused in one line saying how to proceed; ``--accept-loss`` accepts it,
logged. Why and the operator's procedure: docs/failures.md, "Restores".
"""

from __future__ import annotations

import os
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from ..model.errors import DatabaseError
from .sqlite import now_iso

SUFFIX = ".acked"


@dataclass(frozen=True)
class Acked:
    """The newest receipt acknowledged: database identity, its rowid, when recorded."""

    database: str
    rowid: int
    at: str

    def line(self) -> str:
        return f"{self.database} {self.rowid} {self.at}\n"


def record_path(db_path: Path | str) -> Path:
    """``<real path of the db>.acked``: every path to the file finds the same record."""
    return Path(f"{os.path.realpath(db_path)}{SUFFIX}")


def read(db_path: Path | str) -> Acked | None:
    """The record beside *db_path*; None when there is none (or it cannot be read)."""
    try:
        words = record_path(db_path).read_text(errors="replace").split()
    except OSError:
        return None
    if len(words) != 3 or not words[1].isdigit():
        return None
    return Acked(words[0], int(words[1]), words[2])


def write(db_path: Path | str, database: str, rowid: int) -> None:
    """Record *rowid* of *database* as acknowledged (atomic; quietly skipped on a full or read-only disk)."""
    path = record_path(db_path)
    temp = Path(f"{path}.{os.getpid()}")
    with suppress(OSError):
        temp.write_text(Acked(database, rowid, now_iso()).line())
        os.replace(temp, path)


def judge(db_path: Path | str, database: str, newest: int, *, created: bool, accept_loss: bool) -> str | None:
    """Compare the database opened (*database*, its *newest* receipt's rowid, *created* now)
    with the record: raise DatabaseError (one line: what and how to proceed) when it has
    lost acknowledged receipts; return a warning to log when it is accepted anyway
    (*accept_loss*) or is another database than the one recorded; None when it is fine."""
    record = read(db_path)
    if record is None or record.rowid == 0:
        return None
    where = f"recorded in {record_path(db_path)}"
    if record.database == database and newest >= record.rowid:
        return None
    if record.database == database:
        what = (f"this database is older than what was acknowledged from it: its newest receipt is number "
                f"{newest}, but receipts up to number {record.rowid} were acknowledged (last at {record.at}, "
                f"{where}) -- a restore of an older backup?")
    elif created or newest == 0:
        what = (f"a new, empty database is here, but receipts up to number {record.rowid} were acknowledged "
                f"into database {record.database} at this path (last at {record.at}, {where}) -- was it deleted?")
    else:
        return (f"{db_path}: another database than the one last acknowledged into at this path ({database}, not "
                f"{record.database}, {where}): adopted; its own receipts answer from now on")
    if accept_loss:
        return (f"{db_path}: {what}; accepting the loss (--accept-loss): the events acknowledged after its newest "
                f"receipt are applied again if they come again, and gone if they do not")
    raise DatabaseError(
        f"{db_path}: {what} The events acknowledged after it are no longer in the queue: replay them from a "
        f"source (delivery-consumer replay, the producers' outbox) and start again, or accept the loss: run "
        f"--accept-loss (logged)")


__all__ = ["SUFFIX", "Acked", "judge", "read", "record_path", "write"]
