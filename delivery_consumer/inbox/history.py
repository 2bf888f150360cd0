"""``trace``: everything one consumer database knows about one eventId.

Answers the operator's questions in one call: was it received (the receipt:
result, fingerprint, first seen), how many times was it delivered (the
``deliveries`` rows: deliveries, redeliveries, attempts, crashes, first and
last time, last outcome), why did it stop (every rejection: code, reason,
when, where the copy went, whether it was resolved), the consumer's rows
written by the event and, when its view names a key column
(``View.key_column``), the current row of the event's key (``orderId
order-7``). Read-only and short, like :mod:`queries`.

The key is the one the caller names, else the one the receipt holds (with
the name of the type's key field), else -- a receipt written before
receipts kept the key -- the row this event wrote last (``View.event``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model.cloudevents import event_id_for
from ..model.contract import ConsumerSpec
from ..model.errors import FORWARDED, REJECTIONS, NotFound
from ..model.plural import count
from .dialect import words_for
from .reports import deliveries_summary, dict_rows, origin_of, reads, receipt_row, snapshot
from .views import key_row

if TYPE_CHECKING:
    from .seam import InboxReader

Row = dict[str, Any]

#: Summary statuses.
APPLIED, REJECTED, RESOLVED, PENDING = "applied", "rejected", "resolved", "pending"


def _event_id_tables(db: InboxReader) -> dict[str, str]:
    """Effect table -> its column holding an eventId: the view's ``event``
    column, else ``event_id`` where a table has one."""
    view = db.spec.view
    tables = {view.table: view.event} if view is not None and view.event is not None else {}
    words = words_for(db)
    for table in db.spec.tables:
        if "event_id" in words.columns(db.conn, table):
            tables.setdefault(table, "event_id")
    return tables


def _status(receipt: Row | None, rejections: list[Row], deliveries: Row) -> tuple[str, str]:
    unresolved = [r for r in rejections if r["resolvedAt"] is None]
    if receipt is not None:
        summary = f"applied: {receipt['result']} at {receipt['receivedAt']}"
        if deliveries["deliveries"] > 1:
            summary += f" after {count(deliveries['deliveries'], 'delivery', 'deliveries')}"
        if unresolved:
            codes = ", ".join(sorted({r["code"] for r in unresolved}))
            summary += f"; another copy was rejected ({codes}), unresolved"
        return APPLIED, summary
    if unresolved:
        last = unresolved[-1]
        where = (f"copy in {last['deadLetter']}" if last["deadLetter"]
                 else f"no dead-letter copy (source {last['source'] or '-'})")
        return REJECTED, f"rejected {last['code']} at {last['rejectedAt']}: {last['reason']}; {where}"
    if rejections:
        last = rejections[-1]
        return RESOLVED, (f"rejected {last['code']} at {last['rejectedAt']}, resolved at {last['resolvedAt']} "
                          "(requeued or purged); not applied since")
    outcome = deliveries["lastOutcome"]
    if outcome in REJECTIONS:  # a rejection, not a result
        # Refused before its eventId was read (e.g. a body over --max-bytes): the
        # rejection row has no eventId, only the body's digest (see dead list).
        return REJECTED, (f"rejected {outcome} at {deliveries['lastAt']} (its rejection row carries no eventId: "
                          "the body was refused before it was read; see dead list / rejected list)")
    if outcome == "crashed":
        why = (f"the process died while handling it alone ({deliveries['crashes']} crashes); its next delivery is "
               "handled alone, dead-lettered delivery-limit after --max-crashes")
    elif outcome == "interrupted":
        why = "the process died while handling its batch (no crash counted); its next delivery is handled alone"
    elif outcome == "in-flight":
        why = "being handled, or the process died while handling it"
    elif outcome == "requeued":
        why = "requeued from the dead queue, not delivered since"
    elif isinstance(outcome, str) and outcome.startswith(f"{FORWARDED}:"):
        why = f"it belongs to partition {outcome.partition(':')[2]}: forwarded to it"
    elif isinstance(outcome, str) and outcome.startswith("transient:"):
        why = f"failed transiently ({outcome.partition(':')[2]}), waiting for a retry"
    else:
        why = f"last outcome {outcome}"
    return PENDING, f"not applied: {why} (last delivery {deliveries['lastAt']})"


def key_field(spec: ConsumerSpec, event_type: str | None) -> str:
    """The name of the key field of *event_type* among the consumer's types;
    unknown type: the one key all its types share, else ``key``."""
    declared = spec.event_types.get(event_type) if event_type is not None else None
    if declared is not None:
        return declared.key
    keys = {t.key for t in spec.event_types}
    return keys.pop() if len(keys) == 1 else "key"


@reads
def cloudevent_matches(db: InboxReader, ce_id: str) -> list[tuple[str, str]]:
    """(source, eventId) of each event *db* knows (a receipt, a rejection, a
    delivery) that came as a CloudEvent with the id *ce_id* its producer gave
    it: the eventId is derived from source and id, so it is tried with each
    source the database has seen (``ce_sources``)."""
    found = []
    for (source,) in db.conn.execute("SELECT source FROM ce_sources ORDER BY source").fetchall():
        event_id = event_id_for(source, ce_id)
        if db.conn.execute("SELECT 1 FROM inbox WHERE event_id = ?1 UNION ALL SELECT 1 FROM rejected WHERE"
                           " event_id = ?1 UNION ALL SELECT 1 FROM deliveries WHERE event_id = ?1 LIMIT 1",
                           (event_id,)).fetchone():
            found.append((source, event_id))
    return found


@reads
def trace(db: InboxReader, event_id: str, *, key: str | None = None) -> Row:
    """Receipt, deliveries, rejections and effect rows of *event_id*; NotFound if none."""
    conn = db.conn
    with snapshot(db):
        receipt = receipt_row(conn, event_id)
        rejections = dict_rows(conn.execute(
            "SELECT id, code, reason, rejected_at, source, attempts, dead_letter, resolved_at, fingerprint,"
            " body_sha256, partition_key AS key, origin FROM rejected WHERE event_id = ? ORDER BY id", (event_id,)))
        for rejection in rejections:
            rejection["cloudEvent"] = origin_of(rejection.pop("origin"))
        deliveries = deliveries_summary(dict_rows(conn.execute(
            "SELECT key, deliveries, redeliveries, attempts, crashes, first_at, last_at, last_outcome"
            " FROM deliveries WHERE event_id = ? OR key = ? ORDER BY first_at, key", (event_id, event_id))), receipt)
        effects = {table: dict_rows(conn.execute(f'SELECT * FROM "{table}" WHERE {column} = ?', (event_id,)))
                   for table, column in _event_id_tables(db).items()}
        view = db.spec.view
        by_key = view is not None and view.key_column is not None
        if by_key:
            field = key_field(db.spec, receipt["type"] if receipt else None)
            # the key named, else the receipt's, else a rejection's (a revision-conflict has no receipt)
            known = (receipt or {}).get("key") or next((r["key"] for r in reversed(rejections) if r["key"]), None)
            value, key_state, key_note = key_row(db, event_id, key if key is not None else known, field)
    if receipt is None and not rejections and not deliveries["records"]:
        raise NotFound(f"eventId {event_id} not found in {db.path} (no receipt, delivery or rejection)")
    for rows in effects.values():
        for row in rows:
            row.pop("envelope", None)  # the payload stays out of the trace
    status, summary = _status(receipt, rejections, deliveries)
    cloudevent = (receipt or {}).get("cloudEvent") or next(
        (r["cloudEvent"] for r in rejections if r["cloudEvent"]), None)
    result: Row = {
        "eventId": event_id,
        **({"cloudEvent": cloudevent} if cloudevent else {}),
        "consumer": db.consumer,
        "database": str(db.path),
        "status": status,
        "summary": summary,
        "receipt": receipt,
        "deliveries": deliveries,
        "rejections": rejections,
        "effects": effects,
    }
    if by_key:
        # the row of the event's key: {"field": "orderId", "value": "order-7", "row": {...}}, or a note why not
        result["key"] = {"field": field, "value": value, "row": key_state,
                         **({"note": key_note} if key_note else {})}
    return result


__all__ = ["APPLIED", "PENDING", "REJECTED", "RESOLVED", "cloudevent_matches", "key_field", "trace"]
