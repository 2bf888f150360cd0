"""``publish``: validate envelopes from files and publish them to the exchange.

pika is imported inside the command (through the library), never at the top
of this module, so that ``--help`` stays fast.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

import click

from .. import consumers
from ..amqp.partitions import slot_headers
from ..model.cloudevents import STRUCTURED_CONTENT_TYPE
from ..model.envelope import MAX_BODY_BYTES
from ..model.errors import ConfigError, Rejection
from ..model.event_types import default_types
from ..ops import sources as sources_lib
from ._broker import amqp_options, topology_for
from ._common import EXIT_OK, EXIT_REJECTED, Fatal, emit_json, handle_errors
from .duration_type import Duration


@click.command()
@amqp_options
@click.option("--consumer", "-c", "declare_for", multiple=True,
              help="Also declare this consumer's queues, so that messages wait for it (repeatable).")
@click.option("--max-bytes", default=MAX_BODY_BYTES, show_default=True, type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event on stdout.")
@click.option("--attempts", default=3, show_default=True, type=click.IntRange(1, 100),
              help="Times an unconfirmed message is published again after a reconnect (within --confirm-timeout).")
@click.option("--confirm-timeout", "confirm_timeout_s", default="30s", show_default=True,
              type=Duration(positive=True),
              help="How long to wait for the broker's confirms, from the first message sent, reconnects and"
                   " attempts included; what is not confirmed by then is reported unconfirmed (exit 1).")
@click.argument("sources", nargs=-1, required=True)
@handle_errors
def publish(amqp_url: str, exchange: str, queue_prefix: str, declare_for: tuple[str, ...], max_bytes: int,
            as_json: bool, attempts: int, confirm_timeout_s: float, sources: tuple[str, ...]) -> None:
    """Validate envelopes from SOURCES and publish them to the exchange.

    A line may be a structured CloudEvent (it has specversion), as replay
    reads it: it is published as one (content-type
    application/cloudevents+json), its message_id the eventId it maps to.
    Persistent, mandatory, message_id = eventId, routing key = type, with
    pipelined publisher confirms. The types accepted: the material ones, the
    installed ones and those of each --consumer. Invalid envelopes are reported with their
    rejection code and not sent. The last line on stderr counts them:
    confirmed, nacked, unconfirmed (and invalid, returned if any). Within
    --confirm-timeout of the first message sent it says so and exits, even
    if the broker never confirms (no quorum): an unconfirmed message may or
    may not be in the queue, and publishing it again is safe (the consumers'
    inboxes absorb duplicates). Exit 0 when every message was confirmed,
    1 when any was invalid, unroutable, nacked or unconfirmed (named on
    stderr), 2 for usage or broker errors (the broker unreachable at the start).
    """
    from ..amqp.publisher import Publisher
    from ..model.deliveries import OutMessage
    from ..model.errors import BrokerError

    try:
        files = sources_lib.expand(sources)
        topologies = [topology_for(c, exchange, queue_prefix) for c in declare_for]
        types = default_types()
        for consumer in declare_for:
            types = types | consumers.get(consumer).event_types
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    counts: Counter[str] = Counter()
    messages: list[OutMessage] = []
    for item in sources_lib.read(files, limit=max_bytes):
        try:
            env = item.parse(max_bytes, types)  # an envelope, or a structured CloudEvent (as replay reads it)
        except Rejection as rej:
            counts["invalid"] += 1
            _report(as_json, {"eventId": rej.event_id, "rejected": rej.code, "reason": rej.reason,
                              "source": item.location})
            continue
        messages.append(OutMessage(routing_key=env.type, body=item.body, exchange=exchange,
                                   message_id=env.event_id, headers=slot_headers(env.key),
                                   content_type=STRUCTURED_CONTENT_TYPE if env.cloudevent else "application/json"))
    timed_out = False
    try:
        with Publisher(amqp_url, topologies=topologies, exchanges=[exchange],
                       name="delivery-consumer publish") as publisher:
            _connect(publisher, attempts)
            deadline = time.monotonic() + confirm_timeout_s
            todo = list(range(len(messages)))
            final: dict[int, Any] = {}
            for _ in range(attempts):
                results = publisher.publish([messages[i] for i in todo], deadline=deadline)
                retry = []
                for i, result in zip(todo, results, strict=True):
                    final[i] = result  # a confirm is final: nothing confirmed goes again or counts as lost
                    if result.status == "unconfirmed":
                        retry.append(i)
                todo = retry
                timed_out = bool(todo) and time.monotonic() >= deadline
                if not todo or timed_out:
                    break
    except BrokerError as exc:
        raise Fatal(str(exc)) from None
    for i, msg in enumerate(messages):
        result = final[i]
        counts[result.status] += 1
        if as_json:
            emit_json({"eventId": msg.message_id, "published": result.status, "routingKey": msg.routing_key,
                       **({"reason": result.reason} if result.reason else {})})
        elif not result.ok:
            click.echo(f"{msg.message_id} {result.status}: {result.reason}", err=True)
    click.echo(summary_line(len(messages), exchange, counts,
                            confirm_timeout_s if timed_out else None), err=True)
    sys.exit(EXIT_OK if counts["confirmed"] == sum(counts.values()) else EXIT_REJECTED)


def summary_line(sent: int, exchange: str, counts: Counter[str], timed_out_s: float | None = None) -> str:
    """The last line: ``500 published to X: 3 confirmed, 0 nacked, 497 unconfirmed`` (invalid and returned
    when there are any); after the confirm deadline, what the unconfirmed ones are."""
    if not sent and not counts:
        return f"0 published to {exchange}: nothing to publish"
    parts = [f"{counts[k]} {k}" for k in ("confirmed", "nacked", "unconfirmed")]
    parts += [f"{n} {k}" for k, n in sorted(counts.items()) if k not in ("confirmed", "nacked", "unconfirmed")]
    line = f"{sent} published to {exchange}: {', '.join(parts)}"
    if timed_out_s is not None and counts["unconfirmed"]:
        line += (f"; no confirm for {counts['unconfirmed']} within --confirm-timeout {timed_out_s:g}s: they may or"
                 " may not be in the queue, publishing them again is safe")
    return line


def _connect(publisher: Any, attempts: int) -> None:
    """Connect, retrying an unreachable broker a few times with backoff; a
    broker still down after that is an error (exit 2), not a hang."""
    from ..amqp.retry import reconnect_delay_s
    from ..model.errors import BrokerUnavailable

    for attempt in range(1, attempts + 1):
        try:
            publisher.connect()
            return
        except BrokerUnavailable:
            if attempt == attempts:
                raise
            time.sleep(reconnect_delay_s(attempt))


def _report(as_json: bool, obj: dict[str, Any]) -> None:
    if as_json:
        emit_json(obj)
    else:
        click.echo(f"{obj['eventId'] or '-'} rejected {obj['rejected']}: {obj['reason']} ({obj['source']}), "
                   "not sent", err=True)


__all__ = ["publish", "summary_line"]
