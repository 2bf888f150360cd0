"""``trace``: everything known about an eventId, across the deployment or in one database.

Without ``--consumer`` / ``--db`` it follows the event through the
deployment file's producers and consumers (:mod:`delivery_consumer.ops.system_view`);
with one of them, what that one database knows (:mod:`delivery_consumer.inbox.history`).

Exit codes: 0; 1 when the id is found nowhere; 2 for usage, a bad
deployment file or an unusable database.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .. import consumers
from ..model.envelope import is_event_id
from ..model.errors import NotFound
from ..ops import system_view
from ._common import Fatal, checked_deployment, emit_json, handle_errors
from ._output import cell, echo_record, echo_table
from .inbox import Missing, find_first, read_options, reading_all

# -- across the deployment --------------------------------------------------------


@click.command()
@read_options()
@click.option("--key", "--article", "key",
              help="Without EVENT_ID: every event of this key (articleId, orderId, ...) across the deployment, "
                   "by revision. With --consumer: show this key's row beside the event. --article: the same.")
@click.option("--offline", is_flag=True, help="Do not read the dead queues from the broker.")
@click.option("--ce-source", metavar="SOURCE",
              help="EVENT_ID is the id of a CloudEvent from SOURCE (its source attribute): trace the eventId it "
                   "maps to.")
@click.argument("event_id", required=False)
@click.pass_context
@handle_errors
def trace(ctx: click.Context, consumer: str | None, db_path: Path | None, as_json: bool, key: str | None,
          offline: bool, ce_source: str | None, event_id: str | None) -> None:
    """Everything known about EVENT_ID: the producer's outbox row, then each
    consumer's receipt, deliveries, rejections and dead letter, and a one-line
    verdict per consumer (needs a deployment file).

    With --consumer or --db: what that one database knows (the receipt,
    deliveries, rejections, effect rows). An id nobody knows: exit 1.

    EVENT_ID may be a CloudEvent's id as its producer sent it (not a UUID:
    pay-000123-cap): it is looked up with every CloudEvents source the
    consumers have seen, or with --ce-source SOURCE (docs/envelope.md).
    """
    if event_id is not None and ce_source is not None:
        event_id = _event_id(ce_source, event_id)
    elif ce_source is not None:
        raise click.UsageError("--ce-source needs the CloudEvent's id as EVENT_ID")
    if consumer is not None or db_path is not None:
        if event_id is None:
            raise click.UsageError("give the EVENT_ID to trace in this consumer's database")
        ctx.invoke(consumer_trace, consumer=consumer, db_path=db_path, as_json=as_json, key=key,
                   event_id=event_id)
        return
    dep = checked_deployment()
    if event_id is not None and not is_event_id(event_id.strip().lower()):
        event_id = _deployment_cloudevent(dep, event_id)
    elif event_id is not None:
        event_id = event_id.strip().lower()
    try:
        if event_id is None:
            if key is None:
                raise click.UsageError("give an EVENT_ID, or --key KEY")
            shown = system_view.trace_key(dep, key)
            emit_json(shown) if as_json else _echo_key(shown)
            return
        shown = system_view.trace_event(dep, event_id, key=key, broker=not offline)
    except NotFound as exc:
        raise Missing(str(exc)) from None
    if as_json:
        emit_json(shown)
    else:
        _echo_event(shown)


def _event_id(ce_source: str, given: str) -> str:
    """The eventId a CloudEvent's source + id map to."""
    from ..model.cloudevents import event_id_for

    if not ce_source or not given:
        raise click.UsageError("a CloudEvent's source and id are non-empty")
    return event_id_for(ce_source, given)


def _one_match(given: str, matches: list[tuple[str, str, str]], where: str) -> str:
    """The eventId of the one (source, eventId, where) match of CloudEvent id *given*; a clear
    line (exit 1) when there is none, one line per match (exit 2) when there are several."""
    if not matches:
        raise Missing(f"{given[:80]!r} is not a UUID, and no event of {where} came as a CloudEvent with this id "
                      "from a source it has seen; an eventId is written 8-4-4-4-12 in hex, a CloudEvent's id may "
                      "be given with --ce-source SOURCE")
    if len({event_id for _, event_id, _ in matches}) > 1:
        lines = "; ".join(f"eventId {event_id} from source {source} ({seen})" for source, event_id, seen in matches)
        raise Fatal(f"CloudEvent id {given[:80]!r} names several events: {lines}; choose with --ce-source SOURCE")
    source, event_id, _ = matches[0]
    click.echo(f"CloudEvent {given} from {source}: eventId {event_id}", err=True)
    return event_id


def _deployment_cloudevent(dep: Any, given: str) -> str:
    """The eventId of the CloudEvent with id *given* a consumer of the deployment knows."""
    found = system_view.cloudevent_matches(dep, given)
    return _one_match(given, [(r["source"], r["eventId"], ", ".join(r["consumers"])) for r in found],
                      "the deployment's consumers")


#: The outbox row's fields as the text trace names them (--json keeps the keys).
_LABELS = {"createdAt": "enqueued", "publishedAt": "published at", "lastAttemptAt": "last attempt",
           "lastError": "last error", "passedBy": "passed by"}


def _echo_event(shown: dict[str, Any]) -> None:
    click.echo(f"eventId {shown['eventId']} in {shown['deployment']}")
    for row in shown["outbox"]:
        click.echo(f"outbox of producer {row['producer']} ({row['database']}):")
        if "error" in row:
            click.echo(f"  cannot read it: {row['error']}")
            continue
        keys = ["state", "type", row.get("keyField") or "articleId", "revision", "createdAt", "publishedAt",
                "attempts", "lastAttemptAt"]
        if not row.get("publishedAt"):  # once published, an earlier error is history (below)
            keys.insert(7, "lastError")
        keys += [k for k in ("detail", "passedBy") if row.get(k)]
        fields = [(_LABELS.get(k, k), row[k]) for k in keys if k in row]
        fields += [("history", line) for line in system_view.outbox_history(row)]
        echo_record(fields, indent="  ")
    if not shown["outbox"]:
        click.echo("outbox: no producer of the deployment has this eventId")
    elsewhere = [i for i in shown["consumers"] if _elsewhere(i)]
    for item in shown["consumers"]:
        if _elsewhere(item):
            continue
        where = item["consumer"] + (f"/{item['partition']}" if item["partition"] else "")
        click.echo(f"consumer {where} ({item['database']}):")
        if "error" in item:
            click.echo(f"  cannot read it: {item['error']}")
        elif item["trace"] is None:
            click.echo(f"  {item.get('note') or 'no receipt, delivery or rejection'}")
        else:
            _echo_consumer(item["trace"])
        dead = item.get("deadQueue")
        if dead is not None:
            if dead["error"]:
                click.echo(f"  dead queue {dead['queue']}: not read: {dead['error']}")
            elif dead["letters"]:
                for letter in dead["letters"]:
                    click.echo(f"  dead letter NOW in {dead['queue']} (position {letter['position']}): "
                               f"{letter['code']}: {cell(letter['reason'])}")
            else:
                partial = "" if dead["complete"] else " (read partly)"
                click.echo(f"  dead queue {dead['queue']}: no dead letter with this eventId{partial}")
    for name in dict.fromkeys(i["consumer"] for i in elsewhere):
        others = [i for i in elsewhere if i["consumer"] == name]
        click.echo(f"consumer {name}/{', '.join(i['partition'] for i in others)}: {others[0]['verdict']}")
    click.echo("verdict:")
    shown_items = [i for i in shown["consumers"] if not _elsewhere(i)]
    width = max((len(i["consumer"]) + len(i["partition"] or "") + 1 for i in shown_items), default=0)
    for item in shown_items:
        where = item["consumer"] + (f"/{item['partition']}" if item["partition"] else "")
        click.echo(f"  {where:<{width}}  {cell(item['verdict'])}")


def _elsewhere(item: dict[str, Any]) -> bool:
    """A partition that is not the event's key's and knows nothing of the event."""
    return item.get("home") is False and item["trace"] is None and not (item.get("deadQueue") or {}).get("letters") \
        and "error" not in item


def _echo_consumer(shown: dict[str, Any]) -> None:
    receipt = shown["receipt"]
    click.echo(f"  receipt: {receipt['result']} at {receipt['receivedAt']}" if receipt else "  receipt: none")
    d = shown["deliveries"]
    if d["deliveries"]:
        click.echo(f"  deliveries: {d['deliveries']} (redeliveries {d['redeliveries']}, attempts {d['attempts']}, "
                   f"crashes {d['crashes']}), last {d['lastAt']}: {d['lastOutcome']}")
    for rej in shown["rejections"]:
        click.echo(f"  rejection #{rej['id']} {rej['code']} at {rej['rejectedAt']}: {cell(rej['reason'])}")
        click.echo(f"    copy: {rej['deadLetter'] or 'none'}; resolved: {rej['resolvedAt'] or 'no'}")


def _echo_key(shown: dict[str, Any]) -> None:
    labels = sorted({label for event in shown["events"] for label in event["consumers"]})
    rows = []
    for event in shown["events"]:
        box = event["outbox"]
        state = None if box is None else (f"published {box['publishedAt']}" if box["publishedAt"]
                                          else f"unpublished ({box['lastError'] or 'waiting'})")
        receipts = [(event["consumers"].get(label) or {}).get("result") for label in labels]
        rows.append([event["revision"], event["eventId"], event["type"], state, *receipts])
    click.echo(f"{shown['keyField']} {shown['key']} in {shown['deployment']}")
    echo_table(["revision", "eventId", "type", "outbox", *labels], rows)


# -- one consumer's database -----------------------------------------------------


@click.command("trace")
@read_options()
@click.option("--key", "--article", "key",
              help="Show the row of this key (articleId, orderId, ...) rather than the event's own (a consumer "
                   "whose view names a key column). --article: the same.")
@click.argument("event_id")
@handle_errors
def consumer_trace(consumer: str | None, db_path: Path | None, as_json: bool, key: str | None,
                   event_id: str) -> None:
    """Everything the consumer's database knows about EVENT_ID.

    The receipt (result, fingerprint, first seen), the deliveries recorded
    (count, redeliveries, attempts, crashes, first and last time), every
    rejection (code, reason, when, where the copy went, resolved or not), the
    consumer's rows the event wrote and, when its view names a key column,
    the current row of the event's key (orderId order-7: the receipt holds
    it). EVENT_ID may be a CloudEvent's id as its producer sent it. Unknown
    eventId: exit 1.
    """
    from ..inbox.history import cloudevent_matches
    from ..inbox.history import trace as trace_event

    with reading_all(consumer, db_path) as dbs:  # a partitioned consumer: the partition that knows it
        if is_event_id(event_id.strip().lower()):
            event_id = event_id.strip().lower()
        else:
            matches = [(source, found, f"partition {k}" if k is not None else db.consumer)
                       for k, db in dbs for source, found in cloudevent_matches(db, event_id)]
            event_id = _one_match(event_id, matches, "this consumer")
        shown = find_first(dbs, lambda db: trace_event(db, event_id, key=key))
    if as_json:
        emit_json(shown)
        return
    _echo_trace(shown)


def _partition_text(shown: dict[str, Any]) -> str:
    return f", partition {shown['partition']}" if "partition" in shown else ""


def _echo_trace(shown: dict[str, Any]) -> None:
    deliveries = shown["deliveries"]
    origin = shown.get("cloudEvent")
    echo_record([
        ("eventId", shown["eventId"]),
        *([("cloudEvent", f"{origin['id']} from {origin['source']}")] if origin else []),
        ("consumer", f"{shown['consumer']}{_partition_text(shown)} ({shown['database']})"),
        ("status", shown["status"]),
        ("summary", shown["summary"]),
    ])
    receipt = shown["receipt"]
    click.echo("receipt:" + ("" if receipt else " none (never applied)"))
    if receipt:
        meta = sorted((receipt.get("meta") or {}).items())
        echo_record([(k, receipt[k]) for k in ("result", "type", "key", "receivedAt", "fingerprint")
                     if receipt.get(k) is not None] + [(f"meta.{k}", v) for k, v in meta], indent="  ")
    implied = " (the applying one known from the receipt)" if deliveries["fromReceipt"] else ""
    click.echo(f"deliveries: {deliveries['deliveries'] or 'none recorded'}{implied}")
    if deliveries["deliveries"]:
        echo_record([(k, deliveries[k]) for k in ("redeliveries", "attempts", "crashes", "firstAt", "lastAt",
                                                  "lastOutcome")], indent="  ")
    click.echo(f"rejections: {len(shown['rejections']) or 'none'}")
    for rej in shown["rejections"]:
        click.echo(f"  #{rej['id']} {rej['code']} at {rej['rejectedAt']}")
        echo_record([
            ("reason", rej["reason"]),
            *([("key", rej["key"])] if rej.get("key") else []),
            ("copy", rej["deadLetter"] or "none (not dead-lettered)"),
            ("source", rej["source"]),
            ("attempts", rej["attempts"]),
            ("resolved", rej["resolvedAt"] or "no"),
        ], indent="    ")
    keyed = shown.get("key")
    if keyed is not None:
        named = f"{keyed['field']} {keyed['value']}" if keyed["value"] is not None else keyed["field"]
        click.echo(f"{named}:" + ("" if keyed["row"] else f" unknown: {keyed.get('note')}"))
        if keyed["row"]:
            echo_record(list(keyed["row"].items()), indent="  ")
    view = consumers.get(shown["consumer"]).view
    for table, rows in shown["effects"].items():
        if keyed is not None and view is not None and table == view.table:
            continue
        click.echo(f"{table}: {len(rows) or 'no row'}")
        for row in rows:
            echo_record(list(row.items()), indent="  ")


__all__ = ["consumer_trace", "trace"]
