"""``asyncapi``: the AsyncAPI 3.0 document of the deployment, one consumer or one producer (docs/asyncapi.md).

A few lines around :mod:`delivery_consumer.ops.asyncapi`, which builds the
document; nothing is asked of the broker or the databases.
"""

from __future__ import annotations

from pathlib import Path

import click

from ._broker import amqp_options
from ._common import Fatal, deployment, emit_json, handle_errors


@click.command()
@click.option("--consumer", "-c", help="Only this consumer (its queues, what it receives and dead-letters).")
@click.option("--producer", "-p", help="Only this producer of the deployment file (what it sends).")
@amqp_options
@click.option("--version", "doc_version", metavar="VERSION",
              help="The document's info.version (default: the release of delivery-consumer that writes it).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the document to this file (default: standard output).")
@handle_errors
def asyncapi(consumer: str | None, producer: str | None, amqp_url: str, exchange: str, queue_prefix: str,
             doc_version: str | None, output: Path | None) -> None:
    """Write the AsyncAPI 3.0 document (JSON) of the deployment's channels, operations
    and message schemas: one channel per event type on the exchange, one per consumer
    queue and dead queue, a send per producer and type, a receive per consumer; each
    message the JSON Schema of its type's envelope.

    With the deployment file: all its consumers and producers, or the one --consumer or
    --producer names. Without one: the --consumer given, under --exchange and --queue-prefix.
    """
    from ..ops import asyncapi as build

    if consumer is not None and producer is not None:
        raise click.UsageError("give --consumer or --producer, not both")
    dep = deployment()
    if dep is None:
        if consumer is None:
            raise Fatal("no deployment file: give --consumer NAME (or --config PATH, or run where ./delivery.toml is)")
        doc = build.for_consumer(consumer, url=amqp_url, exchange=exchange, prefix=queue_prefix, version=doc_version)
    else:
        if consumer is not None and consumer not in dep.consumers:
            raise Fatal(f"{dep.path}: no consumer {consumer} (its consumers: {', '.join(dep.consumers) or 'none'})")
        if producer is not None and producer not in dep.producers:
            raise Fatal(f"{dep.path}: no producer {producer} (its producers: {', '.join(dep.producers) or 'none'})")
        doc = build.for_deployment(dep, consumer=consumer, producer=producer, version=doc_version)
    if output is None:
        emit_json(doc)
        return
    import orjson

    try:
        output.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    except OSError as exc:
        raise Fatal(f"{output}: cannot write it: {exc.strerror or exc}") from None
    click.echo(f"{output}: AsyncAPI {build.ASYNCAPI_VERSION}, {len(doc['channels'])} channels, "
               f"{len(doc['operations'])} operations, {len(build.event_type_names(doc))} event types", err=True)


__all__ = ["asyncapi"]
