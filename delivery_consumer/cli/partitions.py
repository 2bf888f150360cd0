"""``repartition`` (change a partitioned consumer's count: drain, then switch)
and ``reroute`` (send what waits in its unrouted queue back through the slot route)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import DeliveryError
from ..partition_queues import Rerouted
from ..partition_store import repartitioned_from, split_merge
from ..partitions import SLOT_COUNT, partition_topologies, partition_topology, route, unrouted_name
from ..placement import resolve
from ..topology import Binding, Route, Topology
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
    declared before the old ones are removed. Whatever reached the old
    queues meanwhile is then moved to its new partition by its key, and
    queues no longer needed are deleted. Run it again if it was interrupted
    or could not finish (it says so, exit 2).
    """
    from ..amqp.admin import declare, delete_unused_queues, queue_counts
    from ..errors import BrokerError
    from ..faults import pausepoint

    base = topology_for(consumer, exchange, queue_prefix)
    paths = resolve(consumer, root=root).checked()
    unpartitioned = paths is None
    if paths is None:
        if not (root / consumer / "inbox.db").is_file():
            raise Fatal(f"{root / consumer}: no database of {consumer} here (inbox.db or p0/inbox.db ...)")
        paths = [root / consumer / "inbox.db"]
    old = len(paths)
    previous: int | None = None if unpartitioned else old
    # The databases are at COUNT already (done before, or interrupted after the swap): finish the broker side.
    switched = old == count and not unpartitioned
    if switched:
        meta_from = repartitioned_from(paths[0])
        unpartitioned = meta_from == "unpartitioned"
        previous = None if unpartitioned else int(meta_from) if meta_from is not None else old
    olds: list[tuple[Topology, int | None, int]] = [(base, None, 1)] if unpartitioned else [
        (partition_topology(base, k), k, previous or old) for k in range(previous or old)]
    old_queues = [q for t in partition_topologies(base, max(old, previous or 0)) + [t for t, _, _ in olds]
                  for q, _ in t.queues()]
    old_queues.append(unrouted_name(base))
    try:
        states = queue_counts(amqp_url, list(dict.fromkeys(old_queues)), name="delivery-consumer repartition")
    except BrokerError as exc:
        raise Fatal(str(exc)) from None
    # Once switched, messages in the old queues are what this command moves; a consumer still holds them.
    busy = [f"{q} ({_n(s.ready, 'message')}, {_n(s.consumers, 'consumer')})" for q, s in states.items()
            if s is not None and (s.consumers or (s.ready and not switched))]
    if busy:
        raise Fatal(f"refused: drain the queues and stop every run first; still busy: {', '.join(busy)}")
    if not switched:
        try:
            moved = split_merge(consumer, count, root)
        except DeliveryError as exc:
            raise Fatal(str(exc)) from None
        for k, tables in sorted(moved.rows.items()):
            rows = ", ".join(f"{n} {t}" for t, n in sorted(tables.items()))
            click.echo(f"p{k}: {rows}")
        click.echo(f"{consumer}: databases moved from {old} to {count} partitions; the old ones are in {moved.backup}",
                   err=True)
    pausepoint("repartition-before-switch")
    marker = partition_topologies(base, count)[0].count_marker
    current = {q for t in partition_topologies(base, count) for q, _ in t.queues()}
    try:
        delete_unused_queues(amqp_url, [marker])  # it records the old count; empty, never consumed
        routes = [route(base, count, previous=previous)]
        if unpartitioned and states.get(base.queue) is not None:  # its events now go through the slots only
            routes.append(Route(unbind=tuple(Binding(base.exchange, base.queue, key) for key in base.binding_keys)))
        declare(amqp_url, partition_topologies(base, count), routes=routes)
        stranded = _move_stranded(amqp_url, base, count, olds)
        obsolete = [q for t, _, _ in olds for q, _ in t.queues() if q not in current and q != marker]
        kept = delete_unused_queues(amqp_url, obsolete)
        left = queue_counts(amqp_url, kept, name="delivery-consumer repartition") if kept else {}
    except BrokerError as exc:
        raise Fatal(f"{exc} (the databases are at {count} partitions: run repartition again)") from None
    if stranded:
        click.echo(f"{consumer}: {stranded}", err=True)
    if kept:
        held = ", ".join(f"{q} ({_n(s.ready, 'message')}, {_n(s.consumers, 'consumer')})"
                         for q, s in left.items() if s is not None)
        raise Fatal(f"{consumer}: switched to {count} partitions, but queues of the old partitions are not empty or "
                    f"in use: {held}; stop what consumes them and run repartition --consumer {consumer} "
                    f"--partitions {count} again (it moves what they hold to the new partitions)")
    click.echo(f"{consumer}: queues {base.prefix}.{consumer}.p0 .. p{count - 1} routed by slot mod {count}"
               + (f"; {_n(len(obsolete), 'queue')} of the old partitions deleted" if obsolete else ""), err=True)


def _n(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _move_stranded(url: str, base: Topology, count: int, olds: list[tuple[Topology, int | None, int]]) -> str:
    """Move what the old queues (and the unrouted queue) hold after the switch to the new partitions;
    what was done, in a few words ("" when they were empty)."""
    from ..amqp.admin import queue_counts
    from ..partition_queues import move_stranded, reroute

    unrouted = unrouted_name(base)
    queues = [(t, k, n, q) for t, k, n in olds for q, _ in t.queues() if q != t.count_marker]
    states = queue_counts(url, [q for *_, q in queues] + [unrouted], name="delivery-consumer repartition")
    done: list[Rerouted] = []
    for topo, k, n, queue in queues:
        state = states.get(queue)
        if state is not None and state.ready:
            done += move_stranded(url, base, queue, count, old=k, old_count=n, dead=queue == topo.dead_queue)
    waiting = states.get(unrouted)
    if waiting is not None and waiting.ready:
        done += reroute(url, base)
    moved = sum(1 for d in done if d.outcome.startswith(("moved", "rerouted")))
    left = [d for d in done if d.outcome.startswith("left")]
    if not moved and not left:
        return ""
    return (f"{_n(moved, 'message')} that reached the old queues meanwhile moved to the new partitions by key"
            + (f"; {len(left)} left: " + ", ".join(f"{d.event_id or '-'} ({d.outcome[6:]})" for d in left[:5])
               if left else ""))


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
    from ..errors import BrokerError
    from ..partition_queues import reroute as reroute_messages

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
