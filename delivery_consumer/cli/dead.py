"""``dead list|requeue|purge``: the consumer's dead-letter queue.

Each command is a few lines around one call of :mod:`delivery_consumer.ops.deadletters`;
pika is imported only inside the commands (through the library).

Exit codes: 0 done; 1 a selected dead letter was left in the dead queue
(already applied, conflicting, not confirmed, or not found); 2 usage,
database or broker error.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from ._broker import amqp_options, broker_call, topology_for
from ._common import (
    EXIT_OK,
    EXIT_REJECTED,
    F,
    Fatal,
    consumer_option,
    db_option,
    emit_json,
    handle_errors,
    json_option,
    open_db,
)
from ._output import count, echo_table
from ._partition_options import one_partition, one_partition_option
from .inbox import open_writable


@click.group()
def dead() -> None:
    """The consumer's dead-letter queue (<prefix>.<consumer>.dead).

    Every dead command holds the queue with an exclusive consumer while it
    works; a second one (or inbox prune, or a console's read) waits for it up
    to 15 s, then is refused. What it does not remove returns to its place,
    also if it is killed.
    """


def _waiting(refusal: str) -> None:
    """Say once that the queue is held by another reader and the command waits for it."""
    from ..ops.deadletters import BUSY_WAIT_S

    click.echo(f"delivery-consumer: {refusal.split(';')[0]}; waiting up to {BUSY_WAIT_S:g}s for it", err=True)


def _selectors(fn: F) -> F:
    fn = click.option("--all", "select_all", is_flag=True, help="Every dead letter.")(fn)
    fn = click.option("--code", help="Dead letters with this code (see dead list).")(fn)
    fn = click.option("--event-id", "-e", "event_ids", multiple=True, help="This eventId (repeatable).")(fn)
    return fn


def _selection(event_ids: tuple[str, ...], code: str | None, select_all: bool) -> Any:
    from ..ops.deadletters import Selection

    try:
        return Selection(frozenset(event_ids), code, select_all)
    except ValueError:
        raise click.UsageError("choose the dead letters with exactly one of --event-id (repeatable), "
                               "--code or --all") from None


LETTER_COLUMNS = ["#", "failedAt", "code", "attempts", "eventId", "type", "reason"]


def _letter_row(letter: Any) -> list[Any]:
    return [letter.position, letter.failed_at, letter.code, letter.attempts, letter.event_id, letter.type,
            letter.reason]


def _applied(consumer: str, db_path: Path | None, given: bool) -> Any:
    """The consumer's database to look dead letters' events up in: the one --db names
    (*given*), else its own when it exists (None: not looked up)."""
    from ..store.placement import default_db

    if isinstance(db_path, str):  # postgresql://...: the consumer's schema there
        from .inbox import open_readonly

        return open_readonly(consumer, db_path)
    if not given and not (db_path or default_db(consumer)).exists():
        return None
    return open_db(consumer, db_path, readonly=True)


@dead.command("list")
@consumer_option(required=True)
@db_option
@amqp_options
@one_partition_option
@click.option("--code", help="Only dead letters with this code (the counts by code cover all).")
@json_option
@handle_errors
def dead_list(consumer: str, db_path: Path | None, amqp_url: str, exchange: str, queue_prefix: str,
              partition: int | None, code: str | None, as_json: bool) -> None:
    """What is in the dead queue, in queue order, and counts by code.

    Reads every message and gives it back in place: nothing is removed or
    reordered, also while new dead letters arrive (they stay behind). A
    CloudEvent shows the id and source its producer sent. With the
    consumer's database (--db, or its default one when it exists), a dead
    letter whose eventId has a receipt says so (the same body applied from
    another copy, or another body under its eventId).
    """
    from ..ops.deadletters import list_dead, receipts

    given = db_path is not None
    db_path = one_partition(consumer, db_path, partition, "read its dead queue")
    topology = topology_for(consumer, exchange, queue_prefix, partition=partition)
    snapshot = broker_call(list_dead, amqp_url, topology, on_busy=_waiting)
    letters = [letter for letter in snapshot.letters if code is None or letter.code == code]
    applied: dict[int, dict[str, Any]] | None = None
    with ExitStack() as stack:
        db = _applied(consumer, db_path, given)
        if db is not None:
            applied = receipts(stack.enter_context(db), letters)
    if as_json:
        emit_json({"queue": snapshot.queue, "count": len(snapshot.letters), "complete": snapshot.complete,
                   "byCode": snapshot.by_code(),
                   "messages": [{**letter.to_json(), **({"receipt": applied.get(letter.position)}
                                                        if applied is not None else {})} for letter in letters]})
        return
    if letters:
        columns, rows = list(LETTER_COLUMNS), [_letter_row(letter) for letter in letters]
        if any(letter.origin for letter in letters):
            columns.insert(5, "cloudEvent")
            for row, letter in zip(rows, letters, strict=True):
                row.insert(5, f"{letter.origin[1]} from {letter.origin[0]}" if letter.origin else None)
        if applied:
            columns.insert(-1, "receipt")
            for row, letter in zip(rows, letters, strict=True):
                receipt = applied.get(letter.position)
                row.insert(-1, None if receipt is None else
                           receipt["result"] + ("" if receipt["sameBody"] else " (another body)"))
        echo_table(columns, rows)
    if snapshot.letters:
        click.echo()
        echo_table(["code", "count"], list(snapshot.by_code().items()))
    shown = f", {len(letters)} shown" if code is not None else ""
    partial = "" if snapshot.complete else f"; incomplete: {snapshot.count_at_open} were there when reading began"
    click.echo(f"{count(len(snapshot.letters), 'dead letter')} in {snapshot.queue}{shown} "
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
@one_partition_option
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
    from ..ops import deadletters

    selection = _selection(event_ids, code, select_all)
    topology = topology_for(consumer, exchange, queue_prefix, partition=partition)
    with ExitStack() as stack:
        db = open_writable(consumer, db_path, partition, "requeue its dead letters")
        stack.callback(db.close)
        dq, snapshot = broker_call(stack.enter_context, deadletters.reading(amqp_url, topology, on_busy=_waiting))
        report = broker_call(deadletters.requeue, db, dq, snapshot, topology, selection,
                              drop_applied=drop_applied, dry_run=dry_run)
    verb = "would requeue" if dry_run else "requeued"
    _finish(report, as_json, f"{snapshot.queue} -> {topology.queue} ({verb} {report.selection})")


@dead.command("purge")
@consumer_option(required=True)
@db_option
@amqp_options
@one_partition_option
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
    from ..ops import deadletters

    selection = _selection(event_ids, code, select_all)
    named = db_path is not None or partition is not None
    topology = topology_for(consumer, exchange, queue_prefix, partition=partition)
    with ExitStack() as stack:
        db = None
        try:
            db = open_writable(consumer, db_path, partition, "purge its dead letters")
            stack.callback(db.close)
        except Fatal as exc:
            if named or "no such database" not in exc.message:
                raise
            click.echo(f"delivery-consumer: {exc.message}; the rejections will not be marked resolved", err=True)
        dq, snapshot = broker_call(stack.enter_context, deadletters.reading(amqp_url, topology, on_busy=_waiting))
        chosen = snapshot.select(selection)
        if chosen and not dry_run and not yes:
            by_code: dict[str, int] = {}
            for letter, _msg in chosen:
                by_code[letter.code] = by_code.get(letter.code, 0) + 1
            codes = ", ".join(f"{n} {c}" for c, n in sorted(by_code.items()))
            click.echo(f"{count(len(chosen), 'dead letter')} selected in {snapshot.queue}: {codes}", err=True)
            if not click.confirm("Remove them for good?", default=False, err=True):
                click.echo("nothing removed", err=True)
                sys.exit(EXIT_REJECTED)
        report = broker_call(deadletters.purge, db, dq, snapshot, selection, dry_run=dry_run)
    verb = "would purge" if dry_run else "purged"
    _finish(report, as_json, f"{snapshot.queue} ({verb} {report.selection})")


__all__ = ["dead"]
