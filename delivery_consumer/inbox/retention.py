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
prefix of the receipts in their order (SQLite's rowid, PostgreSQL's ``seq``) is
deleted, never one written after a younger one (a clock that went back). When this
process's clock and the system's (a new file's time; on PostgreSQL the database
server's) disagree by more than the horizon (a faked clock), when the newest receipt is in
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
gets the write lock between batches and keeps committing (on PostgreSQL it
waits only for the rows a batch deletes). One implementation for both
backends: what their SQL words differently is :mod:`.dialect`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..model.durations import format as format_duration
from ..model.errors import PruneRefused
from ..store.sqlite import age_s, now_iso
from .apply import CLOCK_JUMP, Store
from .dialect import SqliteWords, filesystem_now, words_for

DAY_S = 86400
#: Default redelivery horizon: receipts younger than this are never pruned.
DEFAULT_HORIZON_S = 7 * DAY_S
#: Rows per delete transaction.
DEFAULT_BATCH = 500


def check_clock(db: Store, now: float, horizon_s: float, *, own_clock: bool = True) -> None:
    """Refuse (PruneRefused, one line) when ages cannot be judged: this process's clock and
    the system's (SQLite: a new file's time; PostgreSQL: the database server's) disagree by more
    than the horizon; the newest receipt (last in the receipts' own order) is in this clock's
    future by more than the horizon (this clock is behind, or the consumer's was ahead); or the
    writer recorded a jump of its clock by more than the horizon after receipts that are still
    there (their times are off by it: ``meta.clock_jump``).
    *own_clock* False: *now* was given by the caller, not read from this process's clock."""
    words = words_for(db)
    system = words.system_now(db) if own_clock else None
    if system is not None and abs(now - system) > horizon_s:
        raise PruneRefused(
            f"this process's clock ({now_iso(now)}) and {words.system_clock} ({now_iso(system)}) disagree "
            f"by {format_duration(round(abs(now - system)))}, more than the redelivery horizon "
            f"{format_duration(horizon_s)}: ages cannot be judged, nothing deleted (a faked or skewed clock?)")
    row = db.conn.execute(f"SELECT received_at FROM inbox ORDER BY {words.order} DESC LIMIT 1").fetchone()
    if row is not None and -age_s(str(row[0]), now) > horizon_s:
        raise PruneRefused(
            f"this clock ({now_iso(now)}) and the receipts' disagree by {format_duration(round(-age_s(row[0], now)))}"
            f", more than the redelivery horizon {format_duration(horizon_s)}: the newest receipt was stamped "
            f"{row[0]}, in this clock's future (this clock is behind, or the consumer's was ahead); nothing "
            f"deleted. Fix the clock, or pass --trust-clock if the receipts' times are right")
    jump = db.conn.execute("SELECT value FROM meta WHERE key = ?", (CLOCK_JUMP,)).fetchone()
    if jump is not None:
        rowid, moved, at = str(jump[0]).split()
        oldest = db.conn.execute(f"SELECT min({words.order}) FROM inbox").fetchone()[0]
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
_KEPT = "{col} IN (SELECT event_id FROM {keep})"

# Parameters: ?1 the cutoff, ?2 the batch, ?3 the last of the receipts' prefix in their own order
# (``{order} <= ?3`` lets SQLite read the inbox from its start instead of scanning it all;
# ``received_at < ?1`` stays the exact rule).
_RECEIPTS = (
    "SELECT event_id FROM inbox WHERE {order} <= ?3 AND received_at < ?1"
    f" AND NOT {_KEPT.format(col='inbox.event_id', keep='{keep}')}"
    f" AND NOT {_UNRESOLVED.format(col='inbox.event_id')}"
)
_DELIVERIES = (
    "SELECT key FROM deliveries WHERE last_at < ?1 AND (deliveries.event_id IS NULL OR ("
    f"NOT {_KEPT.format(col='deliveries.event_id', keep='{keep}')}"
    f" AND NOT {_UNRESOLVED.format(col='deliveries.event_id')}))"
)
_REJECTIONS = "SELECT id FROM rejected WHERE resolved_at IS NOT NULL AND resolved_at < ?1"

_DELETES = (
    ("receipts", f"DELETE FROM inbox WHERE event_id IN ({_RECEIPTS} ORDER BY {{order}} LIMIT ?2)"
                 " RETURNING received_at, result"),
    ("deliveries", f"DELETE FROM deliveries WHERE key IN ({_DELIVERIES} ORDER BY last_at LIMIT ?2)"),
    ("rejections", f"DELETE FROM rejected WHERE id IN ({_REJECTIONS} ORDER BY id LIMIT ?2)"),
)
_NUMBERED = re.compile(r"\?(\d+)")


def _statement(words: SqliteWords, template: str) -> str:
    return template.format(order=words.order, keep=words.keep_table)


def _bound(sql: str, params: tuple[Any, ...]) -> tuple[Any, ...]:
    """The parameters *sql* numbers (SQLite wants as many as its highest ``?N``)."""
    return params[:max(int(n) for n in _NUMBERED.findall(sql))]


def _set_keep(db: Store, event_ids: Iterable[str]) -> None:
    words = words_for(db)
    db.conn.execute(words.keep_create)
    db.conn.executemany(words.keep_insert, [(e,) for e in event_ids])


def _count(db: Store, report: PruneReport, params: tuple[Any, ...]) -> None:
    words, conn = words_for(db), db.conn
    kept = _KEPT.format(col="event_id", keep=words.keep_table)
    sql = (f"SELECT count(*), coalesce(sum(CASE WHEN {kept} THEN 1 ELSE 0 END), 0),"
           f" coalesce(sum(CASE WHEN NOT {kept} AND {_UNRESOLVED.format(col='inbox.event_id')} THEN 1 ELSE 0 END),"
           f" 0) FROM inbox WHERE {words.order} <= ?3 AND received_at < ?1")
    ((old, kept_dead, kept_unresolved),) = conn.execute(sql, params).fetchall()
    report.kept_in_dead_queue, report.kept_unresolved = int(kept_dead), int(kept_unresolved)
    if report.dry_run:
        report.receipts = int(old) - report.kept_in_dead_queue - report.kept_unresolved
        deliveries = f"SELECT count(*) FROM ({_statement(words, _DELIVERIES)}) AS d"
        report.deliveries = conn.execute(deliveries, params[:1]).fetchall()[0][0]
        report.rejections = conn.execute(f"SELECT count(*) FROM ({_REJECTIONS}) AS r", params[:1]).fetchall()[0][0]


def _prefix(db: Store, cutoff: str) -> int:
    """The last of the receipts' prefix received before *cutoff*, in their own order (rowid,
    seq): the backend's bound, cut at the first receipt in that order that is not older (a
    receipt written after a younger one is never deleted, whatever its time says)."""
    words = words_for(db)
    last = words.prefix_bound(db.conn, cutoff)
    (first_young,) = db.conn.execute(
        f"SELECT min({words.order}) FROM inbox WHERE {words.order} <= ? AND received_at >= ?",
        (last, cutoff)).fetchone()
    return last if first_young is None else int(first_young) - 1


def prune(
    db: Store,
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
    report = PruneReport(db.spec.name, str(db.path), cutoff, older_than_s, horizon_s, dry_run, dead_queue)
    if keep_event_ids is None:
        report.notes.append("the dead queue was not read: receipts of its events are protected only by "
                            "their unresolved rejections (broker-side delivery-limit dead letters have none)")
    words = words_for(db)
    _set_keep(db, keep_event_ids or ())
    params = (cutoff, batch, _prefix(db, cutoff))
    try:
        _count(db, report, params)
        if dry_run:
            return report
        for name, template in _DELETES:
            statement = _statement(words, template)
            bound = _bound(statement, params)
            while True:
                _set_keep(db, refresh_keep())
                began = time.monotonic()
                with db.transaction() as tx:
                    if name == "receipts":  # SQLite's counters lose what is deleted (inbox/counters.py)
                        words.before_receipts_deleted(tx.conn)
                        gone = tx.conn.execute(statement, bound).fetchall()
                        words.after_receipts_deleted(tx.conn, gone)
                        deleted = len(gone)
                    else:
                        deleted = tx.conn.execute(statement, bound).rowcount
                report.batches += 1
                setattr(report, name, getattr(report, name) + deleted)
                if deleted < batch:
                    break
                # Leave the write lock free for as long as we held it.
                sleep(max(0.005, time.monotonic() - began))
        return report
    finally:
        db.conn.execute(f"DROP TABLE IF EXISTS {words.keep_table}")
        report.seconds = time.monotonic() - started


__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_HORIZON_S",
    "PruneReport",
    "check_clock",
    "check_older_than",
    "filesystem_now",
    "format_duration",
    "prune",
]
