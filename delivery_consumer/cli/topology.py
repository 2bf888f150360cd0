"""``topology declare``: the exchange and the consumers' queues (idempotent);
``topology upgrade``: a previous release's classic queues made quorum queues.

pika is imported inside the command (through the library), never at the top
of this module, so that ``--help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from .. import consumers
from ..amqp.partition_queues import layout_conflict
from ..amqp.partitions import SLOT_HEADER, check_count, explain, partition_topologies, route
from ..amqp.topology import DEFAULT_DELIVERY_LIMIT, Topology
from ._broker import RETRY_DELAYS, amqp_options, topology_for
from ._common import F, Fatal, deployment, handle_errors


def _queue_options(partitions_help: str) -> Callable[[F], F]:
    """The options of the commands that declare a consumer's queues: --consumer, the broker's,
    --retry-delays, --delivery-limit and --partitions (its help is the command's)."""

    def decorate(fn: F) -> F:
        fn = click.option("--partitions", type=click.IntRange(1), envvar="DELIVERY_PARTITIONS",
                          help=partitions_help)(fn)
        fn = click.option("--delivery-limit", default=DEFAULT_DELIVERY_LIMIT, show_default=True,
                          type=click.IntRange(1))(fn)
        fn = click.option("--retry-delays", default="1s,10s,60s", show_default=True, type=RETRY_DELAYS)(fn)
        fn = amqp_options(fn)
        return click.option("--consumer", "-c", "names", multiple=True,
                            help="Consumer (repeatable; default: every consumer of the deployment file).")(fn)

    return decorate


@click.group()
def topology() -> None:
    """Broker topology of the consumers."""


@topology.command("declare")
@_queue_options("Declare the consumer(s) as partitioned: queues <prefix>.<consumer>.p0 .. p<N-1>, each with a "
                "single active consumer, fed by slot (see docs/partitions.md). Default: the deployment file's "
                "partitions of each consumer.")
@handle_errors
def declare_cmd(names: tuple[str, ...], amqp_url: str, exchange: str, queue_prefix: str,
                retry_delays: tuple[int, ...], delivery_limit: int, partitions: int | None) -> None:
    """Declare the exchange and the consumers' queues (idempotent).

    Without --consumer, every consumer the deployment file names, each with
    its partition count (``partitions = N``); flags override the file.
    """
    _declare(amqp_url, _declared_counts(names, partitions), exchange, queue_prefix, retry_delays, delivery_limit)


def _declare(amqp_url: str, counts: dict[str, int | None], exchange: str, queue_prefix: str,
             retry_delays: tuple[int, ...], delivery_limit: int) -> None:
    """Declare the consumers of *counts* (consumer -> partition count) and say what was declared."""
    from ..amqp.admin import declare
    from ..model.errors import BrokerError

    bases = [topology_for(n, exchange, queue_prefix, retry_delays_ms=retry_delays,
                       delivery_limit=delivery_limit) for n in counts]
    topologies: list[Topology] = []
    routes = []
    for base in bases:
        count = counts[base.consumer]
        if count is None:
            topologies.append(base)
        else:
            check_count(count)
            topologies += partition_topologies(base, count)
            routes.append(route(base, count))
    try:
        for base in bases:  # the other layout of a consumer: refused before anything is declared
            conflict = layout_conflict(amqp_url, base, counts[base.consumer])
            if conflict is not None:
                raise Fatal(conflict)
        declare(amqp_url, topologies, routes=routes)
    except BrokerError as exc:
        message = str(exc)
        for base in bases:  # the first that recognises it says it in the operator's words
            message = explain(message, base)
        raise Fatal(message) from None
    for base in bases:
        count = counts[base.consumer]
        if count is None:
            others = ", ".join(q for q, _ in base.queues() if q != base.queue)
            click.echo(f"{base.consumer}: {exchange} -[{' '.join(base.binding_keys)}]-> {base.queue}; "
                       f"also declared, not bound: {others}")
            continue
        first, last = (partition_topologies(base, count)[k].queue for k in (0, -1))
        click.echo(f"{base.consumer}: {exchange} -[{' '.join(base.binding_keys)}]-> {base.prefix}.{base.consumer}"
                   f".slots -[{SLOT_HEADER} mod {count}]-> {first} .. {last}; also declared, not bound: "
                   "their .dead and .retry.* queues")


@topology.command("upgrade")
@_queue_options("The consumer's partition count (default: the deployment file's, else the count the broker "
                "records).")
@handle_errors
def upgrade_cmd(names: tuple[str, ...], amqp_url: str, exchange: str, queue_prefix: str,
                retry_delays: tuple[int, ...], delivery_limit: int, partitions: int | None) -> None:
    """Turn the classic queues an earlier release declared into quorum queues, then declare the rest.

    Each dead queue's messages move, confirmed, to ``<dead queue>.upgrade`` and back into the quorum
    queue of the same name (headers and properties kept, in order; a crash midway leaves at worst a
    duplicate: run it again to finish); a partitioned consumer's classic count marker is replaced.
    Idempotent: on a topology already upgraded it only declares. Stop the runs of the earlier release
    first (docs/amqp.md, "Upgrading from classic queues").
    """
    from ..amqp.admin import queue_counts
    from ..amqp.partition_queues import layout, recorded_count
    from ..amqp.upgrade import replace_marker, upgrade_queue
    from ..model.errors import BrokerError

    counts = _declared_counts(names, partitions)
    try:
        for consumer, count in list(counts.items()):
            base = topology_for(consumer, exchange, queue_prefix, retry_delays_ms=retry_delays,
                                delivery_limit=delivery_limit)
            if count is None:
                count = counts[consumer] = recorded_count(amqp_url, base)
            topologies = layout(base, count)
            watched = [base.count_marker, *(q for t in topologies for q in (t.dead_queue, f"{t.dead_queue}.upgrade"))]
            present = {q for q, state in queue_counts(amqp_url, watched, name="delivery-consumer topology").items()
                       if state is not None}  # what is absent is declared below, after the layout check
            if count is not None and base.count_marker in present:
                check_count(count)
                done = replace_marker(amqp_url, base.count_marker,
                                      {"x-queue-type": "classic", "x-max-length": count}, base.marker_arguments(count))
                click.echo(f"{base.count_marker}: {done}")
            for topo in topologies:
                if topo.dead_queue not in present and f"{topo.dead_queue}.upgrade" not in present:
                    continue
                result = upgrade_queue(amqp_url, topo.dead_queue, topo.dead_arguments())
                moved = f", {result.moved} dead letters moved" if result.outcome == "upgraded" else ""
                click.echo(f"{topo.dead_queue}: {result.outcome}{moved}")
    except BrokerError as exc:
        raise Fatal(str(exc)) from None
    _declare(amqp_url, counts, exchange, queue_prefix, retry_delays, delivery_limit)


def _declared_counts(names: tuple[str, ...], partitions: int | None) -> dict[str, int | None]:
    """Consumer -> partition count (None: unpartitioned) of what ``topology declare`` declares:
    the consumers named, else the deployment file's; the count given, else the file's."""
    found = deployment()
    if not names:
        if found is None or not found.consumers:
            raise click.UsageError("give --consumer NAME (repeatable), or a deployment file that names consumers")
        names = tuple(found.consumers)
    out: dict[str, int | None] = {}
    for name in dict.fromkeys(names):
        consumers.get(name)  # an unknown consumer: one line, exit 2
        known = found is not None and name in found.consumers
        out[name] = partitions if partitions is not None else (
            found.placement(name).count() if found is not None and known else None)
    return out


__all__ = ["topology"]
