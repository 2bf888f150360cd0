"""The producer's commands: ``dispatch``, ``outbox list|stats|show|prune`` and
the demo ``produce``. Each is a few lines around one call into
:mod:`delivery_consumer.outbox` (or :mod:`delivery_consumer.producer`);
pika is loaded only by ``dispatch``, through the library.

Exit codes: 0; 1 when ``outbox show`` finds no such eventId, or when
``dispatch --exit-when-idle`` leaves unpublished rows behind; 2 for usage,
database or fatal broker errors.
"""

from __future__ import annotations

import logging
import signal
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import click

from .. import outbox as outbox_lib
from .. import producer as producer_lib
from ..durations import Duration
from ..errors import ConfigError
from ..queries import NotFound
from ._common import F, Fatal, emit_json, from_deployment, handle_errors, json_option
from ._output import echo_record, echo_table
from .inbox import Missing, limit_option
from .rabbit import _setup_logging, _topology, amqp_options

log = logging.getLogger("delivery_consumer.dispatch")


def producer_db_option(fn: F) -> F:
    return click.option(
        "--db",
        "db_path",
        envvar="DELIVERY_PRODUCER_DB",
        show_envvar=True,
        type=click.Path(path_type=Path),
        callback=_producer_db,
        help="The producer's SQLite database (holds the outbox table); required unless the deployment file "
             "names exactly one producer.",
    )(fn)


def _producer_db(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path:
    value = from_deployment("producer_db")(ctx, param, value)
    if value is None:
        raise click.MissingParameter(ctx=ctx, param=param)
    return Path(value)


@contextmanager
def reading(db_path: Path) -> Iterator[sqlite3.Connection]:
    """The producer database opened read-only (``mode=ro``) for the block."""
    with closing(outbox_lib.connect(db_path, readonly=True)) as conn:
        try:
            yield conn
        except NotFound as exc:
            raise Missing(str(exc)) from None
        except sqlite3.Error as exc:
            raise Fatal(f"{db_path}: {exc}") from None


# -- dispatch --------------------------------------------------------------------------


@click.command()
@producer_db_option
@amqp_options
@click.option("--consumer", "-c", "declare_for", multiple=True,
              help="Also declare this consumer's queues, so that messages wait for it (repeatable).")
@click.option("--batch", default=1000, show_default=True, type=click.IntRange(1, 10_000),
              help="Rows claimed (leased) and published per round; a crash duplicates at most depth batches.")
@click.option("--depth", default=2, show_default=True, type=click.IntRange(1, 8),
              help="Batches in flight: the next is sent while the one before waits for its confirms.")
@click.option("--lease", "lease_s", default="60s", show_default=True, type=Duration(),
              help="How long a claim is held; a dispatcher killed holding one delays its rows this long.")
@click.option("--poll", "poll_s", default="500ms", show_default=True, type=Duration(),
              help="Pause between looks at the outbox when there is nothing to publish.")
@click.option("--retry-base", "retry_base_s", default="1s", show_default=True, type=Duration(),
              help="First backoff of an unroutable or nacked row (doubles per attempt, jittered).")
@click.option("--retry-cap", "retry_cap_s", default="5m", show_default=True, type=Duration(),
              help="Longest backoff of one row.")
@click.option("--exit-when-idle", "exit_when_idle_s", type=Duration(),
              help="Exit after nothing could be published for this long (e.g. 2s).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@handle_errors
def dispatch(db_path: Path, amqp_url: str, exchange: str, queue_prefix: str, declare_for: tuple[str, ...],
             batch: int, depth: int, lease_s: float, poll_s: float, retry_base_s: float, retry_cap_s: float,
             exit_when_idle_s: float | None, log_level: str) -> None:
    """Publish the outbox's unpublished rows, in creation order.

    Persistent, mandatory, message_id = eventId, pipelined publisher
    confirms; published_at is set only when the confirm arrived. Unroutable
    or nacked rows are retried with backoff; a broker outage is waited out.
    Several dispatchers may share a database: each leases the rows it
    publishes. Runs until SIGTERM/SIGINT (settles the batches in flight,
    exit 0) or --exit-when-idle (exit 1 when rows are left unpublished).
    Bad credentials, a missing vhost or an unusable database: one line on
    stderr, exit 2.
    """
    from ..broker import BrokerFatal, StreamPublisher

    _setup_logging(log_level)
    try:
        topologies = [_topology(c, exchange, queue_prefix) for c in declare_for]
        config = outbox_lib.DispatchConfig(
            exchange=exchange, batch=batch, depth=depth, lease_s=lease_s, poll_s=poll_s, retry_base_s=retry_base_s,
            retry_cap_s=retry_cap_s, exit_when_idle_s=exit_when_idle_s)
    except (ConfigError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None
    with closing(outbox_lib.connect(db_path)) as conn:
        publisher = StreamPublisher(amqp_url, topologies=topologies, exchanges=[exchange],
                              name=f"delivery-consumer dispatch {config.owner}",
                              timeout_s=config.publish_timeout_s, window=min(1000, batch))
        dispatcher = outbox_lib.Dispatcher(conn, publisher, config)

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if dispatcher.stopping:  # a second signal: stop now; the leases expire
                raise KeyboardInterrupt
            log.info("%s received: settling the batches in flight", signal.Signals(signum).name)
            dispatcher.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        log.info("dispatching %s to %s as %s (batch %d, depth %d, lease %gs)", db_path, exchange, config.owner,
                 batch, depth, config.lease_s)
        try:
            stats = dispatcher.run()
        except BrokerFatal as exc:
            raise Fatal(str(exc)) from None
        finally:
            publisher.close()
        left = outbox_lib.unpublished(conn)
    log.info("exiting: %s; %d rows unpublished", stats.line(), left)
    sys.exit(1 if exit_when_idle_s is not None and left else 0)


# -- outbox list | stats | show | prune ------------------------------------------------------


@click.group()
def outbox() -> None:
    """The producer's outbox: rows waiting for, or done with, the broker."""


def _cells(rows: list[dict[str, Any]], keys: list[str]) -> list[list[Any]]:
    return [[row[key] for key in keys] for row in rows]


@outbox.command("list")
@producer_db_option
@json_option
@click.option("--state", "-s", default="all", show_default=True, type=click.Choice(outbox_lib.STATES),
              help="unpublished, failed (tried, not published), leased, published, or all.")
@limit_option
@handle_errors
def outbox_list(db_path: Path, as_json: bool, state: str, limit: int) -> None:
    """Rows; unpublished states in the order they go out, others newest first."""
    with reading(db_path) as conn:
        rows = outbox_lib.list_rows(conn, state=state, limit=limit)
    if as_json:
        emit_json(rows)
        return
    keys = ["seq", "eventId", "state", "routingKey", "attempts", "createdAt", "publishedAt", "lastError"]
    echo_table(keys, _cells(rows, keys), empty="no rows")


@outbox.command("stats")
@producer_db_option
@json_option
@handle_errors
def outbox_stats(db_path: Path, as_json: bool) -> None:
    """Counts by state, the oldest unpublished row, the commonest errors."""
    with reading(db_path) as conn:
        stats = outbox_lib.stats(conn)
    if as_json:
        emit_json(stats)
        return
    age = stats["oldestUnpublishedAgeSeconds"]
    echo_record([
        ("database", stats["database"]),
        ("rows", stats["rows"]),
        ("published", stats["published"]),
        ("unpublished", stats["unpublished"]),
        ("failed", stats["failed"]),
        ("leased", stats["leased"]),
        ("oldest unpublished", f"{stats['oldestUnpublishedAt']} ({age:.0f}s ago)" if age is not None else None),
        ("max attempts", stats["maxAttemptsUnpublished"]),
        ("last published", stats["lastPublishedAt"]),
    ])
    if stats["errors"]:
        click.echo()
        echo_table(["last error of unpublished rows", "rows"], list(stats["errors"].items()))


@outbox.command("show")
@producer_db_option
@json_option
@click.argument("event_id")
@handle_errors
def outbox_show(db_path: Path, as_json: bool, event_id: str) -> None:
    """Everything about the row of EVENT_ID, with its body (exit 1 if absent)."""
    with reading(db_path) as conn:
        row = outbox_lib.show(conn, event_id)
    if as_json:
        emit_json(row)
        return
    echo_record([(key, value) for key, value in row.items()])


@outbox.command("prune")
@producer_db_option
@json_option
@click.option("--older-than", "older_than_s", required=True, type=Duration(),
              help="Delete rows published longer ago than this (e.g. 7d, 12h); unpublished rows stay.")
@handle_errors
def outbox_prune(db_path: Path, as_json: bool, older_than_s: float) -> None:
    """Delete published rows older than --older-than."""
    with closing(outbox_lib.connect(db_path)) as conn:
        deleted = outbox_lib.prune(conn, older_than_s=older_than_s)
        left = outbox_lib.unpublished(conn)
    if as_json:
        emit_json({"deleted": deleted, "unpublished": left})
    else:
        click.echo(f"{deleted} published rows deleted; {left} unpublished rows kept")


# -- produce ---------------------------------------------------------------------------------


@click.command()
@producer_db_option
@click.option("--article", "article_id", required=True, help="articleId of the material.")
@click.option("--title", help="Title (required for a new article).")
@click.option("--url", help="URL (required for a new article).")
@click.option("--withdraw", is_flag=True, help="Withdraw the material (keeps its title and url unless given).")
@json_option
@handle_errors
def produce(db_path: Path, article_id: str, title: str | None, url: str | None, withdraw: bool,
            as_json: bool) -> None:
    """Demo producer: write the next revision of a material and its event in
    one transaction (the material table and the outbox of --db)."""
    try:
        with closing(producer_lib.open_db(db_path)) as conn:
            done = producer_lib.produce(conn, article_id, title=title, url=url, withdraw=withdraw)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    env = done.envelope
    if as_json:
        emit_json({"eventId": env.event_id, "type": env.type, "articleId": env.article_id,
                   "revision": env.revision, "enqueued": done.enqueued})
    else:
        click.echo(f"{env.event_id} {env.type} {env.article_id} revision {env.revision}: in the outbox")


__all__ = ["dispatch", "outbox", "produce"]
