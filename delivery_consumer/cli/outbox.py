"""The producer's commands: ``dispatch``, ``outbox list|stats|show|prune|
requeue|drop`` and the demo ``produce``. Each is a few lines around one call
into :mod:`delivery_consumer.outbox` (or :mod:`delivery_consumer.outbox.demo_producer`);
pika is loaded only by ``dispatch``, through the library.

Exit codes: 0; 1 when ``outbox show`` finds no such eventId, when ``outbox
requeue|drop`` could not act on every eventId given, or when ``dispatch
--exit-when-idle`` leaves rows unpublished (pending or quarantined); 2 for
usage, database or fatal broker errors, and for ``dispatch
--exit-when-idle`` that never reached the broker.
"""

from __future__ import annotations

import getpass
import logging
import os
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
from ..model.errors import ConfigError, NotFound
from ..outbox import demo_producer as producer_lib
from ._broker import amqp_options, topology_for
from ._common import F, Fatal, emit_json, from_deployment, handle_errors, json_option, setup_logging
from ._output import count, echo_record, echo_table
from .duration_type import Duration
from .inbox import Missing, limit_option

log = logging.getLogger("delivery_consumer.dispatch")


def producer_db_option(fn: F) -> F:
    # A string, not a click.Path: a path would fold the URL's "//".
    return click.option(
        "--db", "db_path", envvar="DELIVERY_PRODUCER_DB", show_envvar=True, callback=_producer_db,
        help="The producer's database (holds the outbox table): a SQLite file, or a PostgreSQL URL"
             " (postgresql://user@host/db); required unless the deployment file names exactly one producer.")(fn)


def _producer_db(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | str:
    value = from_deployment("producer_db")(ctx, param, value)
    if value is None:
        raise click.MissingParameter(ctx=ctx, param=param)
    return value if outbox_lib.is_pg_url(value) else Path(value)


@contextmanager
def reading(db_path: Path | str) -> Iterator[outbox_lib.OutboxDb]:
    """The producer database opened read-only (``mode=ro``; a read-only session on PostgreSQL) for the block."""
    with closing(outbox_lib.open_db(db_path, readonly=True)) as conn:
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
@click.option("--lease", "lease_s", default="60s", show_default=True, type=Duration(positive=True),
              help="How long a claim is held. A dead dispatcher's claims are taken back sooner: at once on this"
                   " host, after 10s without heartbeat elsewhere.")
@click.option("--poll", "poll_s", default="500ms", show_default=True, type=Duration(positive=True),
              help="Pause between looks at the outbox when there is nothing to publish. A commit through"
                   " outbox.transaction on this host (on PostgreSQL: any commit that adds rows, NOTIFY) wakes the"
                   " dispatcher at once; the poll is the fallback (another host, a producer committing by itself,"
                   " a lost LISTEN connection).")
@click.option("--retry-base", "retry_base_s", default="1s", show_default=True, type=Duration(positive=True),
              help="First backoff of a row nacked on its own (doubles per failure, jittered); a nack storm is"
                   " one outage, with no backoff per row.")
@click.option("--retry-cap", "retry_cap_s", default="5m", show_default=True, type=Duration(positive=True),
              help="Longest backoff of one row.")
@click.option("--max-attempts", default=20, show_default=True, type=click.IntRange(1),
              help="Nacks of a row's own before it is quarantined (an outage, a nack storm included, counts"
                   " none).")
@click.option("--exit-when-idle", "exit_when_idle_s", type=Duration(),
              help="Exit after no row was published or quarantined for this long (e.g. 2s).")
@click.option("--metrics-port", type=click.IntRange(0, 65535),
              help="Serve Prometheus metrics on this port (rows by state, quarantined included).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address the metrics listen on.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@handle_errors
def dispatch(db_path: Path | str, amqp_url: str, exchange: str, queue_prefix: str, declare_for: tuple[str, ...],
             batch: int, depth: int, lease_s: float, poll_s: float, retry_base_s: float, retry_cap_s: float,
             max_attempts: int, exit_when_idle_s: float | None, metrics_port: int | None, metrics_host: str,
             log_level: str) -> None:
    """Publish the outbox's pending rows, in creation order.

    Persistent, mandatory, message_id = eventId, pipelined publisher
    confirms; published_at is set only when the confirm arrived. An
    unroutable or unencodable row is quarantined at once. A nack storm (no
    quorum, a full reject-publish queue: every message to a destination
    nacked) is one outage: its rows wait, the dispatcher probes, and the
    first confirm lets them all go, each article in order; a nack of the
    row's own (its destination took later messages) is retried with backoff
    and quarantined after --max-attempts; later rows of its article wait
    while it is retried. A broker outage is waited out, logged once.
    Several dispatchers may share a database: each leases the rows it
    publishes, and takes back at once the leases of one that died. Runs
    until SIGTERM/SIGINT (settles the batches in flight, exit 0) or
    --exit-when-idle: exit 0 when every row is published, 1 when rows are
    left (it says how many wait for what), 2 when the broker was never
    reached. Bad credentials, a missing vhost or an unusable database: one
    line on stderr, exit 2. --db may be a PostgreSQL URL (the producer's
    own database; a read-only standby or bad credentials: exit 2; an outage
    or a statement timeout is waited out).
    """
    from ..amqp.publisher import StreamPublisher
    from ..model.errors import BrokerFatal

    setup_logging(log_level)
    try:
        topologies = [topology_for(c, exchange, queue_prefix) for c in declare_for]
        config = outbox_lib.DispatchConfig(
            exchange=exchange, batch=batch, depth=depth, lease_s=lease_s, poll_s=poll_s, retry_base_s=retry_base_s,
            retry_cap_s=retry_cap_s, max_attempts=max_attempts, exit_when_idle_s=exit_when_idle_s)
    except (ConfigError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None
    with closing(outbox_lib.open_db(db_path)) as conn:
        publisher = StreamPublisher(amqp_url, topologies=topologies, exchanges=[exchange],
                              name=f"delivery-consumer dispatch {config.owner}",
                              timeout_s=config.publish_timeout_s, window=min(1000, batch))
        dispatcher = outbox_lib.Dispatcher(conn, publisher, config)
        if metrics_port is not None:
            from ..outbox import metrics

            metrics.serve(metrics.registry(db_path, dispatcher.stats), metrics_port, metrics_host)

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if dispatcher.stopping:  # a second signal: stop now; the leases expire
                raise KeyboardInterrupt
            log.info("%s received: settling the batches in flight", signal.Signals(signum).name)
            dispatcher.stop()
            publisher.interrupt()  # a connect waiting for a silent broker ends now

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
        left = outbox_lib.waiting(conn)
    log.info("exiting: %s; %s", stats.line(), outbox_lib.describe_waiting(left) if left else "nothing left")
    if exit_when_idle_s is None:
        sys.exit(0)
    if not stats.connected:
        raise Fatal(f"the broker could not be reached in {exit_when_idle_s:g}s: {stats.last_outage}"
                    + (f"; {outbox_lib.describe_waiting(left)}" if left else ""))
    sys.exit(1 if left else 0)


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
              help="unpublished (pending or quarantined), pending (leased, retrying, held or due), due (what the"
                   " next claim may take), leased, retrying, held, failed (tried, not published), quarantined,"
                   " dropped, published, or all.")
@limit_option
@handle_errors
def outbox_list(db_path: Path | str, as_json: bool, state: str, limit: int) -> None:
    """Rows: those that wait (every state but published, dropped and all)
    oldest first, the order they go out; published, dropped and all newest first.
    DETAIL says why a row waits: leased by <owner> until <time>, held behind
    <eventId>, next attempt at <time>, or its quarantine reason."""
    with reading(db_path) as conn:
        rows = outbox_lib.list_rows(conn, state=state, limit=limit)
    if as_json:
        emit_json(rows)
        return
    keys = ["seq", "eventId", "state", "routingKey", "attempts", "createdAt", "publishedAt", "detail", "lastError"]
    echo_table(keys, _cells(rows, keys), empty="no rows")


@outbox.command("stats")
@producer_db_option
@json_option
@handle_errors
def outbox_stats(db_path: Path | str, as_json: bool) -> None:
    """Counts by state, the oldest pending row, the commonest errors."""
    with reading(db_path) as conn:
        stats = outbox_lib.stats(conn)
    if as_json:
        emit_json(stats)
        return
    age = stats["oldestPendingAgeSeconds"]
    echo_record([
        ("database", stats["database"]),
        ("rows", stats["rows"]),
        ("published", stats["published"]),
        ("unpublished", stats["unpublished"]),
        ("  due", stats["due"]),
        ("  leased", stats["leased"]),
        ("  retrying", stats["retrying"]),
        ("  held", stats["held"]),
        ("  quarantined", stats["quarantined"]),
        ("failed (pending)", stats["failed"]),
        ("dropped", stats["dropped"]),
        ("oldest pending", f"{stats['oldestPendingAt']} ({age:.0f}s ago)" if age is not None else None),
        ("oldest quarantined", stats["oldestQuarantinedAt"]),
        ("max attempts", stats["maxAttemptsUnpublished"]),
        ("last published", stats["lastPublishedAt"]),
    ])
    if stats["errors"]:
        click.echo()
        echo_table(["last error of pending rows", "rows"], list(stats["errors"].items()))
    if stats["quarantineReasons"]:
        click.echo()
        echo_table(["quarantine reason", "rows"], list(stats["quarantineReasons"].items()))


@outbox.command("show")
@producer_db_option
@json_option
@click.argument("event_id")
@handle_errors
def outbox_show(db_path: Path | str, as_json: bool, event_id: str) -> None:
    """Everything about the row of EVENT_ID, with its body (exit 1 if absent);
    passedBy: the later rows of its key (articleId, orderId ...) that were published before it."""
    with reading(db_path) as conn:
        row = outbox_lib.show(conn, event_id)
    if as_json:
        emit_json(row)
        return
    passed = row.pop("passedBy")
    echo_record([(key, value) for key, value in row.items()])
    click.echo(f"passedBy: {len(passed)} later rows of its key published before it"
               + ("".join(f"\n  {e}" for e in passed) if passed else ""))


@outbox.command("prune")
@producer_db_option
@json_option
@click.option("--older-than", "older_than_s", required=True, type=Duration(),
              help="Delete rows published (or dropped) longer ago than this (e.g. 7d, 12h); unpublished rows stay.")
@handle_errors
def outbox_prune(db_path: Path | str, as_json: bool, older_than_s: float) -> None:
    """Delete published and dropped rows older than --older-than."""
    with closing(outbox_lib.open_db(db_path)) as conn:
        deleted = outbox_lib.prune(conn, older_than_s=older_than_s)
        left = outbox_lib.unpublished(conn)
    if as_json:
        emit_json({"deleted": deleted, "unpublished": left})
    else:
        click.echo(f"{deleted} published or dropped rows deleted; {left} unpublished rows kept")


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        return f"uid {os.getuid()}"


def _acted(results: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        emit_json(results)
    else:
        # "was": the row's status before this command (a requeued row is pending now)
        echo_table(["eventId", "outcome", "was"], _cells(results, ["eventId", "outcome", "status"]),
                   empty="no quarantined rows")
    missed = [r for r in results if r["outcome"].startswith("not-")]
    if missed:
        named = ", ".join(f"{r['eventId']}: {r['outcome']}" for r in missed[:3])
        more = f", and {len(missed) - 3} more" if len(missed) > 3 else ""
        raise Missing(f"{len(missed)} of {count(len(results), 'row')} not acted on ({named}{more})")


@outbox.command("requeue")
@producer_db_option
@json_option
@click.argument("event_ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="Every quarantined row (after fixing their common cause).")
@click.option("--dry-run", is_flag=True, help="Say what would be requeued; change nothing.")
@click.option("--by", default=None, help="Who requeues (recorded; default: the OS user).")
@handle_errors
def outbox_requeue(db_path: Path | str, as_json: bool, event_ids: tuple[str, ...], every: bool, dry_run: bool,
                   by: str | None) -> None:
    """Put quarantined (or dropped) rows back in the stream after a fix.

    Each goes out again as a retry (alone for its article), with its
    failures reset; requeued_at and requeued_by record the act. Exit 1 if
    some EVENT_ID is unknown or not quarantined."""
    if bool(event_ids) == every:
        raise click.UsageError("give EVENT_ID... or --all")
    with closing(outbox_lib.open_db(db_path)) as conn:
        ids = list(event_ids) or outbox_lib.quarantined_ids(conn)
        results = outbox_lib.requeue(conn, ids, by=by or _who(), dry_run=dry_run)
    _acted(results, as_json)


@outbox.command("drop")
@producer_db_option
@json_option
@click.argument("event_ids", nargs=-1, required=True)
@click.option("--reason", help="Why (recorded with who and when).")
@click.option("--dry-run", is_flag=True, help="Say what would be dropped; change nothing.")
@click.option("--by", default=None, help="Who drops (recorded; default: the OS user).")
@handle_errors
def outbox_drop(db_path: Path | str, as_json: bool, event_ids: tuple[str, ...], reason: str | None, dry_run: bool,
                by: str | None) -> None:
    """Give up quarantined rows on purpose: never published, kept with who,
    when and why (requeue undoes it). Exit 1 if some EVENT_ID is unknown or
    not quarantined."""
    with closing(outbox_lib.open_db(db_path)) as conn:
        results = outbox_lib.drop(conn, event_ids, by=by or _who(), reason=reason, dry_run=dry_run)
    _acted(results, as_json)


# -- produce ---------------------------------------------------------------------------------


@click.command()
@producer_db_option
@click.option("--article", "article_id", required=True, help="articleId of the material.")
@click.option("--title", help="Title (required for a new article).")
@click.option("--url", help="URL (required for a new article).")
@click.option("--withdraw", is_flag=True, help="Withdraw the material (keeps its title and url unless given).")
@json_option
@handle_errors
def produce(db_path: Path | str, article_id: str, title: str | None, url: str | None, withdraw: bool,
            as_json: bool) -> None:
    """Demo producer: write the next revision of a material and its event in
    one transaction (the material table and the outbox of --db)."""
    if not isinstance(db_path, Path):
        raise click.BadParameter("the demo producer writes a SQLite file; on PostgreSQL the application enqueues"
                                 " through psycopg (docs/outbox.md)", param_hint="--db")
    try:
        with closing(producer_lib.open_db(db_path)) as conn:
            done = producer_lib.produce(conn, article_id, title=title, url=url, withdraw=withdraw)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    env = done.envelope
    if as_json:
        emit_json({"eventId": env.event_id, "type": env.type, "articleId": env.key,
                   "revision": env.revision, "enqueued": done.enqueued})
    else:
        click.echo(f"{env.event_id} {env.type} {env.key} revision {env.revision}: in the outbox")


__all__ = ["dispatch", "outbox", "produce"]
