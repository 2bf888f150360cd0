"""The system view: ``trace`` across the deployment, ``status``, ``config check``.

Each command is a few lines around :mod:`delivery_consumer.system` or
:mod:`delivery_consumer.config`. ``trace`` with ``--consumer`` or ``--db``
is the per-consumer trace of :mod:`.ops`, unchanged.

Exit codes: 0; 1 when ``trace`` finds the id nowhere or ``status`` finds
something that needs a person; 2 for usage, a bad deployment file or an
unusable database.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from .. import durations, system
from ..config import Deployment
from ..queries import NotFound
from ..topology import DEFAULT_EXCHANGE, DEFAULT_PREFIX
from ._common import BROKER_ENV, EXIT_ERROR, EXIT_OK, EXIT_REJECTED, Fatal, deployment, emit_json, handle_errors
from ._output import cell, echo_record, echo_table
from .inbox import Missing, read_options
from .ops import trace as consumer_trace


def checked_deployment(*, owners: bool = True) -> Deployment:
    """The deployment file, or exit 2 in one line; with *owners*, also when it gives a consumer
    a database of another consumer or of a producer (a mistake in the file, not a state to report)."""
    from ..config import foreign_databases

    found = deployment()
    if found is None:
        raise Fatal("no deployment file: give --config PATH (or DELIVERY_CONFIG), or run where ./delivery.toml is")
    foreign = foreign_databases(found) if owners else []
    if foreign:
        raise Fatal(foreign[0] + (f" (and {len(foreign) - 1} more: config check lists them)"
                                  if len(foreign) > 1 else ""))
    return found


# -- trace -------------------------------------------------------------------------------


@click.command()
@read_options()
@click.option("--article", "article_id",
              help="Without EVENT_ID: every event of this article across the deployment, by revision. "
                   "With --consumer catalog: show this article beside the event.")
@click.option("--offline", is_flag=True, help="Do not read the dead queues from the broker.")
@click.argument("event_id", required=False)
@click.pass_context
@handle_errors
def trace(ctx: click.Context, consumer: str | None, db_path: Path | None, as_json: bool, article_id: str | None,
          offline: bool, event_id: str | None) -> None:
    """Everything known about EVENT_ID: the producer's outbox row, then each
    consumer's receipt, deliveries, rejections and dead letter, and a one-line
    verdict per consumer (needs a deployment file).

    With --consumer or --db: what that one database knows (the receipt,
    deliveries, rejections, effect rows). An id nobody knows: exit 1.
    """
    if consumer is not None or db_path is not None:
        if event_id is None:
            raise click.UsageError("give the EVENT_ID to trace in this consumer's database")
        ctx.invoke(consumer_trace, consumer=consumer, db_path=db_path, as_json=as_json, article_id=article_id,
                   event_id=event_id)
        return
    dep = checked_deployment()
    try:
        if event_id is None:
            if article_id is None:
                raise click.UsageError("give an EVENT_ID, or --article ID")
            shown = system.trace_article(dep, article_id)
            emit_json(shown) if as_json else _echo_article(shown)
            return
        shown = system.trace_event(dep, event_id, article_id=article_id, broker=not offline)
    except NotFound as exc:
        raise Missing(str(exc)) from None
    if as_json:
        emit_json(shown)
    else:
        _echo_event(shown)


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
        keys = ["state", "type", "articleId", "revision", "createdAt", "publishedAt", "attempts", "lastAttemptAt"]
        if not row.get("publishedAt"):  # once published, an earlier error is history (below)
            keys.insert(7, "lastError")
        keys += [k for k in ("detail", "passedBy") if row.get(k)]
        fields = [(_LABELS.get(k, k), row[k]) for k in keys if k in row]
        fields += [("history", line) for line in system.outbox_history(row)]
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
    """A partition that is not the event's article's and knows nothing of the event."""
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


def _echo_article(shown: dict[str, Any]) -> None:
    labels = sorted({label for event in shown["events"] for label in event["consumers"]})
    rows = []
    for event in shown["events"]:
        box = event["outbox"]
        state = None if box is None else (f"published {box['publishedAt']}" if box["publishedAt"]
                                          else f"unpublished ({box['lastError'] or 'waiting'})")
        receipts = [(event["consumers"].get(label) or {}).get("result") for label in labels]
        rows.append([event["revision"], event["eventId"], event["type"], state, *receipts])
    click.echo(f"articleId {shown['articleId']} in {shown['deployment']}")
    echo_table(["revision", "eventId", "type", "outbox", *labels], rows)


# -- status ------------------------------------------------------------------------------


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
@click.option("--offline", is_flag=True, help="Do not ask the broker (queues and dead letters unknown).")
@click.option("--outbox-max-age", type=durations.Duration(),
              help="An unpublished outbox row older than this needs a person (default: the file's "
                   "[status] outbox_max_age, else 5m).")
@click.option("--backlog-max", type=click.IntRange(0),
              help="Ready messages tolerated in a queue with no consumer connected (default: the file's "
                   "[status] backlog_max, else 0).")
@handle_errors
def status(as_json: bool, offline: bool, outbox_max_age: float | None, backlog_max: int | None) -> None:
    """One screen for the deployment: queues (per partition), dead letters,
    receipts, outbox.

    Exit 0 when healthy, 1 when something needs a person: a dead letter, a
    message in a partitioned consumer's unrouted queue, an outbox row older
    than --outbox-max-age, more than --backlog-max messages waiting with no
    consumer connected, a database or broker that cannot be read.
    """
    dep = checked_deployment()
    if outbox_max_age is not None:
        dep = dataclasses.replace(dep, outbox_max_age_s=outbox_max_age)
    if backlog_max is not None:
        dep = dataclasses.replace(dep, backlog_max=backlog_max)
    shown = system.status(dep, broker=not offline)
    if as_json:
        emit_json(shown)
    else:
        _echo_status(shown)
    sys.exit(EXIT_OK if shown["healthy"] else EXIT_REJECTED)


def _dead_text(dead: int | None, codes: dict[str, int] | None) -> str | None:
    if dead is None:
        return None
    return f"{dead}" + (f" ({', '.join(f'{n} {c}' for c, n in codes.items())})" if codes else "")


def _echo_status(shown: dict[str, Any]) -> None:
    click.echo(f"deployment {shown['deployment']} at {shown['now']}")
    rows = []
    for item in shown["consumers"]:
        for db in item["databases"]:
            label = item["consumer"] + (f"/{db['partition']}" if db["partition"] else "")
            rejections = db.get("unresolvedRejections")
            unresolved = None if rejections is None else sum(rejections.values())
            newest = durations.age(db.get("newestAgeSeconds")) + " ago" if db.get("newestReceivedAt") else None
            rows.append([label, db["ready"], db["unacked"], db["consumersConnected"],
                         _dead_text(db["deadLetters"], db["deadByCode"]), db.get("receiptsLastMinute"),
                         db.get("receiptsLastHour"), newest, unresolved,
                         system.notes(db)])
        unrouted = item.get("unrouted")
        if unrouted and unrouted["ready"]:
            rows.append([f"{item['consumer']}/unrouted", unrouted["ready"], None, None, None, None, None, None, None,
                         f"{unrouted['queue']}: reached no partition"])
    if rows:
        echo_table(["consumer", "ready", "unacked", "consumers", "dead letters", "last min", "last hour",
                    "newest", "unresolved", "note"], rows)
    prows = []
    for item in shown["producers"]:
        age = item.get("oldestUnpublishedAgeSeconds")
        prows.append([item["producer"], item.get("unpublished"), durations.age(age) if age is not None else None,
                      item.get("failed"), item.get("quarantined"), system.notes(item)])
    if prows:
        click.echo()
        echo_table(["producer", "unpublished", "oldest", "with errors", "quarantined", "note"], prows)
    click.echo()
    if shown["healthy"]:
        click.echo("healthy")
    for problem in shown["problems"]:
        click.echo(f"NEEDS A PERSON: {cell(problem)}")


# -- config check ------------------------------------------------------------------------


def _from_env(key: str) -> str:
    """`` (from $VAR)`` when the environment overrides the file's *key*."""
    var = BROKER_ENV[key]
    return f" (from ${var})" if os.environ.get(var) else ""


#: Partitions whose run line ``config check`` prints (``--json`` has them all).
PARTITIONS_SHOWN = 4


@click.group()
def config() -> None:
    """The deployment file (--config, DELIVERY_CONFIG, ./delivery.toml)."""


@config.command("check")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
@handle_errors
def config_check(as_json: bool) -> None:
    """Validate the deployment file and show what each command would use.

    Opens every database that exists, read-only: one of another consumer, or
    a producer database without an outbox, is an error (exit 2).
    """
    from .. import config as config_lib
    from .. import outbox
    from ..amqp.connection import redact

    dep = checked_deployment(owners=False)  # every problem below, not only the first
    problems: list[str] = []
    consumers: list[dict[str, Any]] = []
    for name, entry in dep.consumers.items():
        problems += config_lib.check_database(dep, entry)
        count = system.partition_count(entry) if entry.partitions or entry.db.is_dir() else None
        runs = []
        for partition, path, topo in system.places(dep, entry):
            # without the file, each line alone must still name the database, queues and options
            run = ["delivery-consumer", "run", "--consumer", name, "--db", str(path)]
            if partition is not None and count is not None:
                run += ["--partition", partition[1:], "--partitions", str(count)]
            run += [f"--exchange={dep.exchange}"] if dep.exchange != DEFAULT_EXCHANGE else []
            run += [f"--queue-prefix={dep.queue_prefix}"] if dep.queue_prefix != DEFAULT_PREFIX else []
            for key, value in entry.options.items():
                if key == "metrics_port" and partition is not None:
                    value += int(partition[1:])  # one port per partition, as run takes it from the file
                run.append(f"--{key.replace('_', '-')}={value}")
            runs.append({"partition": partition, "database": str(path), "queue": topo.queue,
                         "deadQueue": topo.dead_queue, "run": shlex.join(run)})
        consumers.append({"consumer": name, "db": str(entry.db), "exists": entry.db.exists(),
                          "partitions": count, "databases": [r["database"] for r in runs],
                          "queue": runs[0]["queue"] if count is None else None,
                          "deadQueue": runs[0]["deadQueue"] if count is None else None, "options": entry.options,
                          "run": runs[0]["run"] if count is None else None,
                          **({"partitionRuns": runs} if count is not None else {})})
    producers = []
    for name, producer in dep.producers.items():
        if producer.db.exists():
            try:
                outbox.connect(producer.db, readonly=True).close()
            except Exception as exc:  # DatabaseError, or sqlite3's own for a damaged file
                problems.append(f"{dep.key(f'producers.{name}.db')}: {exc}")
        producers.append({"producer": name, "db": str(producer.db), "exists": producer.db.exists()})
    single = dep.single_producer()
    shown = {"file": str(dep.path), "amqpUrl": redact(dep.amqp_url), "exchange": dep.exchange,
             "queuePrefix": dep.queue_prefix, "managementUrl": dep.management_url,
             "outboxMaxAgeSeconds": dep.outbox_max_age_s, "backlogMax": dep.backlog_max,
             "consumers": consumers, "producers": producers,
             "producerCommandsUse": str(single.db) if single else None, "problems": problems}
    if as_json:
        emit_json(shown)
    else:
        echo_record([("file", shown["file"]), ("broker", redact(dep.amqp_url) + _from_env("amqp_url")),
                     ("exchange", dep.exchange + _from_env("exchange")),
                     ("queue prefix", dep.queue_prefix + _from_env("queue_prefix")),
                     ("outbox max age", durations.format(dep.outbox_max_age_s))])
        for c in consumers:
            click.echo(f"consumer {c['consumer']}: {c['db']}" + ("" if c["exists"] else " (not created yet)")
                       + (f", {c['partitions']} partitions" if c["partitions"] else ""))
            if c["partitions"] is None:
                click.echo(f"  queues {c['queue']}, {c['deadQueue']}; run: {c['run']}")
                continue
            for r in c["partitionRuns"][:PARTITIONS_SHOWN]:
                click.echo(f"  {r['partition']}: queues {r['queue']}, {r['deadQueue']}; run: {r['run']}")
            if len(c["partitionRuns"]) > PARTITIONS_SHOWN:
                click.echo(f"  ... and so on to p{len(c['partitionRuns']) - 1} (--json lists them all)")
        for p in producers:
            click.echo(f"producer {p['producer']}: {p['db']}" + ("" if p["exists"] else " (not created yet)"))
        if single is not None:
            click.echo(f"dispatch, outbox and produce use {single.db} unless --db is given")
        elif producers:
            click.echo("several producers: dispatch, outbox and produce need --db")
        for problem in problems:
            click.echo(f"delivery-consumer: {problem}", err=True)
        if not problems:
            click.echo("ok", err=True)
    sys.exit(EXIT_ERROR if problems else EXIT_OK)


__all__ = ["config", "status", "trace"]
