"""``console``: serve the deployment's page until SIGTERM/SIGINT (exit 0)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import signal
import threading
from types import FrameType

import click

from ..model import durations
from ._common import Fatal, checked_deployment, handle_errors
from .duration_type import Duration

#: The longest window of the outcomes chart (its bars are minutes).
MAX_WINDOW_S = 48 * 3600


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8470, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port, printed on stderr).")
@click.option("--window", "window_s", default="3h", show_default=True,
              type=Duration(positive=True, maximum=MAX_WINDOW_S),
              help="Window of the outcomes chart (e.g. 90m, 12h).")
@click.option("--hours", type=click.FloatRange(0.1, MAX_WINDOW_S / 3600), hidden=True,
              help="Deprecated: --window in hours.")
@click.option("--allow-actions", is_flag=True,
              help="Allow requeue and purge of dead letters (POST with a confirmation step and a CSRF token).")
@click.option("--management-url", metavar="URL",
              help="RabbitMQ's management API, for each queue's leader, members online and quorum (default: "
                   "$DELIVERY_MANAGEMENT_URL, else the file's management_url; as status).")
@click.option("--broker-timeout", type=Duration(positive=True), default=5.0, show_default=True,
              help="Each broker call of the status page answers within this, or its queue is shown unavailable.")
@handle_errors
def console(host: str, port: int, window_s: float, hours: float | None, allow_actions: bool,
            management_url: str | None, broker_timeout: float) -> None:
    """A local web page for the deployment: status, outcomes per minute, dead
    letters by code, trace search; read-only unless --allow-actions."""
    from ..console import Console, make_server

    if hours is not None:
        click.echo(f"delivery-consumer: warning: --hours is deprecated: use --window {durations.format(hours * 3600)}",
                   err=True)
        window_s = hours * 3600
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)  # a connection per dead queue read: no news
    dep = checked_deployment()
    if management_url:
        dep = dataclasses.replace(dep, management_url=management_url)
    app = Console(dep, allow_actions=allow_actions, window_s=window_s, broker_timeout_s=broker_timeout)
    try:
        server = make_server(app, host, port)
    except OSError as exc:
        raise Fatal(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if allow_actions and not _loopback(host):
        click.echo(f"delivery-consumer: warning: actions are allowed and {host} is not a loopback address", err=True)

    def stop(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=app.warm, name="console-warm-up", daemon=True).start()
    mode = "actions allowed" if allow_actions else "read-only"
    click.echo(f"console on http://{app.address}/ ({mode}); Ctrl-C to stop", err=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


__all__ = ["console"]
