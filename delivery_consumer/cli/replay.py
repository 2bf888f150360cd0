"""``init`` and ``replay``: create a consumer database, apply files to it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import click
import orjson

from ..model.contract import Outcome
from ..model.envelope import MAX_BODY_BYTES
from ..model.errors import ConfigError, TransientError
from ..ops import replay as replay_lib
from ..ops import sources as sources_lib
from ..store.dbfile import WriterLock
from ._common import (
    EXIT_OK,
    EXIT_REJECTED,
    Fatal,
    consumer_option,
    db_option,
    handle_errors,
    open_db,
)

#: Show a progress bar on a terminal when the files hold more than this.
PROGRESS_MIN_BYTES = 4 << 20
#: Events parsed ahead of the database when reading files (not stdin, where
#: events may trickle in and each is applied once its batch is complete).
READ_AHEAD = 256
#: Per-event lines written at a time when stdout is a file or a pipe.
BLOCK_LINES = 512


@click.command()
@consumer_option(required=True)
@db_option
@handle_errors
def init(consumer: str, db_path: Path | None) -> None:
    """Create (or upgrade) the database of a consumer."""
    with open_db(consumer, db_path, create=True, empty_ok=True) as db:  # init on an empty file: meant
        meta = db.meta()
        click.echo(
            f"{db.path}: consumer {meta['consumer']}, store schema ready, "
            f"{db.spec.name} tables at version {meta['consumer_schema_version']}"
        )


def _text_line(item: sources_lib.Item, outcome: Outcome) -> str:
    event_id = outcome.event_id or "-"
    if outcome.result is not None:
        return f"{event_id} {outcome.result}"
    if outcome.rejection is not None:
        rej = outcome.rejection
        return f"{event_id} rejected {rej.code}: {rej.reason} ({item.location})"
    assert outcome.transient is not None
    code = outcome.transient.code
    named = "" if code == "transient" else f" {code}"  # TransientError's default code: "transient transient"
    return f"{event_id} not applied, transient{named}: {outcome.transient.reason} ({item.location})"


def _json_line(item: sources_lib.Item, outcome: Outcome) -> dict[str, object]:
    if outcome.result is not None:
        return {"eventId": outcome.event_id, "result": outcome.result}
    if outcome.rejection is not None:
        rej = outcome.rejection
        return {"eventId": rej.event_id, "rejected": rej.code, "reason": rej.reason, "source": item.location}
    assert outcome.transient is not None
    return {
        "eventId": outcome.event_id,
        "transient": outcome.transient.code,
        "reason": outcome.transient.reason,
        "source": item.location,
    }


def _isatty(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except Exception:  # a closed or odd stream: treat it as a file
        return False


def _with_progress(items: Iterator[sources_lib.Item], total: int, stack: ExitStack) -> Iterator[sources_lib.Item]:
    if total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        return items  # as they are: no generator layer per event without a bar
    bar = stack.enter_context(click.progressbar(length=total, label="replaying", file=sys.stderr))
    return _counted(items, bar)


def _counted(items: Iterator[sources_lib.Item], bar: Any) -> Iterator[sources_lib.Item]:
    for item in items:
        bar.update(len(item.body) + 1)
        yield item


@click.command()
@consumer_option()
@db_option
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1, 100_000),
              help="Events per transaction (results do not depend on it).")
@click.option("--max-bytes", default=MAX_BODY_BYTES, show_default=True, type=click.IntRange(1),
              help="Largest body accepted; larger ones are rejected invalid-envelope.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per event on stdout; the summary goes to stderr.")
@click.argument("sources", nargs=-1, required=True)
@handle_errors
def replay(consumer: str | None, db_path: Path | None, batch: int, max_bytes: int,
           as_json: bool, sources: tuple[str, ...]) -> None:
    """Apply envelopes from SOURCES, in order, straight into a consumer's database.

    SOURCE: a .json file (one envelope), a .ndjson/.jsonl file (one per line),
    a directory (its such files in name order) or - for NDJSON on stdin.
    Exit 0 when every event applied, 1 when something was rejected, 2 for
    usage or database errors.
    """
    try:
        files = sources_lib.expand(sources)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="SOURCES") from None
    summary = replay_lib.Summary()
    lines = _Lines(as_json, interactive="-" in files or _isatty(sys.stdout))
    with ExitStack() as stack:
        db = stack.enter_context(open_db(consumer, db_path, create=consumer is not None))
        # Replays may share a database; a run holds its own alone (docs/failures.md).
        lock = WriterLock(db.path)
        lock.acquire(os.getpid(), "replay", shared=True)
        stack.callback(lock.release)
        items = _with_progress(
            sources_lib.read(files, limit=max_bytes), sources_lib.total_size(files), stack
        )
        try:
            read_ahead = 0 if "-" in files else READ_AHEAD
            # Closed before the progress bar (the stack unwinds in reverse): the
            # thread that reads ahead has stopped before the bar is finished.
            outcomes = stack.enter_context(closing(replay_lib.replay(
                db, items, batch=batch, max_bytes=max_bytes, read_ahead=read_ahead)))
            lines.take(outcomes, summary)
        except TransientError as exc:
            lines.flush()
            click.echo(summary.line(), err=True)
            raise Fatal(f"stopped, database unusable: {exc.reason} (events listed above are committed)") from None
        finally:
            lines.flush()
    click.echo(summary.line(), err=as_json)
    sys.exit(EXIT_REJECTED if summary.failed else EXIT_OK)


class _Lines:
    """The per-event lines, handed to ``click.echo`` in blocks.

    ``click.echo`` flushes (and asks isatty) on every call: a system call per
    event, which cost more than validation at ``--batch 1``
    (bench/bench_replay.py). Writing to a file or a pipe, the lines go out
    every :data:`BLOCK_LINES` events and at the end instead; on a terminal, or
    reading stdin (events may trickle in), each line still goes out at once.
    The bytes written are the same either way.
    """

    def __init__(self, as_json: bool, interactive: bool):
        self.as_json = as_json
        self.block = 1 if interactive else BLOCK_LINES
        self.text: list[str] = []
        self.json: list[bytes] = []

    def take(self, outcomes: Iterator[tuple[sources_lib.Item, Outcome]], summary: replay_lib.Summary) -> None:
        """Count every outcome in *summary* and add its line. The usual one
        (a result, as text) is counted and written here, without the calls of
        :meth:`Summary.add`, :meth:`add` and :func:`_text_line`: one per event."""
        results = summary.results
        for item, outcome in outcomes:
            result = outcome.result
            if result is None or self.as_json:
                summary.add(outcome)
                self.add(item, outcome)
                continue
            results[result] += 1
            text = self.text
            text.append(f"{outcome.event_id or '-'} {result}")
            if len(text) >= self.block:
                self.flush()

    def add(self, item: sources_lib.Item, outcome: Outcome) -> None:
        if self.as_json:
            self.json.append(orjson.dumps(_json_line(item, outcome)))
            if len(self.json) >= self.block:
                self.flush()
        else:
            self.text.append(_text_line(item, outcome))
            if len(self.text) >= self.block:
                self.flush()

    def flush(self) -> None:
        if self.json:
            click.echo(b"\n".join(self.json))
            self.json = []
        if self.text:
            click.echo("\n".join(self.text))
            self.text = []
