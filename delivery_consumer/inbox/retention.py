"""``inbox prune``: bounded retention of receipts, delivery records and resolved rejections.

A receipt is what turns a redelivery into ``duplicate``; once it is gone, the
same message is new again. So a receipt may only go when no copy of its
event can still arrive:

* never younger than the **redelivery horizon** (default 7 days): the longest
  a copy can plausibly take to come back -- a consumer stopped over a long
  weekend, a retry tier, a publisher that re-sends after a lost confirm, a
  restore. ``older_than`` below the horizon is refused;
* never while its event is **in the dead queue** (a requeue would apply it a
  second time), whatever its age: the caller reads the dead queue and passes
  its eventIds (and keeps reading it while pruning, see ``refresh_keep``);
* never while its event has an **unresolved rejection** (``rejected`` row
  without ``resolved_at``): such a copy is in the dead queue or waits for a
  decision; ``dead requeue`` and ``dead purge`` resolve it.

Ages are judged by the receipts' own order as much as by a clock: only a
prefix of the receipts in their order (the rowid) is deleted, never one
written after a younger one (a clock that went back). When this process's
clock and the system's disagree by more than the horizon (a faked clock), when the newest receipt is in
this clock's future by more than the horizon, or the writer recorded that
its clock jumped by more than the horizon after receipts still there
(``meta.clock_jump``: the receipts before the jump would look aged), the
prune is refused (``trust_clock`` overrides it). Why: docs/operating.md,
"Retention".

Old ``deliveries`` rows go with the same rules (their ``last_at`` older than
the cutoff), and so do ``rejected`` rows resolved before the cutoff. Unresolved
rejections are never pruned.

Deletes run in short transactions of ``batch`` rows (default 500, a few
milliseconds each) with a pause after each one as long as the batch took, so a
running consumer -- whose ``BEGIN IMMEDIATE`` waits in SQLite's busy handler --
gets the write lock between batches and keeps committing.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.durations import format as format_duration
from ..model.errors import PruneRefused
from ..store.sqlite import age_s, now_iso
from . import CLOCK_JUMP, ConsumerDB, counters, inbox_rowid_before, keep_high_water

DAY_S = 86400
#: Default redelivery horizon: receipts younger than this are never pruned.
DEFAULT_HORIZON_S = 7 * DAY_S
#: Rows per delete transaction.
DEFAULT_BATCH = 500


def filesystem_now(directory: Path) -> float | None:
    """The system's time as the kernel stamps a new file in *directory* (None: cannot write there):
    a clock of its own, which a process's faked or skewed clock does not change."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".prune-clock-") as probe:
            return os.fstat(probe.fileno()).st_mtime
    except OSError:
        return None


def check_clock(db: ConsumerDB, now: float, horizon_s: float, *, own_clock: bool = True) -> None:
    """Refuse (PruneRefused, one line) when ages cannot be judged: this process's clock and
    the system's (a new file's time) disagree by more than the horizon; the newest receipt is
    in this clock's future by more than the horizon (this clock is behind, or the consumer's
    was ahead); or the writer recorded a jump of its clock by more than the horizon after
    receipts that are still there (their times are off by it: ``meta.clock_jump``).
    *own_clock* False: *now* was given by the caller, not read from this process's clock."""
    system = filesystem_now(Path(db.path).parent) if own_clock else None
    if system is not None and abs(now - system) > horizon_s:
        raise PruneRefused(
            f"this process's clock ({now_iso(now)}) and the system's ({now_iso(system)}, a new file's time) disagree "
            f"by {format_duration(round(abs(now - system)))}, more than the redelivery horizon "
            f"{format_duration(horizon_s)}: ages cannot be judged, nothing deleted (a faked or skewed clock?)")
    row = db.conn.execute("SELECT received_at FROM inbox ORDER BY rowid DESC LIMIT 1").fetchone()
    if row is not None and -age_s(str(row[0]), now) > horizon_s:
        raise PruneRefused(
            f"this clock ({now_iso(now)}) and the receipts' disagree by {format_duration(round(-age_s(row[0], now)))}"
            f", more than the redelivery horizon {format_duration(horizon_s)}: the newest receipt was stamped "
            f"{row[0]}, in this clock's future (this clock is behind, or the consumer's was ahead); nothing "
            f"deleted. Fix the clock, or pass --trust-clock if the receipts' times are right")
    jump = db.conn.execute("SELECT value FROM meta WHERE key = ?", (CLOCK_JUMP,)).fetchone()
    if jump is not None:
        rowid, moved, at = str(jump[0]).split()
        oldest = db.conn.execute("SELECT min(rowid) FROM inbox").fetchone()[0]
        if abs(float(moved)) > horizon_s and oldest is not None and oldest <= int(rowid):
            raise PruneRefused(
                f"the consumer's clock jumped {format_duration(round(abs(float(moved))))} "
                f"{'ahead' if float(moved) > 0 else 'back'} at {at} (after receipt {rowid}), more than the redelivery "
                f"horizon {format_duration(horizon_s)}: the receipts written before it carry times that are off by "
                f"that much; nothing deleted. Pass --trust-clock once they are truly old")


def check_older_than(older_than_s: float, horizon_s: float) -> None:
    """Refuse an age below the redelivery horizon, explaining why."""
    if older_than_s < horizon_s:
        raise PruneRefused(
            f"--older-than {format_duration(older_than_s)} is shorter than the redelivery horizon "
            f"{format_duration(horizon_s)}: a copy of an event can still arrive that late (a stopped consumer, "
            "a retry, a publisher re-sending after a lost confirm), and without its receipt it would be "
            "applied again. Prune older receipts only, or lower the horizon (--horizon) if you know "
            "redeliveries cannot be that old"
        )


@dataclass
class PruneReport:
    """What a prune removed (or, with ``dry_run``, would remove)."""

    consumer: str
    database: str
    cutoff: str
    older_than_s: float
    horizon_s: float
    dry_run: bool
    dead_queue: str | None  # None: the dead queue was not read (override)
    receipts: int = 0
    kept_in_dead_queue: int = 0
    kept_unresolved: int = 0
    deliveries: int = 0
    rejections: int = 0
    batches: int = 0
    seconds: float = 0.0
    dead_letters: int = 0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer, "database": self.database, "cutoff": self.cutoff,
            "olderThan": format_duration(self.older_than_s), "horizon": format_duration(self.horizon_s),
            "dryRun": self.dry_run, "deadQueue": self.dead_queue, "deadLetters": self.dead_letters,
            "receipts": self.receipts, "keptInDeadQueue": self.kept_in_dead_queue,
            "keptUnresolved": self.kept_unresolved, "deliveries": self.deliveries, "rejections": self.rejections,
            "batches": self.batches, "seconds": round(self.seconds, 3), "notes": self.notes,
        }


_UNRESOLVED = "EXISTS (SELECT 1 FROM rejected r WHERE r.event_id = {col} AND r.resolved_at IS NULL)"
_KEPT = "{col} IN (SELECT event_id FROM temp.prune_keep)"

# ``rowid <= :last`` (see inbox.inbox_rowid_before) lets SQLite read the inbox
# from its start instead of scanning it all; ``received_at < :cutoff`` stays
# the exact rule.
_RECEIPTS = (
    "SELECT event_id FROM inbox WHERE rowid <= :last AND received_at < :cutoff"
    f" AND NOT {_KEPT.format(col='inbox.event_id')} AND NOT {_UNRESOLVED.format(col='inbox.event_id')}"
)
_DELIVERIES = (
    "SELECT key FROM deliveries WHERE last_at < :cutoff AND (deliveries.event_id IS NULL OR ("
    f"NOT {_KEPT.format(col='deliveries.event_id')} AND NOT {_UNRESOLVED.format(col='deliveries.event_id')}))"
)
_REJECTIONS = "SELECT id FROM rejected WHERE resolved_at IS NOT NULL AND resolved_at < :cutoff"

_DELETES = (
    ("receipts", f"DELETE FROM inbox WHERE event_id IN ({_RECEIPTS} ORDER BY rowid LIMIT :batch)"
                 " RETURNING received_at, result"),
    ("deliveries", f"DELETE FROM deliveries WHERE key IN ({_DELIVERIES} ORDER BY last_at LIMIT :batch)"),
    ("rejections", f"DELETE FROM rejected WHERE id IN ({_REJECTIONS} ORDER BY id LIMIT :batch)"),
)


def _set_keep(db: ConsumerDB, event_ids: Iterable[str]) -> None:
    conn = db.conn
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS prune_keep (event_id TEXT PRIMARY KEY) WITHOUT ROWID")
    conn.executemany("INSERT OR IGNORE INTO temp.prune_keep (event_id) VALUES (?)", ((e,) for e in event_ids))


def _count(db: ConsumerDB, report: PruneReport, params: dict[str, Any]) -> None:
    conn = db.conn
    ((old, kept_dead, kept_unresolved),) = conn.execute(
        f"SELECT count(*), coalesce(sum({_KEPT.format(col='event_id')}), 0),"
        f" coalesce(sum(NOT {_KEPT.format(col='event_id')} AND {_UNRESOLVED.format(col='inbox.event_id')}), 0)"
        " FROM inbox WHERE rowid <= :last AND received_at < :cutoff", params).fetchall()
    report.kept_in_dead_queue, report.kept_unresolved = kept_dead, kept_unresolved
    if report.dry_run:
        report.receipts = old - kept_dead - kept_unresolved
        report.deliveries = conn.execute(f"SELECT count(*) FROM ({_DELIVERIES})", params).fetchall()[0][0]
        report.rejections = conn.execute(f"SELECT count(*) FROM ({_REJECTIONS})", params).fetchall()[0][0]


def _prefix(db: ConsumerDB, cutoff: str) -> int:
    """The last rowid of the receipts' prefix received before *cutoff*, in their own order:
    the binary search's bound, cut at the first receipt in rowid order that is not older
    (a receipt written after a younger one is never deleted, whatever its time says)."""
    last = inbox_rowid_before(db.conn, cutoff)
    (first_young,) = db.conn.execute("SELECT min(rowid) FROM inbox WHERE rowid <= ? AND received_at >= ?",
                                     (last, cutoff)).fetchone()
    return last if first_young is None else int(first_young) - 1


def prune(
    db: ConsumerDB,
    *,
    older_than_s: float,
    horizon_s: float = DEFAULT_HORIZON_S,
    keep_event_ids: Iterable[str] | None,
    refresh_keep: Callable[[], Iterable[str]] = lambda: (),
    dead_queue: str | None = None,
    batch: int = DEFAULT_BATCH,
    dry_run: bool = False,
    now: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    trust_clock: bool = False,
) -> PruneReport:
    """Delete receipts, delivery records and resolved rejections older than *older_than_s*.

    *keep_event_ids*: the eventIds in the dead queue, or None when it could not
    be read (the caller decided to go on: only unresolved rejections then
    protect a receipt). *refresh_keep* is called before every batch and
    returns eventIds that reached the dead queue meanwhile. Raises
    PruneRefused for an age below the horizon, and when the receipts' clock
    and this one disagree (:func:`check_clock`) unless *trust_clock*.
    """
    check_older_than(older_than_s, horizon_s)
    if batch < 1:
        raise ValueError("batch must be >= 1")
    started = time.monotonic()
    own_clock = now is None
    now = time.time() if now is None else now
    if not trust_clock:
        check_clock(db, now, horizon_s, own_clock=own_clock)
    cutoff = now_iso(now - older_than_s)
    report = PruneReport(db.consumer, str(db.path), cutoff, older_than_s, horizon_s, dry_run, dead_queue)
    if keep_event_ids is None:
        report.notes.append("the dead queue was not read: receipts of its events are protected only by "
                            "their unresolved rejections (broker-side delivery-limit dead letters have none)")
    _set_keep(db, keep_event_ids or ())
    params: dict[str, Any] = {"cutoff": cutoff, "batch": batch, "last": _prefix(db, cutoff)}
    try:
        _count(db, report, params)
        if dry_run:
            return report
        for name, statement in _DELETES:
            while True:
                _set_keep(db, refresh_keep())
                began = time.monotonic()
                with db.transaction() as tx:
                    if name == "receipts":  # the counters lose what is deleted (inbox/counters.py)
                        counters.catch_up(tx.conn)  # first: every receipt deleted is then a counted one
                        keep_high_water(tx.conn)  # the newest may go: its rowid must stay known
                        gone = tx.conn.execute(statement, params).fetchall()
                        counters.subtract(tx.conn, gone)
                        deleted = len(gone)
                    else:
                        deleted = tx.conn.execute(statement, params).rowcount
                report.batches += 1
                setattr(report, name, getattr(report, name) + deleted)
                if deleted < batch:
                    break
                # Leave the write lock free for as long as we held it.
                sleep(max(0.005, time.monotonic() - began))
        return report
    finally:
        db.conn.execute("DROP TABLE IF EXISTS temp.prune_keep")
        report.seconds = time.monotonic() - started


__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_HORIZON_S",
    "PruneReport",
    "check_clock",
    "check_older_than",
    "format_duration",
    "prune",
]
