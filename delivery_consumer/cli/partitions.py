"""``repartition`` (change a partitioned consumer's count: drain, then switch)
and ``reroute`` (send what waits in its unrouted queue back through the slot route)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..amqp.partitions import SLOT_COUNT, unrouted_name
from ..consumers import find
from ..model.errors import DeliveryError
from ..model.event_types import EventTypes
from ..ops.partition_databases import finish, pending_layout, repartitioned_from, split_merge
from ..store.placement import resolve
from ._broker import amqp_options, topology_for
from ._common import EXIT_OK, EXIT_REJECTED, Fatal, consumer_option, handle_errors


@click.command()
@consumer_option(required=True)
@amqp_options
@click.option("--partitions", "count", type=click.IntRange(1, SLOT_COUNT), help="The new partition count.")
@click.option("--unpartitioned", is_flag=True, help="Merge the partitions into one unpartitioned consumer.")
@click.option("--state", "root", type=click.Path(path_type=Path), default=Path("state"), show_default=True,
              help="Directory holding <consumer>/p<k>/inbox.db.")
@handle_errors
def repartition(consumer: str, amqp_url: str, exchange: str, queue_prefix: str, count: int | None,
                unpartitioned: bool, root: Path) -> None:
    """Move a consumer to --partitions N partitions (or, --unpartitioned,
    back to one unpartitioned consumer): its databases and its queues.

    Stop every run of the consumer first; its producers may go on publishing,
    and its queues may hold any number of messages. Refused while any of its
    queues has a consumer. Every article's catalog row, receipts and fence
    rows move to their new partition; the new queues and slot bindings are
    declared before the old ones are removed; then every message the former
    layout's queues hold is moved by its key to its new partition's handover
    queue, which that partition's run applies before its own queue, so each
    article's events stay in order. Run it again if it was interrupted or
    could not finish (it says so, exit 2): the runs refuse to start until it
    has.
    """
    from ..amqp.admin import queue_counts
    from ..amqp.partition_queues import describe, layout, move_layout, switch_layout
    from ..model.errors import BrokerError
    from ..model.faults import pausepoint

    if (count is None) != unpartitioned:
        raise click.UsageError("give --partitions N or --unpartitioned")
    base = topology_for(consumer, exchange, queue_prefix)
    paths = resolve(consumer, root=root).checked()
    plain = root / consumer / "inbox.db"
    if paths is None:
        if not plain.is_file():
            raise Fatal(f"{root / consumer}: no database of {consumer} here (inbox.db or p0/inbox.db ...)")
        paths = [plain]
    current = None if paths == [plain] else len(paths)
    try:
        pending = pending_layout(paths[0])
        recorded = repartitioned_from(paths[0])
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None
    # The databases are at the target already (done before, or interrupted after the swap): the broker side.
    switched = current == count
    previous = current
    if switched and recorded is not None:
        previous = None if recorded == "unpartitioned" else int(recorded)
    relayout = not switched or (pending is not None and previous != count)
    queues = [q for t in layout(base, previous) + layout(base, count)
              for q in (*(name for name, _ in t.queues()), t.handover_queue)]
    try:
        states = queue_counts(amqp_url, list(dict.fromkeys([*queues, unrouted_name(base)])),
                              name="delivery-consumer repartition")
    except BrokerError as exc:
        raise Fatal(str(exc)) from None
    busy = [f"{q} ({_n(s.consumers, 'consumer')})" for q, s in states.items() if s is not None and s.consumers]
    if busy:
        raise Fatal(f"refused: stop every run of {consumer} first; still consumed: {', '.join(busy)}")
    if not switched:
        try:
            done = split_merge(consumer, count, root)
        except DeliveryError as exc:
            raise Fatal(str(exc)) from None
        for k, tables in sorted(done.rows.items()):
            rows = ", ".join(f"{n} {t}" for t, n in sorted(tables.items()))
            click.echo(f"{'inbox.db' if count is None else f'p{k}'}: {rows}")
        click.echo(f"{consumer}: databases moved from {describe(current)} to {describe(count)}; the old ones are in "
                   f"{done.backup}", err=True)
    pausepoint("repartition-before-switch")
    try:
        switch_layout(amqp_url, base, previous, count)
        moved = move_layout(amqp_url, base, previous, count, relayout=relayout, rerun=switched,
                            types=event_types_of(consumer))
    except BrokerError as exc:
        raise Fatal(f"{exc} (the databases are at {describe(count)}: run repartition again)") from None
    if moved.moved or moved.kept:
        into = ", ".join(f"{q} {n}" for q, n in sorted(moved.into.items()))
        click.echo(f"{consumer}: {_n(moved.moved, 'message')} of the former layout moved to their partitions by key"
                   + (f" ({into})" if into else "") + (f"; {moved.kept} dead letters kept in place" if moved.kept
                                                        else ""), err=True)
    again = f"delivery-consumer repartition --consumer {consumer} " + (
        "--unpartitioned" if count is None else f"--partitions {count}")
    if moved.left or moved.stuck:
        held = [f"{q} ({_n(s.ready, 'message')}, {_n(s.consumers, 'consumer')})" for q, s in moved.stuck.items()]
        held += [f"{event_id or '-'} {why}" for event_id, why in moved.left[:5]]
        raise Fatal(f"{consumer}: switched to {describe(count)}, but not finished: {'; '.join(held)}; stop what "
                    f"consumes them and run {again} again (the runs refuse to start until it has finished)")
    try:
        finish(resolve(consumer, root=root).checked() or [plain])
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None
    routed = (f"queue {base.queue} bound to {base.exchange}" if count is None
              else f"queues {base.prefix}.{consumer}.p0 .. p{count - 1} routed by slot mod {count}")
    click.echo(f"{consumer}: {routed}; start its runs", err=True)


def _n(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


@click.command()
@consumer_option(required=True)
@amqp_options
@click.option("--dry-run", is_flag=True, help="Show what would be rerouted; change nothing.")
@handle_errors
def reroute(consumer: str, amqp_url: str, exchange: str, queue_prefix: str, dry_run: bool) -> None:
    """Send the messages waiting in <prefix>.<consumer>.unrouted to their partitions.

    They arrived without the slot headers (a producer that does not follow
    the routing contract); each goes back through the consumer's slot route
    with the headers of its articleId, confirmed before it leaves the queue.
    Arriving late, an older revision may then be answered stale. Exit 1 if
    any message was left in the queue.
    """
    from ..amqp.partition_queues import reroute as reroute_messages
    from ..model.errors import BrokerError

    base = topology_for(consumer, exchange, queue_prefix)
    try:
        done = reroute_messages(amqp_url, base, types=event_types_of(consumer), dry_run=dry_run)
    except BrokerError as exc:
        raise Fatal(str(exc)) from None
    for item in done:
        click.echo(f"{item.outcome:<10} {item.event_id or '-'}")
    left = [item for item in done if item.outcome.startswith("left")]
    click.echo(f"{len(done) - len(left)} of {len(done)} messages from {unrouted_name(base)} "
               + ("would be rerouted" if dry_run else "rerouted"), err=True)
    sys.exit(EXIT_REJECTED if left else EXIT_OK)


__all__ = ["repartition", "reroute"]


def event_types_of(consumer: str) -> EventTypes | None:
    """The event types of *consumer* (None: the default ones), by which its messages are moved by key."""
    spec = find(consumer)
    return spec.event_types if spec is not None else None
