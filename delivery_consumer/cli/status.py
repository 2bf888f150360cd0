"""``status``: one screen for the deployment (:func:`delivery_consumer.ops.system_view.status`).

Exit codes: 0 healthy; 1 something needs a person; 2 for usage or a bad
deployment file.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from ..model import durations
from ..ops import system_view
from ._common import EXIT_OK, EXIT_REJECTED, checked_deployment, emit_json, handle_errors
from ._output import cell, echo_table
from .duration_type import Duration


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
@click.option("--offline", is_flag=True, help="Do not ask the broker (queues and dead letters unknown).")
@click.option("--outbox-max-age", type=Duration(),
              help="An unpublished outbox row older than this needs a person (default: the file's "
                   "[status] outbox_max_age, else 5m).")
@click.option("--backlog-max", type=click.IntRange(0),
              help="Ready messages tolerated in a queue with no consumer connected (default: the file's "
                   "[status] backlog_max, else 0).")
@click.option("--receipt-max-age", type=Duration(),
              help="A backlog with consumers listed but no receipt for longer than this needs a person: ghost "
                   "consumers or a stuck run (default: the file's [status] receipt_max_age, else 2m).")
@click.option("--management-url", metavar="URL",
              help="RabbitMQ's management API (http://host:15672), for each queue's leader, members online "
                   "and quorum (default: $DELIVERY_MANAGEMENT_URL, else the file's management_url; without "
                   "one, only whether each queue can be read).")
@click.option("--broker-timeout", type=Duration(), default=system_view.BROKER_TIMEOUT_S, show_default=True,
              help="Each broker call (the connection, each queue's passive declare, the management API) "
                   "answers within this, or its queue is shown unavailable.")
@handle_errors
def status(as_json: bool, offline: bool, outbox_max_age: float | None, backlog_max: int | None,
           receipt_max_age: float | None, management_url: str | None, broker_timeout: float) -> None:
    """One screen for the deployment: queues (per partition), whether each can
    be read (and its leader and members online, with --management-url), dead
    letters, receipts, outbox.

    Exit 0 when healthy, 1 when something needs a person: a dead letter, a
    message in a partitioned consumer's unrouted queue, an outbox row older
    than --outbox-max-age, more than --backlog-max messages waiting with no
    consumer connected, a backlog with consumers listed but no receipt for
    --receipt-max-age (ghost consumers), a queue that cannot be read (its node
    down, no answer within --broker-timeout) or has lost its quorum, a
    database or broker that cannot be read; with --offline (or the broker
    unreachable), a rejection not yet resolved.
    """
    dep = checked_deployment()
    if outbox_max_age is not None:
        dep = dataclasses.replace(dep, outbox_max_age_s=outbox_max_age)
    if backlog_max is not None:
        dep = dataclasses.replace(dep, backlog_max=backlog_max)
    if receipt_max_age is not None:
        dep = dataclasses.replace(dep, receipt_max_age_s=receipt_max_age)
    if management_url:
        dep = dataclasses.replace(dep, management_url=management_url)
    shown = system_view.status(dep, broker=not offline, timeout_s=broker_timeout)
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
                         system_view.queue_word(db), db.get("leader"), system_view.online_text(db),
                         system_view.notes(db)])
        unrouted = item.get("unrouted")
        if unrouted and unrouted["ready"]:
            rows.append([f"{item['consumer']}/unrouted", unrouted["ready"], None, None, None, None, None, None, None,
                         None, None, None,
                         f"{unrouted['queue']}: reached no partition"])
    if rows:
        echo_table(["consumer", "ready", "unacked", "consumers", "dead letters", "last min", "last hour",
                    "newest", "unresolved", "queue", "leader", "online", "note"], rows)
    prows = []
    for item in shown["producers"]:
        age = item.get("oldestPendingAgeSeconds")
        prows.append([item["producer"], item.get("unpublished"), durations.age(age) if age is not None else None,
                      item.get("failed"), item.get("quarantined"), system_view.notes(item)])
    if prows:
        click.echo()
        echo_table(["producer", "unpublished", "oldest pending", "with errors", "quarantined", "note"], prows)
    click.echo()
    if shown["broker"] is None:
        click.echo("broker not asked (--offline): queue depths, consumers and dead letters unknown")
    elif shown["broker"]["management"] is None and shown["consumers"]:
        click.echo("leaders and members online unknown: no management API given (--management-url, "
                   "$DELIVERY_MANAGEMENT_URL or the file's management_url); each queue's readability is shown")
    if shown["healthy"]:
        click.echo("healthy")
    for problem in shown["problems"]:
        click.echo(f"NEEDS A PERSON: {cell(problem)}")


__all__ = ["status"]
