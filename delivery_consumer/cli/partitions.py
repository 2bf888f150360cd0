"""``repartition`` (change a partitioned consumer's count: drain, then switch)
and ``reroute`` (send what waits in its unrouted queue back through the slot route)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import DeliveryError
from ..partition_store import partitioned_paths, split_merge
from ..partitions import SLOT_COUNT, partition_topologies, route, unrouted_name
from ._broker import amqp_options, topology_for
from ._common import EXIT_OK, EXIT_REJECTED, Fatal, consumer_option, handle_errors


@click.command()
@consumer_option(required=True)
@amqp_options
@click.option("--partitions", "count", required=True, type=click.IntRange(1, SLOT_COUNT),
              help="The new partition count.")
@click.option("--state", "root", type=click.Path(path_type=Path), default=Path("state"), show_default=True,
              help="Directory holding <consumer>/p<k>/inbox.db.")
@handle_errors
def repartition(consumer: str, amqp_url: str, exchange: str, queue_prefix: str, count: int, root: Path) -> None:
    """Move a partitioned consumer to COUNT partitions: its databases and its queues.

    Refused unless every queue of the consumer (each partition's queue,
    retry tiers and dead queue, and the unrouted queue) is empty and has no
    consumer: stop the producers' dispatch, let the runs drain the queues,
    stop them, then run this. Every article's catalog row, receipts and
    fence rows move to their new partition; the new slot bindings are
    declared before the old ones are removed, and queues no longer needed
    are deleted. Run it again if it was interrupted.
    """
    from ..amqp.admin import declare, delete_unused_queues, queue_counts
    from ..amqp.connection import BrokerError

    base = topology_for(consumer, exchange, queue_prefix)
    paths = partitioned_paths(consumer, None, root)
    unpartitioned = paths is None
    if paths is None:
        if not (root / consumer / "inbox.db").is_file():
            raise Fatal(f"{root / consumer}: no database of {consumer} here (inbox.db or p0/inbox.db ...)")
        paths = [root / consumer / "inbox.db"]
    old = len(paths)
    previous: int | None = None if unpartitioned else old
    if old == count and not unpartitioned:  # done before, or nothing to do: finish the broker side again
        meta_from = _repartitioned_from(paths[0])
        unpartitioned = meta_from == "unpartitioned"
        previous = None if unpartitioned else int(meta_from) if meta_from is not None else old
    old_topologies = partition_topologies(base, max(old, previous or 0)) + ([base] if unpartitioned else [])
    old_queues = [q for t in old_topologies for q, _ in t.queues()]
    old_queues.append(unrouted_name(base))
    try:
        states = queue_counts(amqp_url, old_queues, name="delivery-consumer repartition")
    except BrokerError as exc:
        raise Fatal(str(exc)) from None
    busy = [f"{q} ({s.ready} messages, {s.consumers} consumers)" for q, s in states.items()
            if s is not None and (s.ready or s.consumers)]
    if busy:
        raise Fatal(f"refused: drain the queues and stop every run first; still busy: {', '.join(busy)}")
    if old != count or paths == [root / consumer / "inbox.db"]:
        try:
            moved = split_merge(consumer, count, root)
        except DeliveryError as exc:
            raise Fatal(str(exc)) from None
        for k, tables in sorted(moved.rows.items()):
            rows = ", ".join(f"{n} {t}" for t, n in sorted(tables.items()))
            click.echo(f"p{k}: {rows}")
        click.echo(f"{consumer}: databases moved from {old} to {count} partitions; the old ones are in {moved.backup}",
                   err=True)
    marker = partition_topologies(base, count)[0].count_marker
    try:
        delete_unused_queues(amqp_url, [marker])  # it records the old count; empty, never consumed
        declare(amqp_url, partition_topologies(base, count), routes=[route(base, count, previous=previous)])
        gone = partition_topologies(base, previous)[count:] if previous is not None else [base]
        obsolete = [q for t in gone for q, _ in t.queues() if q != marker]
        kept = delete_unused_queues(amqp_url, obsolete)
    except BrokerError as exc:
        raise Fatal(f"{exc} (the databases are at {count} partitions: run repartition again)") from None
    click.echo(f"{consumer}: queues {base.prefix}.{consumer}.p0 .. p{count - 1} routed by slot mod {count}"
               + (f"; {len(obsolete) - len(kept)} queues of the old partitions deleted" if obsolete else "")
               + (f"; kept (not empty or in use): {', '.join(kept)}" if kept else ""), err=True)


def _repartitioned_from(path: Path) -> str | None:
    """The count a database was repartitioned from ("unpartitioned" from a plain consumer)."""
    from .. import sqlite

    with sqlite.reading(path) as conn:
        row = conn.execute("SELECT value FROM meta WHERE key = 'repartitioned_from'").fetchone()
    return str(row[0]) if row else None


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
    from ..amqp.connection import BrokerError
    from ..partitions import reroute as reroute_messages

    base = topology_for(consumer, exchange, queue_prefix)
    try:
        done = reroute_messages(amqp_url, base, dry_run=dry_run)
    except BrokerError as exc:
        raise Fatal(str(exc)) from None
    for item in done:
        click.echo(f"{item.outcome:<10} {item.event_id or '-'}")
    left = [item for item in done if item.outcome.startswith("left")]
    click.echo(f"{len(done) - len(left)} of {len(done)} messages from {unrouted_name(base)} "
               + ("would be rerouted" if dry_run else "rerouted"), err=True)
    sys.exit(EXIT_REJECTED if left else EXIT_OK)


__all__ = ["repartition", "reroute"]
