"""Reading the outbox, and the operator's actions on it: ``outbox list |
stats | show | prune | requeue | drop``.

Each row is a dict with camelCase keys (what ``--json`` prints). Its
``state`` says where it is *now*: ``published``, ``quarantined``,
``dropped``, or for a pending row ``leased`` (a dispatcher holds it),
``retrying`` (waiting for its backoff), ``held`` (behind an earlier row of
its article that is leased or retrying) or ``pending`` (due: the next
claim takes it); ``detail`` says it in words: ``leased by <owner> until
<time>``, ``held behind <eventId>``, ``next attempt at <time>``, when and
why it was quarantined, who dropped it when and why. In plain SQL the lasting part is the
``status`` column (``pending | published | quarantined | dropped``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Final

import orjson

from ..model.errors import NotFound, safe_reason
from ..model.plural import count
from ..store.sqlite import age_s, now_iso
from .db import as_db

Row = dict[str, Any]
STATES: Final = ("all", "unpublished", "pending", "due", "leased", "retrying", "held", "failed", "quarantined",
                 "dropped", "published")

_FIELDS: Final = (
    ("seq", "seq"), ("eventId", "event_id"), ("status", "status"), ("routingKey", "routing_key"),
    ("orderingKey", "ordering_key"), ("createdAt", "created_at"), ("attempts", "attempts"),
    ("failures", "failures"), ("lastError", "last_error"), ("lastAttemptAt", "last_attempt_at"),
    ("nextAttemptAt", "next_attempt_at"), ("leaseOwner", "lease_owner"), ("leaseUntil", "lease_until"),
    ("publishedAt", "published_at"), ("quarantinedAt", "quarantined_at"), ("quarantineReason", "quarantine_reason"),
    ("requeuedAt", "requeued_at"), ("requeuedBy", "requeued_by"), ("droppedAt", "dropped_at"),
    ("droppedBy", "dropped_by"), ("dropReason", "drop_reason"),
)
_COLUMNS: Final = ", ".join(column for _, column in _FIELDS)


def pending_states(conn: Any, now_s: str) -> dict[int, tuple[str, str | None]]:
    """seq -> (state, detail) of every pending row, in one pass in creation
    order: the dispatcher's own rule for what may be claimed."""
    conn = as_db(conn)
    out: dict[int, tuple[str, str | None]] = {}
    holder: dict[str, str] = {}  # ordering key -> eventId of the earliest row holding it back
    rows = conn.execute("SELECT seq, event_id, ordering_key, next_attempt_at, lease_owner, lease_until FROM outbox"
                        " WHERE status = 'pending' ORDER BY seq")
    for seq, event_id, key, next_at, owner, until in rows:
        if until is not None and until > now_s:
            state, detail = "leased", f"leased by {owner} until {until}"
        elif next_at is not None and next_at > now_s:
            state, detail = "retrying", f"next attempt at {next_at}"
        elif key in holder:
            state, detail = "held", f"held behind {holder[key]}"
        else:
            state, detail = "pending", None
        if state in ("leased", "retrying") or next_at is not None:  # a due retry goes out alone, too
            holder.setdefault(key, event_id)
        out[seq] = (state, detail)
    return out


def _row(values: Sequence[Any], states: dict[int, tuple[str, str | None]]) -> Row:
    out: Row = {key: value for (key, _), value in zip(_FIELDS, values, strict=True)}
    status = out["status"]
    if status == "pending":
        out["state"], out["detail"] = states.get(out["seq"], ("pending", None))
    else:
        out["state"] = status
        out["detail"] = {
            "quarantined": f"quarantined at {out['quarantinedAt']}: {out['quarantineReason']}",
            "dropped": f"dropped by {out['droppedBy']} at {out['droppedAt']}: {out['dropReason'] or 'no reason given'}",
        }.get(status)
    return out


def list_rows(
    conn: Any, *, state: str = "all", limit: int | None = 50, now: float | None = None
) -> list[Row]:
    """Rows of the outbox. Rows that wait (``unpublished``, ``pending``,
    ``due``, ``leased``, ``retrying``, ``held``, ``failed``, ``quarantined``)
    oldest first, the order they go out; ``published``, ``dropped`` and
    ``all`` newest first."""
    conn = as_db(conn)
    if state not in STATES:
        raise ValueError(f"unknown state {state!r}: one of {', '.join(STATES)}")
    now_s = now_iso(now)
    where, order = {
        "all": ("1 = 1", "seq DESC"),
        "unpublished": ("status IN ('pending', 'quarantined')", "seq"),
        "failed": ("status IN ('pending', 'quarantined') AND attempts > 0", "seq"),
        "quarantined": ("status = 'quarantined'", "seq"),
        "dropped": ("status = 'dropped'", "seq DESC"),
        "published": ("status = 'published'", "seq DESC"),
    }.get(state, ("status = 'pending'", "seq"))
    with conn.snapshot():  # the states and the rows from one snapshot
        states = pending_states(conn, now_s) if state not in ("quarantined", "dropped", "published") else {}
        # The pending rows of one kind ("due": what the next claim may take, shown as pending).
        wanted = {"due": "pending", "leased": "leased", "retrying": "retrying", "held": "held"}.get(state)
        bounded = bool(limit) and wanted is None
        rows = conn.execute(f"SELECT {_COLUMNS} FROM outbox WHERE {where} ORDER BY {order}"
                            + (" LIMIT ?" if bounded else ""), (limit,) if bounded else ()).fetchall()
    out = [_row(r, states) for r in rows]
    if wanted is not None:
        out = [r for r in out if r["state"] == wanted][:limit or None]
    return out


def show(conn: Any, event_id: str, *, now: float | None = None, body: bool = True) -> Row:
    """One row with its fingerprint and (unless ``body=False``) its body;
    ``passedBy``: the later rows of its article published before it (all of
    them while it is unpublished). :class:`NotFound` otherwise."""
    conn = as_db(conn)
    with conn.snapshot():
        row = conn.execute(f"SELECT {_COLUMNS}, fingerprint, body FROM outbox WHERE event_id = ?",
                           (event_id,)).fetchone()
        if row is None:
            raise NotFound(f"{event_id}: not in the outbox")
        out = _row(row[:-2], pending_states(conn, now_iso(now)) if row[2] == "pending" else {})
        passed = conn.execute(
            "SELECT event_id FROM outbox WHERE ordering_key = ?1 AND seq > ?2 AND status = 'published'"
            " AND (CAST(?3 AS TEXT) IS NULL OR published_at < ?3) ORDER BY seq LIMIT 100",
            (out["orderingKey"], out["seq"], out["publishedAt"])).fetchall()
    out["passedBy"] = [r[0] for r in passed]
    out["fingerprint"] = row[-2]
    if body:
        out["body"] = orjson.loads(row[-1])
    return out


def waiting(conn: Any, *, now: float | None = None) -> Counter[str]:
    """How many rows are not published, by what they wait for: ``pending``
    (due), ``leased``, ``retrying`` (backoff), ``held`` (behind an earlier row
    of their article), ``quarantined`` (a person must act). Empty: every row
    is published (or dropped)."""
    conn = as_db(conn)
    with conn.snapshot():
        counts = Counter(state for state, _ in pending_states(conn, now_iso(now)).values())
        quarantined = conn.execute("SELECT count(*) FROM outbox WHERE status = 'quarantined'").fetchone()[0]
    if quarantined:
        counts["quarantined"] = quarantined
    return counts


def describe_waiting(counts: Counter[str]) -> str:
    """``3 rows left: 1 quarantined, 2 retrying`` (for exit messages; ``1 row left: ...``)."""
    words = {"pending": "due now", "leased": "leased by another dispatcher", "retrying": "waiting for their backoff",
             "held": "held behind an earlier row of their key", "quarantined": "quarantined"}
    parts = ", ".join(f"{counts[k]} {words[k]}" for k in words if counts.get(k))
    return f"{count(sum(counts.values()), 'row')} left: {parts}"


def stats(conn: Any, *, now: float | None = None) -> Row:
    """Counts by status and state, the oldest pending row (a quarantined row
    waits for a person, not for dispatch: it has its own count and oldest),
    the commonest errors of pending rows and reasons of quarantined ones."""
    conn = as_db(conn)
    now = time.time() if now is None else now
    now_s = now_iso(now)
    with conn.snapshot():  # one snapshot for every read
        total, published, quarantined, dropped, oldest, oldest_quarantined, max_attempts, last_published = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'published'),"
            " count(*) FILTER (WHERE status = 'quarantined'), count(*) FILTER (WHERE status = 'dropped'),"
            " min(CASE WHEN status = 'pending' THEN created_at END),"
            " min(CASE WHEN status = 'quarantined' THEN quarantined_at END),"
            " coalesce(max(CASE WHEN status IN ('pending', 'quarantined') THEN attempts END), 0),"
            " max(published_at) FROM outbox",
        ).fetchone()
        states = Counter(state for state, _ in pending_states(conn, now_s).values())
        failed = conn.execute("SELECT count(*) FROM outbox WHERE status = 'pending' AND attempts > 0").fetchone()[0]
        errors = conn.execute(
            "SELECT last_error, count(*) FROM outbox WHERE status = 'pending' AND last_error IS NOT NULL"
            " GROUP BY last_error ORDER BY count(*) DESC, last_error LIMIT 5"
        ).fetchall()
        reasons = conn.execute(
            "SELECT quarantine_reason, count(*) FROM outbox WHERE status = 'quarantined'"
            " GROUP BY quarantine_reason ORDER BY count(*) DESC, quarantine_reason LIMIT 5"
        ).fetchall()
    return {
        "database": conn.label,
        "rows": total,
        "published": published,
        "unpublished": total - published - dropped,
        "pending": sum(states.values()),
        "due": states["pending"],
        "leased": states["leased"],
        "retrying": states["retrying"],
        "held": states["held"],
        "failed": failed,
        "quarantined": quarantined,
        "dropped": dropped,
        "oldestPendingAt": oldest,
        "oldestPendingAgeSeconds": age_s(oldest, now),
        "oldestQuarantinedAt": oldest_quarantined,
        "maxAttemptsUnpublished": max_attempts,
        "lastPublishedAt": last_published,
        "errors": {error: n for error, n in errors},
        "quarantineReasons": {reason: n for reason, n in reasons},
    }


def unpublished(conn: Any) -> int:
    """How many rows are neither published nor dropped (pending or quarantined)."""
    conn = as_db(conn)
    return int(conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'quarantined')").fetchone()[0])


def prune(conn: Any, *, older_than_s: float, now: float | None = None) -> int:
    """Delete rows published (or dropped) more than *older_than_s* ago;
    returns how many. Pending and quarantined rows are never deleted."""
    conn = as_db(conn)
    if older_than_s < 0:
        raise ValueError("older_than_s must be >= 0")
    cutoff = now_iso((time.time() if now is None else now) - older_than_s)
    with conn.transaction():
        cur = conn.execute(
            "DELETE FROM outbox WHERE (status = 'published' AND published_at < ?1)"
            " OR (status = 'dropped' AND dropped_at < ?1)", (cutoff,)
        )
    return int(cur.rowcount)


# -- the operator's actions -----------------------------------------------------------


def _act(conn: Any, event_ids: Iterable[str], allowed: tuple[str, ...], done: str, sql: str,
         params: dict[str, Any], dry_run: bool) -> list[Row]:
    """For each eventId: apply *sql* (``:seq`` and *params*) when its status is
    in *allowed*; one result row each: eventId, outcome (*done*,
    ``would-be-<done>``, ``not-quarantined`` or ``not-found``) and the status
    it had."""
    conn = as_db(conn)
    results: list[Row] = []
    with conn.transaction():
        for event_id in dict.fromkeys(event_ids):
            found = conn.execute("SELECT seq, status FROM outbox WHERE event_id = ?", (event_id,)).fetchone()
            if found is None:
                results.append({"eventId": event_id, "outcome": "not-found", "status": None})
                continue
            seq, status = found
            if status not in allowed:
                results.append({"eventId": event_id, "outcome": "not-quarantined", "status": status})
                continue
            if not dry_run:
                conn.execute(sql, {**params, "seq": seq})
            results.append({"eventId": event_id, "outcome": f"would-be-{done}" if dry_run else done,
                            "status": status})
    return results


def quarantined_ids(conn: Any) -> list[str]:
    """eventIds of every quarantined row, in creation order."""
    conn = as_db(conn)
    return [r[0] for r in conn.execute("SELECT event_id FROM outbox WHERE status = 'quarantined' ORDER BY seq")]


def requeue(conn: Any, event_ids: Iterable[str], *, by: str, dry_run: bool = False,
            now: float | None = None) -> list[Row]:
    """Put quarantined (or dropped) rows back in the stream after a fix: the
    row becomes pending with its failures reset and goes out as a retry
    (alone for its article); attempts and the last quarantine stay as
    history, ``requeued_at`` / ``requeued_by`` record the act."""
    sql = ("UPDATE outbox SET status = 'pending', failures = 0, next_attempt_at = :now, lease_owner = NULL,"
           " lease_until = NULL, requeued_at = :now, requeued_by = :by WHERE seq = :seq")
    return _act(conn, event_ids, ("quarantined", "dropped"), "requeued", sql,
                {"now": now_iso(now), "by": safe_reason(by, 100)}, dry_run)


def drop(conn: Any, event_ids: Iterable[str], *, by: str, reason: str | None = None,
         dry_run: bool = False, now: float | None = None) -> list[Row]:
    """Give up quarantined rows on purpose, recording who, when and why; a
    dropped row is never published (``requeue`` undoes it)."""
    sql = "UPDATE outbox SET status = 'dropped', dropped_at = :now, dropped_by = :by, drop_reason = :reason" \
          " WHERE seq = :seq"
    return _act(conn, event_ids, ("quarantined",), "dropped", sql,
                {"now": now_iso(now), "by": safe_reason(by, 100),
                 "reason": safe_reason(reason, 200) if reason else None}, dry_run)


__all__ = ["STATES", "Row", "describe_waiting", "drop", "list_rows", "pending_states", "prune",
           "quarantined_ids", "requeue", "show", "stats", "unpublished", "waiting"]
