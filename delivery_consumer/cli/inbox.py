"""The commands of a consumer's inbox database: ``inbox`` (its receipts,
and ``inbox prune``), ``rejected`` and ad-hoc ``query``, and the helpers with
which ``views.py`` reads a consumer's own view (``<consumer> list|show``).

Each read command opens the database read-only (``mode=ro``), calls one
function of :mod:`delivery_consumer.inbox.reports`, closes the database and prints:
aligned columns for a list, ``key: value`` for one record, or JSON with
``--json`` (an array for a list, an object otherwise). A running consumer
keeps committing meanwhile: nothing but ``inbox prune`` (small delete
transactions, :mod:`delivery_consumer.inbox.retention`) takes a write lock.

Exit codes: 0, 1 when the record asked for does not exist, 2 when the
database cannot be used, the SQL is refused or it ran past --timeout, or a
prune is refused.

A partitioned consumer (``state/<consumer>/p<k>/inbox.db``): ``--partition K``
reads one partition; without it, ``<consumer> list|show``, ``inbox list|show``,
``rejected list`` and ``trace`` read every partition, as one consumer.
"""

from __future__ import annotations

import functools
import heapq
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click

from ..amqp.partitions import SLOT_COUNT
from ..inbox import reports
from ..inbox.seam import InboxDB, InboxReader
from ..model.durations import age as _age
from ..model.errors import DeliveryError, NotFound, PruneRefused
from ..store.placement import beside, database, default_db, resolve
from ._broker import amqp_options, broker_call, topology_for
from ._common import (
    EVENT_ID,
    EXIT_OK,
    EXIT_REJECTED,
    F,
    Fatal,
    LazyGroup,
    consumer_option,
    db_option,
    emit_json,
    handle_errors,
    json_option,
    open_db,
)
from ._output import count, echo_record, echo_table
from ._partition_options import one_partition, one_partition_option
from .duration_type import Duration


class Missing(Fatal):
    """The eventId or key asked for is not in the database: exit 1."""

    exit_code = EXIT_REJECTED


def _db_option(fn: F) -> F:
    return db_option(fn, help="Database file, opened read-only (default: state/<consumer>/inbox.db).")


def _partition_option(fn: F) -> F:
    """``--partition K``: read partition K's database (it becomes ``db_path``)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, partition: int | None, **kwargs: Any) -> Any:
        if partition is not None:
            if kwargs.get("consumer") is None and kwargs.get("db_path") is None:
                raise Fatal("--partition needs --consumer NAME")
            if isinstance(kwargs.get("db_path"), str):  # a URL: refused in one line, naming ?schema=
                one_partition(kwargs.get("consumer"), kwargs.get("db_path"), partition, "read it")
            kwargs["db_path"] = database(kwargs.get("consumer") or "", partition, kwargs.get("db_path"))
        return fn(*args, **kwargs)

    option = click.option("--partition", type=click.IntRange(0, SLOT_COUNT - 1), envvar="DELIVERY_PARTITION",
                          help="Only partition K of a partitioned consumer (state/<consumer>/p<K>/inbox.db).")
    return option(wrapper)  # type: ignore[return-value]


def read_options(consumer: str | None = None) -> Callable[[F], F]:
    """``--consumer``, ``--db``, ``--partition`` and ``--json``, shared by every read command."""

    def decorate(fn: F) -> F:
        return consumer_option(default=consumer)(_db_option(_partition_option(json_option(fn))))

    return decorate


def partition_paths(consumer: str | None, db_path: Path | None) -> list[Path] | None:
    """The partition databases read as one consumer (they agree on their count), or None."""
    if (consumer is None and db_path is None) or isinstance(db_path, str):
        return None  # opening the database says what to give; a PostgreSQL URL: one schema
    try:
        return resolve(consumer, db_path).checked()
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None


def limit_option(fn: F, default: int = 50) -> F:
    return click.option(
        "--limit", "-n", default=default, show_default=True, type=click.IntRange(0), help="At most N rows; 0 for all."
    )(fn)


def open_readonly(consumer: str | None, db_path: Path | None) -> InboxReader:
    if isinstance(db_path, str):  # postgresql://...: the consumer's schema there (docs/postgres-inbox.md)
        return _open_pg(consumer, db_path)
    paths = partition_paths(consumer, db_path)
    if paths is not None:
        raise Fatal(f"{consumer or 'the consumer'} is partitioned here ({len(paths)} partitions under "
                    f"{paths[0].parent.parent}): "
                    "give --partition K")
    try:
        return open_db(consumer, db_path, readonly=True)
    except Fatal as exc:
        path = db_path if db_path is not None else default_db(consumer) if consumer else None
        if "readonly" not in exc.message or path is None or not path.is_file():
            raise
        directory = path.resolve().parent
        shm = path.with_name(path.name + "-shm")
        if shm.exists() or os.access(directory, os.W_OK):
            raise
        # A WAL database can only be read with its -shm file, which SQLite
        # creates next to it (https://sqlite.org/wal.html#readonly); SQLite's
        # own words for this ("attempt to write a readonly database") mislead.
        raise Fatal(
            f"{path}: cannot read it here: reading a WAL database needs the file {shm.name} beside it, "
            f"and the directory {directory} is not writable; copy the database to a writable directory"
        ) from None


def _open_pg(consumer: str | None, url: str) -> InboxReader:
    """The consumer's inbox in PostgreSQL, read-only (every read a READ ONLY transaction)."""
    from .. import consumers
    from ..inbox.pg import PgInboxDB, redact

    if consumer is None:
        raise Fatal(f"{redact(url)}: give --consumer NAME (its inbox is the schema of that name)")
    try:
        db = PgInboxDB.open(url, consumers.get(consumer), readonly=True)
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None
    return db


def open_writable(consumer: str | None, db_path: Path | None, partition: int | None, what: str) -> InboxDB:
    """The one database a writing command (``inbox prune``, ``rejected resolve``) changes: a
    file (one partition's of a partitioned consumer), or the consumer's schema of a PostgreSQL
    URL (a partition's is named by ``?schema=`` there)."""
    db_path = one_partition(consumer, db_path, partition, what)
    if isinstance(db_path, str):
        from .. import consumers
        from ..inbox.pg import PgInboxDB, redact

        if consumer is None:
            raise Fatal(f"{redact(db_path)}: give --consumer NAME (its inbox is the schema of that name)")
        try:
            return PgInboxDB.open(db_path, consumers.get(consumer))
        except DeliveryError as exc:
            raise Fatal(str(exc)) from None
    return open_db(consumer, db_path)


@contextmanager
def reading(consumer: str | None, db_path: Path | None) -> Iterator[InboxReader]:
    """The database opened read-only for the block; a NotFound exits 1."""
    db = open_readonly(consumer, db_path)
    try:
        if db.note is not None:
            click.echo(f"note: {db.note}", err=True)
        yield db
    except NotFound as exc:
        raise Missing(str(exc)) from None
    finally:
        db.close()


@contextmanager
def reading_all(consumer: str | None, db_path: Path | None) -> Iterator[list[tuple[int | None, InboxReader]]]:
    """Every partition's database (partition, db) of a partitioned consumer,
    or the one database as [(None, db)]; a NotFound exits 1."""
    paths = partition_paths(consumer, db_path)
    if paths is None:
        if consumer is not None and db_path is None and (found := beside(default_db(consumer))):
            click.echo(f"note: {found[0].parent.parent} also holds {len(found)} partition databases "
                       f"(p<k>/inbox.db), not read here; --db {found[0].parent.parent} reads them", err=True)
        with reading(consumer, db_path) as db:
            yield [(None, db)]
        return
    with ExitStack() as stack:
        dbs: list[tuple[int | None, InboxReader]] = [(k, stack.enter_context(reading(consumer, path)))
                                                    for k, path in enumerate(paths)]
        try:
            yield dbs
        except NotFound as exc:
            raise Missing(str(exc)) from None


def list_newest(consumer: str | None, db_path: Path | None, as_json: bool, limit: int,
                read: Callable[[InboxReader], list[dict[str, Any]]], order: Callable[[dict[str, Any]], Any],
                keys: list[str], empty: str) -> None:
    """Print what *read* finds in every partition's database (each row tagged with its partition when
    there are several), newest first by *order*, at most *limit* (0: all)."""
    with reading_all(consumer, db_path) as dbs:
        parts = [[row if k is None else {**row, "partition": k} for row in read(db)] for k, db in dbs]
    rows = list(heapq.merge(*parts, key=order, reverse=True))
    rows = rows[:limit] if limit else rows
    if as_json:
        emit_json(rows)
    else:
        echo_table(keys, _columns(rows, keys), empty=empty)


def find_first(dbs: list[tuple[int | None, InboxReader]],
               look: Callable[[InboxReader], dict[str, Any]]) -> dict[str, Any]:
    """The first partition's answer to *look* (NotFound in all of them: NotFound)."""
    missing: NotFound | None = None
    for k, db in dbs:
        try:
            found = look(db)
        except NotFound as exc:
            missing = exc
            continue
        return found if k is None else {**found, "partition": k}
    assert missing is not None
    consumer = dbs[0][1].consumer
    raise NotFound(str(missing) if len(dbs) == 1 else
                           f"{str(missing).rsplit(' in ', 1)[0]} in any of the {len(dbs)} partitions of {consumer}")


def _columns(rows: list[dict[str, Any]], keys: list[str]) -> list[list[Any]]:
    return [[row[key] for key in keys] for row in rows]


# -- inbox -----------------------------------------------------------------------

#: ``inbox`` subcommands, imported on first use; a new one is one line here.
INBOX_COMMANDS: dict[str, str] = {
    "list": "inbox:inbox_list",
    "show": "inbox:inbox_show",
    "stats": "inbox:inbox_stats",
    "prune": "inbox:inbox_prune",
    "recover": "inbox:inbox_recover",
}

inbox = LazyGroup(
    name="inbox",
    lazy=INBOX_COMMANDS,
    help="The inbox: one receipt per applied eventId, with its result.",
)


@click.command("list")
@read_options()
@click.option("--result", "-r", help="Only receipts with this result (updated, stale, same-state, recorded...).")
@limit_option
@handle_errors
def inbox_list(consumer: str | None, db_path: Path | None, as_json: bool, result: str | None, limit: int) -> None:
    """Receipts, newest first."""
    list_newest(consumer, db_path, as_json, limit, lambda db: reports.inbox_list(db, result=result, limit=limit),
                lambda r: (r["receivedAt"], r["eventId"]), ["receivedAt", "eventId", "type", "result"], "no receipts")


@click.command("show")
@read_options()
@click.argument("event_id", type=EVENT_ID)
@handle_errors
def inbox_show(consumer: str | None, db_path: Path | None, as_json: bool, event_id: str) -> None:
    """The receipt of EVENT_ID, with its rejections and recorded deliveries."""
    with reading_all(consumer, db_path) as dbs:
        shown = find_first(dbs, lambda db: reports.inbox_show(db, event_id))
    if as_json:
        emit_json(shown)
        return
    receipt = shown["receipt"] or {}
    echo_record(
        [
            ("eventId", shown["eventId"]),
            ("result", receipt.get("result", "(no receipt: never applied)")),
            ("type", receipt.get("type")),
            ("receivedAt", receipt.get("receivedAt")),
            ("fingerprint", receipt.get("fingerprint")),
            *([("cloudEvent", f"{origin['id']} from {origin['source']}")]
              if (origin := receipt.get("cloudEvent")) else []),
            ("rejected", len(shown["rejected"])),
            ("deliveries", f"{shown['deliveryCount']}"
                           + (" (the applying one known from the receipt)" if shown["deliveryFromReceipt"] else "")),
        ]
    )
    for rejection in shown["rejected"]:
        click.echo(f"rejection {rejection['id']}:")
        echo_record([(k, v) for k, v in rejection.items() if k not in ("id", "eventId")], indent="  ")
    for delivery in shown["deliveries"]:
        click.echo(f"delivery {delivery['key']}:")
        echo_record([(k, v) for k, v in delivery.items() if k not in ("key", "eventId")], indent="  ")


@click.command("stats")
@read_options()
@handle_errors
def inbox_stats(consumer: str | None, db_path: Path | None, as_json: bool) -> None:
    """Receipts by result (all, last hour, last day), oldest receipt, rejections by code."""
    with reading(consumer, db_path) as db:
        stats = reports.inbox_stats(db)
    if as_json:
        emit_json(stats)
        return
    oldest = stats["oldestReceivedAt"]
    echo_record(
        [
            ("consumer", stats["consumer"]),
            ("database", stats["database"]),
            ("receipts", stats["receipts"]),
            ("oldest", f"{oldest} ({_age(stats['oldestAgeSeconds'])} ago)" if oldest else None),
            ("newest", stats["newestReceivedAt"]),
            ("rejected", stats["rejected"]),
        ]
    )
    if stats["byResult"]:
        click.echo()
        echo_table(
            ["result", "total", "last hour", "last day"],
            [[r, n, stats["lastHour"][r], stats["lastDay"][r]] for r, n in stats["byResult"].items()],
        )
    if stats["rejectedByCode"]:
        click.echo()
        echo_table(
            ["rejection", "total", "unresolved"],
            [[c, n, stats["unresolvedByCode"][c]] for c, n in stats["rejectedByCode"].items()],
        )


# -- inbox prune -----------------------------------------------------------------


@click.command("prune")
@consumer_option()
@db_option
@amqp_options
@one_partition_option
@click.option("--older-than", required=True, type=Duration(),
              help="Prune what is older than this (90m, 12h, 30d, 2w); at least the horizon.")
@click.option("--horizon", default="7d", show_default=True, type=Duration(),
              envvar="DELIVERY_REDELIVERY_HORIZON", show_envvar=True,
              help="Redelivery horizon: how late a copy of an event may still arrive.")
@click.option("--batch", default=500, show_default=True, type=click.IntRange(1, 100_000),
              help="Rows per delete transaction.")
@click.option("--without-dead-queue", is_flag=True,
              help="Prune even if the dead queue cannot be read (broker down): only unresolved rejections "
                   "then protect receipts; broker-side delivery-limit dead letters have none.")
@click.option("--dry-run", is_flag=True, help="Count what would go; delete nothing.")
@click.option("--trust-clock", is_flag=True,
              help="Prune although this clock and the receipts' disagree by more than the horizon, or their "
                   "times jump (ages are counted from the newest receipt when it is older than now).")
@json_option
@handle_errors
def inbox_prune(consumer: str | None, db_path: Path | None, amqp_url: str, exchange: str, queue_prefix: str,
                partition: int | None, older_than: float, horizon: float, batch: int, without_dead_queue: bool,
                dry_run: bool, trust_clock: bool, as_json: bool) -> None:
    """Delete old receipts, delivery records and resolved rejections, in small batches.

    Never a receipt younger than the redelivery horizon (a shorter
    --older-than is refused), nor one whose event is in the dead queue (read
    from the broker; if it cannot be read the prune is refused unless
    --without-dead-queue) or has an unresolved rejection. A running consumer
    keeps committing meanwhile.
    """
    from ..inbox import retention
    from ..model.errors import BrokerError
    from ..ops import deadletters

    try:
        retention.check_older_than(older_than, horizon)
    except PruneRefused as exc:
        raise Fatal(f"refused: {exc}") from None
    with ExitStack() as stack:
        db = open_writable(consumer, db_path, partition, "prune it")
        stack.callback(db.close)
        if partition is None:  # a partition's database names its queues
            partition = _stored_partition(db)
        topology = topology_for(db.spec.name, exchange, queue_prefix, partition=partition)
        keep: set[str] | None = None
        refresh: Any = lambda: ()  # noqa: E731
        try:
            dq, snapshot = stack.enter_context(deadletters.reading(amqp_url, topology))
        except BrokerError as exc:
            if not without_dead_queue:
                raise Fatal(f"refused: cannot read the dead queue {topology.dead_queue}, so receipts of events "
                            f"still in it could go and a requeue would apply them twice: {exc}. Try again, or "
                            "add --without-dead-queue to rely on unresolved rejections only") from None
            click.echo(f"delivery-consumer: warning: dead queue not read ({exc}); going on without it", err=True)
        else:
            keep = deadletters.event_ids(snapshot.letters)
            reconciled = 0 if dry_run else deadletters.reconcile(db, snapshot)

            def refresh() -> set[str]:  # dead letters that arrive while pruning
                return deadletters.event_ids(deadletters.describe(0, msg) for msg in dq.poll())

        try:
            report = broker_call(retention.prune, db, older_than_s=older_than, horizon_s=horizon,
                                  keep_event_ids=keep, refresh_keep=refresh,
                                  dead_queue=topology.dead_queue if keep is not None else None,
                                  batch=batch, dry_run=dry_run, trust_clock=trust_clock)
        except PruneRefused as exc:  # the clocks disagree (the age was checked above)
            raise Fatal(f"refused: {exc}") from None
        if keep is not None:
            report.dead_letters = len(snapshot.letters)
            if reconciled:
                report.notes.append(f"{count(reconciled, 'rejection')} resolved first: their dead letters had "
                                    f"already left {snapshot.queue}")
    if as_json:
        emit_json(report.to_json())
        return
    _echo_prune(report)


def _stored_partition(db: Any) -> int | None:
    from ..amqp.partitions import identity_from_meta

    identity = identity_from_meta(db.meta())
    return identity.partition if identity is not None else None


def _echo_prune(report: Any) -> None:
    from ..inbox.retention import format_duration

    verb = "would delete" if report.dry_run else "deleted"
    click.echo(f"{report.consumer} ({report.database}): older than {format_duration(report.older_than_s)} "
               f"(before {report.cutoff}), redelivery horizon {format_duration(report.horizon_s)}")
    if report.dead_queue is not None:
        click.echo(f"dead queue {report.dead_queue}: {count(report.dead_letters, 'dead letter')}, their receipts kept")
    echo_record([
        ("receipts", f"{report.receipts} {verb}; kept: {report.kept_in_dead_queue} in the dead queue, "
                     f"{report.kept_unresolved} with an unresolved rejection"),
        ("deliveries", f"{report.deliveries} {verb}"),
        ("rejections", f"{report.rejections} resolved ones {verb}"),
    ])
    for note in report.notes:
        click.echo(f"note: {note}")
    if not report.dry_run:
        click.echo(f"{count(report.batches, 'transaction')} in {report.seconds:.3f}s", err=True)


# -- rejected --------------------------------------------------------------------


@click.group()
def rejected() -> None:
    """Events refused with a rejection code (kept locally for the operator)."""


@rejected.command("list")
@read_options()
@click.option("--code", help="Only this rejection code (malformed-json, invalid-envelope, ...).")
@limit_option
@handle_errors
def rejected_list(consumer: str | None, db_path: Path | None, as_json: bool, code: str | None, limit: int) -> None:
    """Rejections, newest first."""
    list_newest(consumer, db_path, as_json, limit, lambda db: reports.rejected_list(db, code=code, limit=limit),
                lambda r: (r["rejectedAt"], r["id"]), ["id", "rejectedAt", "code", "eventId", "source", "reason"],
                "no rejections")


@rejected.command("resolve")
@consumer_option()
@db_option
@one_partition_option
@click.argument("ids", nargs=-1, type=click.IntRange(1))
@click.option("--older-than", type=Duration(),
              help="Instead of IDS: every unresolved rejection older than this (0s: all of them).")
@click.option("--code", help="With --older-than: only this rejection code.")
@click.option("--dry-run", is_flag=True, help="Say what would be resolved; change nothing.")
@json_option
@handle_errors
def rejected_resolve(consumer: str | None, db_path: Path | None, partition: int | None, ids: tuple[int, ...],
                     older_than: float | None, code: str | None, dry_run: bool, as_json: bool) -> None:
    """Mark rejections resolved after looking at them (IDS from rejected list).

    status counts unresolved rejections: one recorded without a dead-letter
    copy (replay's, for one) has nothing else that could resolve it. One
    whose copy went to a dead queue is left: dead requeue or dead purge
    resolves it. Exit 1 when an id asked for is not found or is left.
    """
    import time

    from ..inbox import resolutions
    from ..store.sqlite import now_iso

    if bool(ids) == (older_than is not None):
        raise click.UsageError("give the rejection IDS, or --older-than DURATION")
    if code is not None and older_than is None:
        raise click.UsageError("--code goes with --older-than")
    db = open_writable(consumer, db_path, partition, "resolve its rejections")
    try:
        before = None if older_than is None else now_iso(time.time() - older_than)
        done = resolutions.resolve_by_hand(db, ids=ids, before=before, code=code, dry_run=dry_run)
        where = str(db.path)
    finally:
        db.close()
    if as_json:
        emit_json(done.to_json())
    else:
        verb = "would resolve" if dry_run else "resolved"
        click.echo(f"{verb} {count(len(done.resolved), 'rejection')} in {where}"
                   + (f": {', '.join(map(str, done.resolved[:20]))}" + (" ..." if len(done.resolved) > 20 else "")
                      if done.resolved else ""))
        for row_id, why in done.left:
            click.echo(f"left {row_id}: {why}")
    if ids and (done.missing or done.left):
        named = ", ".join(map(str, done.missing))
        raise Missing(f"{count(len(done.missing) + len(done.left), 'rejection')} not resolved"
                      + (f" (not found: {named})" if done.missing else ""))


# -- query -----------------------------------------------------------------------


@click.command()
@read_options()
@click.option("--timeout", "timeout_s", default="10s", show_default=True, type=Duration(positive=True),
              help="Stop the statement if it still runs, or its result is still being fetched, after this long "
                   "(exit 2).")
@click.argument("sql")
@handle_errors
def query(consumer: str | None, db_path: Path | None, as_json: bool, timeout_s: float, sql: str) -> None:
    """Run one read-only SQL statement (SELECT, WITH, EXPLAIN, reading PRAGMAs).

    The database is opened read-only with query_only set; writes, ATTACH,
    transactions, several statements and functions such as fts3_tokenizer()
    and load_extension() are refused; a statement still running after
    --timeout, or whose result passes 32 MB, is stopped (exit 2). --json gives
    {"columns": [...], "rows": [[...], ...]}; BLOBs appear as X'..' literals.
    """
    with reading(consumer, db_path) as db:
        result = reports.query(db, sql, timeout_s=timeout_s)
    if as_json:
        emit_json(result)
    elif result["columns"]:
        echo_table(result["columns"], result["rows"], null="NULL")


# -- inbox recover ---------------------------------------------------------------


@click.command("recover")
@click.option("--db", "db_path", required=True, type=click.Path(path_type=Path),
              help="The damaged database (read only; stop its run first).")
@click.option("--to", "target", required=True, type=click.Path(path_type=Path),
              help="The new database to write (must not exist).")
@consumer_option()
@json_option
@handle_errors
def inbox_recover(db_path: Path, target: Path, consumer: str | None, as_json: bool) -> None:
    """Copy every row that can still be read of a damaged database into a new one.

    For Debian's sqlite3 3.40, whose .recover fails. The new file keeps the
    old one's identity; put it in place while no run is up (docs/failures.md,
    "Restores"). Exit 0 when every row was read, 1 when some could not be.
    """
    from ..ops.recovery import recover

    report = recover(db_path, target, consumer)
    if as_json:
        emit_json({"source": report.source, "target": report.target, "consumer": report.consumer,
                   "complete": report.complete, "integrity": report.integrity,
                   "tables": [{"table": t.name, "copied": t.copied, "lost": t.lost, "unreadable": t.unreadable}
                              for t in report.tables]})
    else:
        for t in report.tables:
            lost = "; could not read " + ", ".join(t.lost) if t.lost else ""
            click.echo(f"{t.name}: {'unreadable' if t.unreadable else count(t.copied, 'row')} copied{lost}")
        click.echo(f"{report.target}: integrity_check {report.integrity}; "
                   + ("every row read" if report.complete else "some rows could not be read (above)"))
    sys.exit(EXIT_OK if report.complete else EXIT_REJECTED)
