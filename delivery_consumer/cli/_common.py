"""Options and error handling shared by the commands."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import orjson

from ..errors import ConfigError, DatabaseError, DeliveryError
from ..store import ConsumerDB

F = TypeVar("F", bound=Callable[..., Any])

#: Exit codes shared by every command.
EXIT_OK, EXIT_REJECTED, EXIT_ERROR = 0, 1, 2


class Fatal(click.ClickException):
    """One clear line on stderr and exit 2 (usage, database or broker error)."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"delivery-consumer: {self.format_message()}", err=True)


def handle_errors(fn: F) -> F:
    """Turn the library's errors into one line and exit 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (DeliveryError, OSError) as exc:
            raise Fatal(str(exc)) from None

    return wrapper  # type: ignore[return-value]


def consumer_option(required: bool = False, default: str | None = None) -> Callable[[F], F]:
    return click.option(
        "--consumer",
        "-c",
        envvar="DELIVERY_CONSUMER",
        required=required,
        default=default,
        show_envvar=True,
        help="Consumer name (catalog, audit, or a registered one).",
    )


def db_option(fn: F, *, help: str = "Database file (default: state/<consumer>/inbox.db).") -> F:
    # Any path, a directory included: ConsumerDB.open answers in one line, where
    # click's own checks would print a multi-line usage error.
    return click.option(
        "--db",
        "db_path",
        envvar="DELIVERY_DB",
        show_envvar=True,
        type=click.Path(path_type=Path),
        help=help,
    )(fn)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(fn)


def open_db(
    consumer: str | None, db_path: Path | None, *, create: bool = False, readonly: bool = False
) -> ConsumerDB:
    """Open a consumer database for a command, or exit 2 with one line."""
    if consumer is None and db_path is None:
        raise Fatal("give --consumer NAME or --db PATH (or DELIVERY_CONSUMER / DELIVERY_DB)")
    try:
        return ConsumerDB.open(db_path, consumer, create=create, readonly=readonly)
    except (DatabaseError, ConfigError) as exc:
        raise Fatal(str(exc)) from None


def emit_json(value: Any) -> None:
    """One JSON document (or line) on stdout."""
    sys.stdout.buffer.write(orjson.dumps(value) + b"\n")
    sys.stdout.flush()
