"""``config check``: validate the deployment file and show what each command would use.

Exit codes: 0; 2 for a bad deployment file or a database that is another's.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

import click

from ..amqp.topology import DEFAULT_EXCHANGE, DEFAULT_PREFIX
from ..model import durations
from ..ops.deployment import BROKER_ENV
from ._common import EXIT_ERROR, EXIT_OK, checked_deployment, emit_json, handle_errors
from ._output import echo_record


def _from_env(key: str) -> str:
    """`` (from $VAR)`` when the environment overrides the file's *key*."""
    var = BROKER_ENV[key]
    return f" (from ${var})" if os.environ.get(var) else ""


#: Partitions whose run line ``config check`` prints (``--json`` has them all).
PARTITIONS_SHOWN = 4


@click.group()
def config() -> None:
    """The deployment file (--config, DELIVERY_CONFIG, ./delivery.toml)."""


@config.command("check")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")
@handle_errors
def config_check(as_json: bool) -> None:
    """Validate the deployment file and show what each command would use.

    Opens every database that exists, read-only: one of another consumer, or
    a producer database without an outbox, is an error (exit 2).
    """
    from .. import outbox
    from ..amqp.connection import redact
    from ..inbox.pg import redact as redact_url
    from ..ops import deployment as config_lib

    dep = checked_deployment(owners=False)  # every problem below, not only the first
    problems: list[str] = []
    consumers: list[dict[str, Any]] = []
    for name, entry in dep.consumers.items():
        problems += config_lib.check_database(dep, entry)
        where = dep.placement(name)
        count = where.count()
        runs = []
        url = redact_url(entry.db) if isinstance(entry.db, str) else None  # a PostgreSQL inbox: one schema each
        for partition, path, topo in where.topologies():
            # without the file, each line alone must still name the database, queues and options
            run = ["delivery-consumer", "run", "--consumer", name, "--db", url or str(path)]
            if partition is not None and count is not None:
                run += ["--partition", partition[1:], "--partitions", str(count)]
            run += [f"--exchange={dep.exchange}"] if dep.exchange != DEFAULT_EXCHANGE else []
            run += [f"--queue-prefix={dep.queue_prefix}"] if dep.queue_prefix != DEFAULT_PREFIX else []
            for key, value in entry.options.items():
                if key == "metrics_port" and partition is not None:
                    value += int(partition[1:])  # one port per partition, as run takes it from the file
                run.append(f"--{key.replace('_', '-')}={value}")
            runs.append({"partition": partition, "database": url or str(path), "queue": topo.queue,
                         "deadQueue": topo.dead_queue, "run": shlex.join(run)})
        exists = None if isinstance(entry.db, str) else entry.db.exists()  # a PostgreSQL URL: not looked at
        consumers.append({"consumer": name, "db": url or str(entry.db), "exists": exists,
                          "partitions": count, "databases": [r["database"] for r in runs],
                          "queue": runs[0]["queue"] if count is None else None,
                          "deadQueue": runs[0]["deadQueue"] if count is None else None, "options": entry.options,
                          "run": runs[0]["run"] if count is None else None,
                          **({"partitionRuns": runs} if count is not None else {})})
    producers = []
    for name, producer in dep.producers.items():
        if outbox.exists(producer.db):
            try:
                outbox.open_db(producer.db, readonly=True).close()
            except Exception as exc:  # DatabaseError, or sqlite3's own for a damaged file
                problems.append(f"{dep.key(f'producers.{name}.db')}: {exc}")
        producers.append({"producer": name, "db": outbox.display(producer.db), "exists": outbox.exists(producer.db)})
    single = dep.single_producer()
    shown = {"file": str(dep.path), "amqpUrl": redact(dep.amqp_url), "exchange": dep.exchange,
             "queuePrefix": dep.queue_prefix, "managementUrl": dep.management_url,
             "outboxMaxAgeSeconds": dep.outbox_max_age_s, "backlogMax": dep.backlog_max,
             "consumers": consumers, "producers": producers,
             "producerCommandsUse": str(single.db) if single else None, "problems": problems}
    if as_json:
        emit_json(shown)
    else:
        echo_record([("file", shown["file"]), ("broker", redact(dep.amqp_url) + _from_env("amqp_url")),
                     ("exchange", dep.exchange + _from_env("exchange")),
                     ("queue prefix", dep.queue_prefix + _from_env("queue_prefix")),
                     ("outbox max age", durations.format(dep.outbox_max_age_s))])
        for c in consumers:
            click.echo(f"consumer {c['consumer']}: {c['db']}" + ("" if c["exists"] in (True, None) else
                                                                 " (not created yet)")
                       + (f", {c['partitions']} partitions" if c["partitions"] else ""))
            if c["partitions"] is None:
                click.echo(f"  queues {c['queue']}, {c['deadQueue']}; run: {c['run']}")
                continue
            for r in c["partitionRuns"][:PARTITIONS_SHOWN]:
                click.echo(f"  {r['partition']}: queues {r['queue']}, {r['deadQueue']}; run: {r['run']}")
            if len(c["partitionRuns"]) > PARTITIONS_SHOWN:
                click.echo(f"  ... and so on to p{len(c['partitionRuns']) - 1} (--json lists them all)")
        for p in producers:
            click.echo(f"producer {p['producer']}: {p['db']}" + ("" if p["exists"] else " (not created yet)"))
        if single is not None:
            click.echo(f"dispatch, outbox and produce use {single.db} unless --db is given")
        elif producers:
            click.echo("several producers: dispatch, outbox and produce need --db")
        for problem in problems:
            click.echo(f"delivery-consumer: {problem}", err=True)
        if not problems:
            click.echo("ok", err=True)
    sys.exit(EXIT_ERROR if problems else EXIT_OK)


__all__ = ["config"]
