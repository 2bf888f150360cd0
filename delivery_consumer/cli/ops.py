"""Operating a consumer: ``trace``, ``dead list|requeue|purge``, ``inbox prune``.

Each command is a few lines around one library call (:mod:`..trace`,
:mod:`..deadletters`, :mod:`..retention`). pika is imported only inside the
commands that talk to the broker (through the library), never at the top.

Exit codes: 0 done; 1 the eventId is unknown (``trace``) or a selected dead
letter was left in the dead queue (already applied, conflicting, not
confirmed, or not found); 2 usage, database or broker error, or a prune
refused.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from .. import consumers
from ..durations import Duration
from ..errors import DeliveryError
from ..partition_store import partition_db, partitioned_paths
from ..partitions import SLOT_COUNT
from ._common import (
    EXIT_OK,
    EXIT_REJECTED,
    F,
    Fatal,
    consumer_option,
    db_option,
    deployment,
    emit_json,
    handle_errors,
    json_option,
    open_db,
)
from ._output import echo_record, echo_table
from .inbox import find_first, read_options, reading_all
from .rabbit import amqp_options, topology_for


def _partition_option(fn: F) -> F:
    return click.option("--partition", type=click.IntRange(0, SLOT_COUNT - 1), envvar="DELIVERY_PARTITION",
                        help="Partition K of a partitioned consumer: its queues <prefix>.<consumer>.p<K>.* and "
                             "its database state/<consumer>/p<K>/inbox.db.")(fn)


def _one_partition(consumer: str | None, db_path: Path | None, partition: int | None, what: str) -> Path | None:
    """The database a one-partition command uses; a partitioned consumer
    without --partition (or --db) is refused in one line."""
    if partition is not None:
        return partition_db(consumer or "", partition, db_path)
    if consumer is None:
        return db_path
    found = deployment()
    entry = found.consumer(consumer) if found is not None else None
    if found is not None and entry is not None and entry.partitions is not None and db_path in (None, entry.db):
        raise Fatal(f"{found.key(f'consumers.{consumer}')}: {consumer} is partitioned ({entry.partitions} "
                    f"partitions): give --partition K to {what} (each partition has its own queues and database)")
    if db_path is not None and not db_path.is_dir():
        return db_path
    try:  # the deployment file's directory, else --db's, else state/<consumer>/ of the working directory
        paths = partitioned_paths(consumer, db_path if db_path is not None else entry.db if entry else None)
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None
    if paths is not None:
        raise Fatal(f"{consumer} is partitioned here ({len(paths)} partitions): give --partition K to {what} "
                    "(each partition has its own queues and database)")
    return db_path


# -- trace -----------------------------------------------------------------------


@click.command()
@read_options()
@click.option("--article", "article_id",
              help="A consumer whose view is keyed by article (catalog): show this article's row.")
@click.argument("event_id")
@handle_errors
def trace(consumer: str | None, db_path: Path | None, as_json: bool, article_id: str | None, event_id: str) -> None:
    """Everything the consumer's database knows about EVENT_ID.

    The receipt (result, fingerprint, first seen), the deliveries recorded
    (count, redeliveries, attempts, crashes, first and last time), every
    rejection (code, reason, when, where the copy went, resolved or not), the
    consumer's rows the event wrote and, when its view is keyed by article
    (catalog), the current row of its article. Unknown eventId: exit 1.
    """
    from ..trace import trace as trace_event

    with reading_all(consumer, db_path) as dbs:  # a partitioned consumer: the partition that knows it
        shown = find_first(dbs, lambda db: trace_event(db, event_id, article_id=article_id))
    if as_json:
        emit_json(shown)
        return
    _echo_trace(shown)


def _partition_text(shown: dict[str, Any]) -> str:
    return f", partition {shown['partition']}" if "partition" in shown else ""


def _echo_trace(shown: dict[str, Any]) -> None:
    deliveries = shown["deliveries"]
    echo_record([
        ("eventId", shown["eventId"]),
        ("consumer", f"{shown['consumer']}{_partition_text(shown)} ({shown['database']})"),
        ("status", shown["status"]),
        ("summary", shown["summary"]),
    ])
    receipt = shown["receipt"]
    click.echo("receipt:" + ("" if receipt else " none (never applied)"))
    if receipt:
        echo_record([(k, receipt[k]) for k in ("result", "type", "receivedAt", "fingerprint")], indent="  ")
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
            ("copy", rej["deadLetter"] or "none (not dead-lettered)"),
            ("source", rej["source"]),
            ("attempts", rej["attempts"]),
            ("resolved", rej["resolvedAt"] or "no"),
        ], indent="    ")
    if "article" in shown:
        article = shown["article"]
        click.echo("article:" + ("" if article else f" unknown: {shown.get('articleNote')}"))
        if article:
            echo_record(list(article.items()), indent="  ")
    view = consumers.get(shown["consumer"]).view
    for table, rows in shown["effects"].items():
        if "article" in shown and view is not None and table == view.table:
            continue
        click.echo(f"{table}: {len(rows) or 'no row'}")
        for row in rows:
            echo_record(list(row.items()), indent="  ")


# -- dead ------------------------------------------------------------------------


@click.group()
def dead() -> None:
    """The consumer's dead-letter queue (<prefix>.<consumer>.dead).

    Every dead command holds the queue with an exclusive consumer while it
    works, so a second one (or inbox prune) is refused until it ends; what
    it does not remove returns to its place, also if it is killed.
    """


def _selectors(fn: F) -> F:
    fn = click.option("--all", "select_all", is_flag=True, help="Every dead letter.")(fn)
    fn = click.option("--code", help="Dead letters with this code (see dead list).")(fn)
    fn = click.option("--event-id", "-e", "event_ids", multiple=True, help="This eventId (repeatable).")(fn)
    return fn


def _selection(event_ids: tuple[str, ...], code: str | None, select_all: bool) -> Any:
    from ..deadletters import Selection

    try:
        return Selection(frozenset(event_ids), code, select_all)
    except ValueError:
        raise click.UsageError("choose the dead letters with exactly one of --event-id (repeatable), "
                               "--code or --all") from None


def _broker_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from ..amqp.connection import BrokerError

    try:
        return fn(*args, **kwargs)
    except BrokerError as exc:
        raise Fatal(str(exc)) from None


LETTER_COLUMNS = ["#", "failedAt", "code", "attempts", "eventId", "reason"]


def _letter_row(letter: Any) -> list[Any]:
    return [letter.position, letter.failed_at, letter.code, letter.attempts, letter.event_id, letter.reason]


@dead.command("list")
@consumer_option(required=True)
@amqp_options
@_partition_option
@click.option("--code", help="Only dead letters with this code (the counts by code cover all).")
@json_option
@handle_errors
def dead_list(consumer: str, amqp_url: str, exchange: str, queue_prefix: str, partition: int | None,
              code: str | None, as_json: bool) -> None:
    """What is in the dead queue, in queue order, and counts by code.

    Reads every message and gives it back in place: nothing is removed or
    reordered, also while new dead letters arrive (they stay behind).
    """
    from ..deadletters import list_dead

    _one_partition(consumer, None, partition, "read its dead queue")
    topology = topology_for(consumer, exchange, queue_prefix, partition=partition)
    snapshot = _broker_call(list_dead, amqp_url, topology)
    letters = [letter for letter in snapshot.letters if code is None or letter.code == code]
    if as_json:
        emit_json({"queue": snapshot.queue, "count": len(snapshot.letters), "complete": snapshot.complete,
                   "byCode": snapshot.by_code(),
                   "messages": [letter.to_json() for letter in letters]})
        return
    if letters:
        echo_table(LETTER_COLUMNS, [_letter_row(letter) for letter in letters])
    if snapshot.letters:
        click.echo()
        echo_table(["code", "count"], list(snapshot.by_code().items()))
    shown = f", {len(letters)} shown" if code is not None else ""
    partial = "" if snapshot.complete else f"; incomplete: {snapshot.count_at_open} were there when reading began"
    click.echo(f"{len(snapshot.letters)} dead letters in {snapshot.queue}{shown} "
               f"(read and given back in place{partial})", err=True)


def _echo_items(report: Any) -> None:
    for item in report.items:
        letter = item.letter
        detail = f"  {item.detail}" if item.detail else ""
        click.echo(f"{item.outcome:<14} {letter.event_id or '-'}  {letter.code}{detail}")
    for event_id in report.missing:
        click.echo(f"{'not-found':<14} {event_id}  not in {report.queue}")


def _finish(report: Any, as_json: bool, summary: str) -> None:
    if as_json:
        emit_json(report.to_json())
    else:
        _echo_items(report)
        counts = ", ".join(f"{n} {k}" for k, n in sorted(report.counts().items())) or "nothing selected"
        missing = f", {len(report.missing)} not found" if report.missing else ""
        reconciled = (f"; {report.reconciled} older rejections resolved (their dead letters were already gone)"
                      if report.reconciled else "")
        click.echo(f"{summary}: {counts}{missing}{reconciled}", err=True)
    sys.exit(EXIT_REJECTED if report.left_behind else EXIT_OK)


@dead.command("requeue")
@consumer_option(required=True)
@db_option
@amqp_options
@_partition_option
@_selectors
@click.option("--drop-applied", is_flag=True,
              help="Remove dead letters whose event is already applied (default: leave them and report).")
@click.option("--dry-run", is_flag=True, help="Show what would be requeued; change nothing.")
@json_option
@handle_errors
def dead_requeue(consumer: str, db_path: Path | None, amqp_url: str, exchange: str, queue_prefix: str,
                 partition: int | None, event_ids: tuple[str, ...], code: str | None, select_all: bool,
                 drop_applied: bool, dry_run: bool, as_json: bool) -> None:
    """Send dead letters back to the consumer's queue with a fresh attempt count.

    Each copy is confirmed by the broker before its dead letter is removed,
    so a kill at any moment loses nothing (at worst a duplicate, which the
    inbox absorbs). A dead letter whose eventId already has a receipt is
    reported as already applied and left in the dead queue (--drop-applied
    removes it); one whose receipt has another body is left as a conflict.
    Requeued rejections are marked resolved. Exit 1 if anything selected
    was left behind.
    """
    from .. import deadletters

    selection = _selection(event_ids, code, select_all)
    db_path = _one_partition(consumer, db_path, partition, "requeue its dead letters")
    topology = topology_for(consumer, exchange, queue_prefix, partition=partition)
    with ExitStack() as stack:
        db = stack.enter_context(open_db(consumer, db_path))
        dq, snapshot = _broker_call(stack.enter_context, deadletters.reading(amqp_url, topology))
        report = _broker_call(deadletters.requeue, db, dq, snapshot, topology, selection,
                              drop_applied=drop_applied, dry_run=dry_run)
    verb = "would requeue" if dry_run else "requeued"
    _finish(report, as_json, f"{snapshot.queue} -> {topology.queue} ({verb} {report.selection})")


@dead.command("purge")
@consumer_option(required=True)
@db_option
@amqp_options
@_partition_option
@_selectors
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="Show what would be purged; change nothing.")
@json_option
@handle_errors
def dead_purge(consumer: str, db_path: Path | None, amqp_url: str, exchange: str, queue_prefix: str,
               partition: int | None, event_ids: tuple[str, ...], code: str | None, select_all: bool, yes: bool,
               dry_run: bool, as_json: bool) -> None:
    """Remove dead letters for good (asks first unless --yes).

    Their rejections in the consumer's database (if it is here) are marked
    resolved, so that inbox prune may remove the receipts later.
    """
    from .. import deadletters

    selection = _selection(event_ids, code, select_all)
    db_path = _one_partition(consumer, db_path, partition, "purge its dead letters")
    topology = topology_for(consumer, exchange, queue_prefix, partition=partition)
    with ExitStack() as stack:
        db = None
        try:
            db = stack.enter_context(open_db(consumer, db_path))
        except Fatal as exc:
            if db_path is not None or "no such database" not in exc.message:
                raise
            click.echo(f"delivery-consumer: {exc.message}; the rejections will not be marked resolved", err=True)
        dq, snapshot = _broker_call(stack.enter_context, deadletters.reading(amqp_url, topology))
        chosen = snapshot.select(selection)
        if chosen and not dry_run and not yes:
            by_code: dict[str, int] = {}
            for letter, _msg in chosen:
                by_code[letter.code] = by_code.get(letter.code, 0) + 1
            codes = ", ".join(f"{n} {c}" for c, n in sorted(by_code.items()))
            click.echo(f"{len(chosen)} dead letters selected in {snapshot.queue}: {codes}", err=True)
            if not click.confirm("Remove them for good?", default=False, err=True):
                click.echo("nothing removed", err=True)
                sys.exit(EXIT_REJECTED)
        report = _broker_call(deadletters.purge, db, dq, snapshot, selection, dry_run=dry_run)
    verb = "would purge" if dry_run else "purged"
    _finish(report, as_json, f"{snapshot.queue} ({verb} {report.selection})")


# -- inbox prune -----------------------------------------------------------------


@click.command("prune")
@consumer_option()
@db_option
@amqp_options
@_partition_option
@click.option("--older-than", required=True, type=Duration(),
              help="Prune what is older than this (90m, 12h, 30d, 2w); at least the horizon.")
@click.option("--horizon", default="7d", show_default=True, type=Duration(),
              envvar="DELIVERY_REDELIVERY_HORIZON", show_envvar=True,
              help="Redelivery horizon: how late a copy of an event may still arrive.")
@click.option("--batch", default=500, show_default=True, type=click.IntRange(1, 100_000),
              help="Rows per delete transaction.")
@click.option("--without-dead-queue", is_flag=True,
              help="Prune even if the dead queue cannot be read (broker down): only unresolved rejections "
                   "then protect receipts; broker-side delivery-limit dead letters have none.")
@click.option("--dry-run", is_flag=True, help="Count what would go; delete nothing.")
@json_option
@handle_errors
def inbox_prune(consumer: str | None, db_path: Path | None, amqp_url: str, exchange: str, queue_prefix: str,
                partition: int | None, older_than: float, horizon: float, batch: int, without_dead_queue: bool,
                dry_run: bool, as_json: bool) -> None:
    """Delete old receipts, delivery records and resolved rejections, in small batches.

    Never a receipt younger than the redelivery horizon (a shorter
    --older-than is refused), nor one whose event is in the dead queue (read
    from the broker; if it cannot be read the prune is refused unless
    --without-dead-queue) or has an unresolved rejection. A running consumer
    keeps committing meanwhile.
    """
    from .. import deadletters, retention
    from ..amqp.connection import BrokerError

    try:
        retention.check_older_than(older_than, horizon)
    except retention.PruneRefused as exc:
        raise Fatal(f"refused: {exc}") from None
    db_path = _one_partition(consumer, db_path, partition, "prune it")
    with ExitStack() as stack:
        db = stack.enter_context(open_db(consumer, db_path))
        if partition is None:  # a partition's database names its queues
            partition = _stored_partition(db)
        topology = topology_for(db.consumer, exchange, queue_prefix, partition=partition)
        keep: set[str] | None = None
        refresh: Any = lambda: ()  # noqa: E731
        try:
            dq, snapshot = stack.enter_context(deadletters.reading(amqp_url, topology))
        except BrokerError as exc:
            if not without_dead_queue:
                raise Fatal(f"refused: cannot read the dead queue {topology.dead_queue}, so receipts of events "
                            f"still in it could go and a requeue would apply them twice: {exc}. Try again, or "
                            "add --without-dead-queue to rely on unresolved rejections only") from None
            click.echo(f"delivery-consumer: warning: dead queue not read ({exc}); going on without it", err=True)
        else:
            keep = deadletters.event_ids(snapshot.letters)
            reconciled = 0 if dry_run else deadletters.reconcile(db, snapshot)

            def refresh() -> set[str]:  # dead letters that arrive while pruning
                return deadletters.event_ids(deadletters.describe(0, msg) for msg in dq.poll())

        try:
            report = _broker_call(retention.prune, db, older_than_s=older_than, horizon_s=horizon,
                                  keep_event_ids=keep, refresh_keep=refresh,
                                  dead_queue=topology.dead_queue if keep is not None else None,
                                  batch=batch, dry_run=dry_run)
        except retention.PruneRefused as exc:  # pragma: no cover - checked above
            raise Fatal(f"refused: {exc}") from None
        if keep is not None:
            report.dead_letters = len(snapshot.letters)
            if reconciled:
                report.notes.append(f"{reconciled} rejections resolved first: their dead letters had already left "
                                    f"{snapshot.queue}")
    if as_json:
        emit_json(report.to_json())
        return
    _echo_prune(report)


def _stored_partition(db: Any) -> int | None:
    from ..partitions import identity_from_meta

    identity = identity_from_meta(db.meta())
    return identity.partition if identity is not None else None


def _echo_prune(report: Any) -> None:
    from ..retention import format_duration

    verb = "would delete" if report.dry_run else "deleted"
    click.echo(f"{report.consumer} ({report.database}): older than {format_duration(report.older_than_s)} "
               f"(before {report.cutoff}), redelivery horizon {format_duration(report.horizon_s)}")
    if report.dead_queue is not None:
        click.echo(f"dead queue {report.dead_queue}: {report.dead_letters} dead letters, their receipts kept")
    echo_record([
        ("receipts", f"{report.receipts} {verb}; kept: {report.kept_in_dead_queue} in the dead queue, "
                     f"{report.kept_unresolved} with an unresolved rejection"),
        ("deliveries", f"{report.deliveries} {verb}"),
        ("rejections", f"{report.rejections} resolved ones {verb}"),
    ])
    for note in report.notes:
        click.echo(f"note: {note}")
    if not report.dry_run:
        click.echo(f"{report.batches} transactions in {report.seconds:.3f}s", err=True)


__all__ = ["dead", "inbox_prune", "trace"]
