"""``run``: consume a consumer's queue -- apply, commit, then acknowledge.

pika is imported inside the command (through the library), never at the top
of this module, so that ``--help`` stays fast.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..amqp.partitions import explain
from ..amqp.topology import Topology
from ..model.durations import format as spelled
from ..service.launch import EXIT_TEMPFAIL, checked_spec
from ..service.settings import RunConfig
from ..store.placement import database, in_directory
from ._broker import RETRY_DELAYS, amqp_options, topology_for
from ._common import F, Fatal, consumer_option, db_option, deployment, from_deployment, handle_errors, setup_logging
from ._partition_options import partition_identity, partition_options
from .duration_type import Duration


def external_options(fn: F) -> F:
    """Options of a consumer whose effect is outside the database (webhook),
    gathered into one ``consumer_options`` dict for ``RunConfig``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, webhook_url: str | None, endpoint_idempotent: bool, webhook_connect_timeout: float | None,
                webhook_read_timeout: float | None, **kwargs: Any) -> Any:
        kwargs["consumer_options"] = {
            "webhook_url": webhook_url,
            "endpoint_idempotent": endpoint_idempotent,
            "connect_timeout_s": webhook_connect_timeout,
            "read_timeout_s": webhook_read_timeout,
            "first_retry_delay_ms": kwargs["retry_delays"][0],
        }
        # httpx logs every request at INFO; run logs one line per batch, and
        # the webhook's failures reach the log through the retry/dead lines.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        return fn(*args, **kwargs)

    seconds = Duration(positive=True)
    wrapped: Any = wrapper
    for option in reversed([
        click.option("--webhook-url", envvar="DELIVERY_WEBHOOK_URL", show_envvar=True,
                     callback=from_deployment("webhook_url"),
                     help="webhook consumer: the endpoint each notification is POSTed to."),
        click.option("--endpoint-idempotent/--no-endpoint-idempotent", default=True, show_default=True,
                     help="webhook consumer: whether the endpoint honours Idempotency-Key. If not, a call whose "
                          "outcome is unknown is never repeated (dead-lettered outcome-unknown)."),
        click.option("--webhook-connect-timeout", type=seconds,
                     help="webhook consumer: time to connect (default: the read timeout, at most 2s)."),
        click.option("--webhook-read-timeout", type=seconds,
                     help="webhook consumer: time to wait for the answer; shorter than the first retry delay "
                          "(default: 80% of it, at most 10s)."),
    ]):
        wrapped = option(wrapped)
    return wrapped  # type: ignore[no-any-return]


def _metrics_factory(consumer: str, partition: int | None = None) -> Callable[[], Any]:
    """Metrics are kept where the work happens: in run's worker process (which
    sends them to the connection process; see :func:`_metrics_server`)."""

    def make() -> Any:
        from ..observability.metrics import Metrics

        return Metrics(consumer, partition=partition, connection=False)

    return make


def _metrics_server(consumer: str, port: int, host: str, queues: tuple[str, Topology] | None = None,
                    partition: int | None = None, db_path: Path | None = None) -> Callable[[], Any]:
    """``/metrics`` served by run's connection process, which answers while the
    worker is busy or stuck. *queues* (url, topology): also the queue depths,
    asked at scrape time. *partition*: every series is labelled with it.
    *db_path*: also who holds the database and how long it has been silent."""

    def serve() -> Any:
        from ..model.errors import ConfigError
        from ..observability.metrics import RunExposition, WriterCollector

        collectors: list[Any] = []
        if db_path is not None:
            labels = {"consumer": consumer, **({"partition": str(partition)} if partition is not None else {})}
            collectors.append(WriterCollector(db_path, labels))
        if queues is not None:
            from ..amqp.queue_metrics import QueueCollector

            collectors.append(QueueCollector(*queues))
        exposition = RunExposition(consumer, partition, collectors)
        try:
            exposition.serve(port, host)
        except OSError as exc:
            raise ConfigError(f"cannot listen for metrics on {host}:{port}: {exc.strerror}") from None
        logging.getLogger("delivery_consumer.run").info("metrics on http://%s:%d/metrics", host, port)
        return exposition

    return serve


@click.command()
@consumer_option(required=True)
@db_option
@amqp_options
@click.option("--prefetch", default=RunConfig.prefetch, show_default=True, type=click.IntRange(1, 65535),
              help="Unacknowledged deliveries the broker may send ahead (memory: up to prefetch x max-bytes).")
@click.option("--batch", default=RunConfig.batch, show_default=True, type=click.IntRange(1, 10_000),
              help="Deliveries per transaction (1 = one commit per delivery).")
@click.option("--batch-wait", "batch_wait_ms", default=spelled(RunConfig.batch_wait_ms / 1000), show_default=True,
              type=Duration(maximum=60, milliseconds=True),
              help="The longest a batch keeps taking deliveries that are still arriving; a lone delivery"
                   " never waits.")
@click.option("--max-attempts", default=RunConfig.max_attempts, show_default=True, type=click.IntRange(1, 1000),
              help="Tries of an event that fails transiently before it is dead-lettered retries-exhausted.")
@click.option("--retry-delays", default=",".join(f"{ms / 1000:g}s" for ms in RunConfig.retry_delays_ms),
              show_default=True, type=RETRY_DELAYS,
              help="Delays of the retry tiers (the last repeats), e.g. 500ms,5s,1m.")
@click.option("--delivery-limit", default=RunConfig.delivery_limit, show_default=True, type=click.IntRange(1),
              help="Broker-side x-delivery-limit of the queue (the backstop for poison messages).")
@click.option("--max-crashes", default=RunConfig.max_crashes, show_default=True, type=click.IntRange(1),
              help="Dead-letter a message (delivery-limit) after it killed the process this many times.")
@click.option("--exit-when-idle", "exit_when_idle", type=Duration(positive=True),
              help="Exit 0 after no delivery arrived for this long (e.g. 2s); exit 2 if the broker cannot be "
                   "reached at start.")
@click.option("--store-outage-limit", "store_outage_limit_s", default=spelled(RunConfig.store_outage_limit_s),
              show_default=True, type=Duration(positive=True),
              help="How long the database may fail as a whole (disk full, I/O error, busy, read-only) before run "
                   "exits 75 (for a supervisor to restart it); meanwhile deliveries are held unacked and retried, "
                   "no attempt spent.")
@click.option("--max-bytes", default=RunConfig.max_bytes, show_default=True, type=click.IntRange(1),
              help="Largest body accepted; larger ones are dead-lettered invalid-envelope.")
@click.option("--accept-loss", is_flag=True,
              help="Start on a database older than what was acknowledged from it (a restored backup), or on a "
                   "new one where receipts were acknowledged: the loss is logged (docs/failures.md, Restores).")
@click.option("--integrity-check-limit", "integrity_check_s", default=spelled(RunConfig.integrity_check_s),
              show_default=True, type=Duration(positive=True),
              help="The longest the integrity check at start may hold it up; a larger file is checked whole in "
                   "the background and nothing is acknowledged before the check passed.")
@click.option("--take-over-after", "take_over_after_s", default=spelled(RunConfig.take_over_after_s or 0),
              show_default=True, type=Duration(),
              help="A partition's standby takes over from a holder proven frozen (stopped, no heartbeat) after "
                   "this long; 0: never.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
              help="text: one line per batch or problem; json: one object per event or problem.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), callback=from_deployment("metrics_port"),
              help="Expose Prometheus metrics on this port (/metrics).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address the metrics listen on.")
@partition_options
@external_options
@handle_errors
def run(consumer: str, db_path: Path | str | None, amqp_url: str, exchange: str, queue_prefix: str, prefetch: int,
        batch: int, batch_wait_ms: int, max_attempts: int, retry_delays: tuple[int, ...], delivery_limit: int,
        max_crashes: int, exit_when_idle: float | None, store_outage_limit_s: float, max_bytes: int,
        accept_loss: bool, integrity_check_s: float, take_over_after_s: float, log_level: str, log_format: str,
        metrics_port: int | None, metrics_host: str, partition: int | None, partitions: int | None,
        consumer_options: dict[str, Any]) -> None:
    """Consume a consumer's queue: apply, commit, then acknowledge.

    Runs until SIGTERM/SIGINT (finishes and acks the current batch, exit 0)
    or --exit-when-idle. Bad credentials, a missing vhost, an incompatible
    queue or an unusable database: one line on stderr, exit 2. A database
    that fails as a whole (disk full...) is waited for, then exit 75.

    With --partition K: serve partition K of a partitioned consumer (its
    queue allows one active consumer: a second run of the same partition is
    a standby that takes over when the first dies).
    """
    from ..model.errors import BrokerError, StoreOutage
    from ..service.run import run as run_consumer

    setup_logging(log_level, log_format, consumer)
    checked_spec(consumer, consumer_options)  # unknown consumer, no --webhook-url...: one line, exit 2
    db_url = db_path if isinstance(db_path, str) else None  # postgresql://...: docs/postgres-inbox.md
    db_path = None if isinstance(db_path, str) else db_path
    if db_url is None:
        db_path, partitions, metrics_port = _file_partition(consumer, db_path, partition, partitions, metrics_port)
    if batch > prefetch:
        raise click.BadParameter(f"--batch {batch} cannot fill with --prefetch {prefetch}; raise --prefetch",
                                 param_hint="--batch")
    config = RunConfig(
        consumer=consumer, url=amqp_url, exchange=exchange, prefix=queue_prefix,
        db_path=database(consumer, partition, db_path) if partition is not None else db_path, db_url=db_url,
        prefetch=prefetch, batch=batch, batch_wait_ms=batch_wait_ms, max_attempts=max_attempts,
        retry_delays_ms=retry_delays, delivery_limit=delivery_limit, max_crashes=max_crashes,
        exit_when_idle_s=exit_when_idle, max_bytes=max_bytes, log_each_event=log_format == "json",
        consumer_options=consumer_options, store_outage_limit_s=store_outage_limit_s,
        accept_loss=accept_loss, take_over_after_s=take_over_after_s or None, integrity_check_s=integrity_check_s,
        partition=partition_identity(consumer, partition, partitions, db_path,
                                     broker=(amqp_url, topology_for(consumer, exchange, queue_prefix))),
    )
    observer_factory = serve = None
    if metrics_port is not None:
        observer_factory = _metrics_factory(consumer, partition)
        serve = _metrics_server(consumer, metrics_port, metrics_host, (amqp_url, config.topology()), partition,
                                None if db_url is not None else config.database_path())
    try:
        code = run_consumer(config, observer_factory, serve)
    except BrokerError as exc:
        raise Fatal(explain(str(exc), config.topology())) from None
    except StoreOutage as exc:  # not a configuration error: a supervisor may restart it
        click.echo(f"delivery-consumer: {exc}", err=True)
        code = EXIT_TEMPFAIL
    sys.exit(code)


def _file_partition(consumer: str, db_path: Path | None, partition: int | None, partitions: int | None,
                    metrics_port: int | None) -> tuple[Path | None, int | None, int | None]:
    """run's database, partition count and metrics port when the deployment file makes
    *consumer* partitioned (``db`` its directory, ``partitions = N``): partition K's
    ``<db>/p<K>/inbox.db`` even before the directory exists, the file's count, and
    the file's ``metrics_port`` + K (one port per partition on one host)."""
    found = deployment()
    entry = found.consumer(consumer) if found is not None else None
    if found is None or entry is None or db_path != entry.db:
        return db_path, partitions, metrics_port  # not the file's database: nothing to add
    count = found.placement(consumer).count()
    if count is None and entry.partitions is None:
        return db_path, partitions, metrics_port
    if partition is None:
        raise Fatal(f"{found.key(f'consumers.{consumer}')}: {consumer} is partitioned"
                    + (f" ({count} partitions)" if count else "") + ": give --partition K (one run per partition)")
    if metrics_port is not None and metrics_port == entry.options.get("metrics_port"):
        metrics_port += partition
    return in_directory(entry.db, partition), partitions if partitions is not None else count, metrics_port


__all__ = ["run"]
