"""The inbox's side of the dead queue's commands and of ``rejected resolve``: receipts of dead
letters, rejections marked resolved, and a fresh poison budget for copies about to be requeued.

The dead queue itself (reading, requeueing, purging) is ``ops/deadletters.py``, which calls these
with what it read of each letter; the SQL is written once for both backends (the store's
``?`` parameters; what differs: :mod:`.dialect`), each write in the store's own transactions of
at most :data:`RESOLVE_BATCH` rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .apply import Store, receipt
from .dialect import words_for

#: Rows of ``rejected`` resolved per transaction.
RESOLVE_BATCH = 200


class Letter(NamedTuple):
    """What resolving asks of one dead letter: its body's digest, and its eventId (read from the
    body when *from_body*; otherwise guessed from its message id)."""

    body_sha256: str
    event_id: str | None
    from_body: bool


def receipts_of(db: Store, event_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
    """EventId -> (fingerprint, result) of each of *event_ids* that has a receipt."""
    found: dict[str, tuple[str, str]] = {}
    for event_id in event_ids:
        row = receipt(db.conn, event_id)
        if row is not None:
            found[event_id] = row
    return found


def reset_counts(db: Store, keys: Sequence[str]) -> None:
    """A fresh poison budget for the delivery *keys* of copies about to be requeued (their crash
    counts cleared, their last outcome ``requeued``): step 1 of a requeue (docs/amqp.md)."""
    if not keys:
        return
    with db.transaction() as tx:
        tx.conn.executemany("UPDATE deliveries SET crashes = 0, last_outcome = 'requeued' WHERE key = ?",
                            [(key,) for key in keys])


_RESOLVE_LETTER = (
    "UPDATE rejected SET resolved_at = ?, event_id = coalesce(event_id, ?)"
    " WHERE resolved_at IS NULL AND id = (SELECT id FROM rejected"
    " WHERE dead_letter = ? AND resolved_at IS NULL"
    " AND (body_sha256 = ? OR (body_sha256 IS NULL AND event_id = ?)) ORDER BY id LIMIT 1)"
)
_RESOLVE_ID = "UPDATE rejected SET resolved_at = ? WHERE id = ? AND resolved_at IS NULL"


def resolve_letters(db: Store, queue: str, letters: Sequence[Letter]) -> int:
    """Mark one unresolved ``rejected`` row per dead letter of *queue* resolved; returns the count.

    A row belongs to a dead letter when it names this dead queue and has the
    same body digest (or, for an older row without one, the same eventId).
    Broker dead letters (delivery limit) have no row: nothing to resolve.
    A row written without an eventId (the body was refused before it was
    read, e.g. over ``--max-bytes``) gets the one read from the body now, so
    that ``trace`` finds it.
    """
    done = 0
    for start in range(0, len(letters), RESOLVE_BATCH):
        with db.transaction() as tx:
            for letter in letters[start:start + RESOLVE_BATCH]:
                cur = tx.conn.execute(_RESOLVE_LETTER, (tx.now, letter.event_id if letter.from_body else None,
                                                        queue, letter.body_sha256, letter.event_id))
                done += cur.rowcount
    return done


def _resolve_ids(db: Store, ids: Sequence[int]) -> None:
    for start in range(0, len(ids), RESOLVE_BATCH):
        with db.transaction() as tx:
            tx.conn.executemany(_RESOLVE_ID, [(tx.now, row_id) for row_id in ids[start:start + RESOLVE_BATCH]])


#: A rejection must be this much older than the dead-queue read for
#: :func:`resolve_gone` to consider it. ``run`` stamps the row after the copy's
#: confirm, so any margin above the clock's resolution would do; one second
#: also absorbs a clock step.
RECONCILE_MARGIN_S = 1.0


def resolve_gone(db: Store, queue: str, present: set[str], before: str) -> int:
    """Resolve the unresolved rejections of dead queue *queue* recorded before *before* (ISO time)
    whose body digest is not in *present* (the digests of a complete read of the queue): their
    copy is no longer there. Returns the number of rows resolved."""
    rows = db.conn.execute(
        "SELECT id, body_sha256 FROM rejected WHERE dead_letter = ? AND resolved_at IS NULL"
        " AND body_sha256 IS NOT NULL AND rejected_at < ?", (queue, before)).fetchall()
    gone = [int(row[0]) for row in rows if row[1] not in present]
    _resolve_ids(db, gone)
    return len(gone)


@dataclass
class Resolved:
    """What :func:`resolve_by_hand` did: rows resolved, rows left (with why), ids not found."""

    resolved: list[int] = field(default_factory=list)
    left: list[tuple[int, str]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"resolved": self.resolved, "left": [{"id": i, "why": why} for i, why in self.left],
                "missing": self.missing, "dryRun": self.dry_run}


def resolve_by_hand(db: Store, *, ids: Sequence[int] = (), before: str | None = None, code: str | None = None,
                    dry_run: bool = False) -> Resolved:
    """Mark unresolved rejections resolved: those of *ids*, or those rejected before *before* (ISO
    time; with *code*, only that code). A person looked at them: ``status`` stops counting them and
    ``inbox prune`` may remove them in due time.

    A rejection whose copy went to a dead queue is left: its dead letter may still be requeued, and
    ``dead requeue`` or ``dead purge`` resolves it (a copy already gone is reconciled by them).
    Rejections recorded without a copy -- ``replay``'s, or a consumer's with dead-lettering off --
    have nothing else that could resolve them.
    """
    if bool(ids) == (before is not None):
        raise ValueError("choose the rejections by id, or by time (before)")
    where, params = ((f"id IN ({words_for(db).ids_table})", [_json_ids(ids)]) if ids
                     else ("rejected_at < ?", [before]))
    if code is not None:
        where, params = f"{where} AND code = ?", [*params, code]
    rows = db.conn.execute(f"SELECT id, dead_letter, resolved_at FROM rejected WHERE {where} ORDER BY id",
                           params).fetchall()
    out = Resolved(dry_run=dry_run)
    out.missing = sorted(set(ids) - {int(row[0]) for row in rows})
    chosen = []
    for row_id, dead_letter, resolved_at in rows:
        if resolved_at is not None:
            if ids:
                out.left.append((int(row_id), f"already resolved at {resolved_at}"))
        elif dead_letter is not None:
            out.left.append((int(row_id), f"its copy went to {dead_letter}: dead requeue or dead purge resolves it"))
        else:
            chosen.append(int(row_id))
    if not dry_run:
        _resolve_ids(db, chosen)
    out.resolved = chosen
    return out


def _json_ids(ids: Sequence[int]) -> str:
    return "[" + ",".join(str(int(i)) for i in ids) + "]"


__all__ = ["RECONCILE_MARGIN_S", "RESOLVE_BATCH", "Letter", "Resolved", "receipts_of", "reset_counts",
           "resolve_by_hand", "resolve_gone", "resolve_letters"]
