"""Options and helpers shared by the commands that talk to RabbitMQ.

pika is imported inside the commands (through the library), never here, so
that ``--help`` stays fast.
"""

from __future__ import annotations

import os
from typing import Any

import click

from ..amqp.topology import AMQP_ORDER_ENV, AMQP_ORDERS, DEFAULT_EXCHANGE, DEFAULT_PREFIX, DEFAULT_URL
from ..consumers import topology as topology_for
from ._common import F, Fatal, from_deployment
from .duration_type import Duration

#: Delays of the retry tiers, in milliseconds: 1 ms .. 7 days each.
RETRY_DELAYS = Duration(minimum=0.001, maximum=7 * 86400, many=True, milliseconds=True)


def amqp_options(fn: F) -> F:
    """--amqp-url, --exchange and --queue-prefix, shared by every broker command."""
    fn = click.option("--queue-prefix", default=DEFAULT_PREFIX, show_default=True, envvar="DELIVERY_QUEUE_PREFIX",
                      callback=from_deployment("queue_prefix"),
                      help="Queues are <prefix>.<consumer>[.dead|.retry.<delay>].")(fn)
    fn = click.option("--exchange", default=DEFAULT_EXCHANGE, show_default=True, envvar="DELIVERY_EXCHANGE",
                      callback=from_deployment("exchange"), help="Topic exchange the events are published to.")(fn)
    fn = click.option("--amqp-order", type=click.Choice(AMQP_ORDERS), envvar=AMQP_ORDER_ENV, show_envvar=True,
                      expose_value=False, callback=_order,
                      help="Try several broker addresses in the order given (default) or shuffled.")(fn)
    fn = click.option("--amqp-url", multiple=True, envvar="DELIVERY_AMQP_URL", show_envvar=True,
                      callback=_addresses,
                      help="Broker URL; repeat it, or separate URLs by commas, for the nodes of a cluster "
                           "(default: the deployment file's, else guest on 127.0.0.1:5672, vhost /).")(fn)
    return fn


def _addresses(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> str:
    """Every --amqp-url given (or the deployment file's), as one address string: URLs separated by commas."""
    found = from_deployment("amqp_url")(ctx, param, value)
    if isinstance(found, tuple):
        return ",".join(found) or DEFAULT_URL
    return str(found)


def _order(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--amqp-order (or the deployment file's ``amqp_order``) for this process and its children."""
    from ._common import deployment

    if value is None:
        found = deployment()
        value = found.amqp_order if found is not None else None
    if value is not None:
        os.environ[AMQP_ORDER_ENV] = value


def broker_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """*fn*(*args, **kwargs); a BrokerError leaves as one line, exit 2."""
    from ..model.errors import BrokerError

    try:
        return fn(*args, **kwargs)
    except BrokerError as exc:
        raise Fatal(str(exc)) from None


__all__ = ["RETRY_DELAYS", "amqp_options", "broker_call", "topology_for"]
