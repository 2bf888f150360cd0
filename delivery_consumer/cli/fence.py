"""``fence list|show|resolve``: the fence rows of a consumer with an external effect.

``list`` and ``show`` are read-only like the inspect commands (``mode=ro``,
no lock, no snapshot kept). ``--db postgresql://...`` with ``--consumer``
reads and resolves the consumer's fence in its schema there. ``resolve`` is a person's verdict on a call
whose outcome is unknown (the dead letter ``outcome-unknown``): after it,
``dead requeue`` completes the event without calling (``--provider-id``) or
calls again with the same key (``--not-sent``).

Exit codes: 0, 1 when the key does not exist, 2 when the database cannot be
used or the fence cannot be resolved.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from ..inbox import fence as fence_lib
from ..inbox.apply import Store
from ..model.errors import DeliveryError, FenceError
from ..store.sqlite import translate
from ._common import Fatal, emit_json, handle_errors, open_db
from ._output import echo_record, echo_table
from .inbox import Missing, limit_option, read_options, reading

LIST_COLUMNS = ["claimedAt", "key", "state", "calls", "inDoubt", "providerId", "httpStatus", "lastError"]


@contextmanager
def _writable(consumer: str | None, db_path: Path | str | None) -> Iterator[Store]:
    """The consumer's database opened for a write: a file, or its schema in PostgreSQL."""
    if not isinstance(db_path, str):
        with open_db(consumer, db_path) as db:
            yield db
        return
    from .. import consumers
    from ..inbox.pg import PgInboxDB, redact

    if consumer is None:
        raise Fatal(f"{redact(db_path)}: give --consumer NAME (its inbox is the schema of that name)")
    try:
        pg = PgInboxDB.open(db_path, consumers.get(consumer))
    except DeliveryError as exc:
        raise Fatal(str(exc)) from None
    with pg:
        yield pg


@click.group()
def fence() -> None:
    """Fences of effects outside the database: one row per business step key."""


@fence.command("list")
@read_options("webhook")
@click.option("--state", type=click.Choice(fence_lib.STATES), help="Only fences in this state.")
@click.option("--in-doubt", is_flag=True, help="Only fences whose last call may have had its effect unknown to us.")
@limit_option
@handle_errors
def fence_list(consumer: str | None, db_path: Path | None, as_json: bool, state: str | None, in_doubt: bool,
               limit: int) -> None:
    """Fence rows, newest claim first."""
    with reading(consumer, db_path) as db:
        try:
            rows = fence_lib.fence_list(db.conn, state=state, in_doubt=True if in_doubt else None, limit=limit)
        except sqlite3.Error as exc:
            raise translate(exc, db.path) from None
    if as_json:
        emit_json(rows)
        return
    echo_table(LIST_COLUMNS, [[row[k] for k in LIST_COLUMNS] for row in rows], empty="no fences")


@fence.command("show")
@read_options("webhook")
@click.argument("key")
@handle_errors
def fence_show(consumer: str | None, db_path: Path | None, as_json: bool, key: str) -> None:
    """The fence of KEY (``<articleId>:<revision>:<step>``)."""
    with reading(consumer, db_path) as db:
        try:
            row = fence_lib.fence_show(db.conn, key)
        except sqlite3.Error as exc:
            raise translate(exc, db.path) from None
    if row is None:
        raise Missing(f"no fence with key {key!r}")
    if as_json:
        emit_json(row)
        return
    echo_record(list(row.items()))


@fence.command("resolve")
@read_options("webhook")
@click.argument("key")
@click.option("--provider-id", help="The provider did it: its id of the effect. The fence becomes done.")
@click.option("--not-sent", is_flag=True, help="The provider did not: the next delivery calls again, same key.")
@handle_errors
def fence_resolve(consumer: str | None, db_path: Path | None, as_json: bool, key: str, provider_id: str | None,
                  not_sent: bool) -> None:
    """Resolve a claimed fence by hand (after outcome-unknown), then requeue its dead letter."""
    with _writable(consumer, db_path) as db:
        try:
            row: dict[str, Any] = fence_lib.resolve(db, key, provider_id=provider_id, not_sent=not_sent)
        except FenceError as exc:
            raise Fatal(str(exc)) from None
    if as_json:
        emit_json(row)
        return
    echo_record(list(row.items()))
