"""Options, error handling and the lazily loaded group shared by the commands."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import orjson

from ..consumers import open_db as open_consumer_db
from ..inbox import ConsumerDB
from ..model.errors import ConfigError, DatabaseError, DeliveryError, StoreUnavailable, WrongDatabase

if TYPE_CHECKING:
    from ..ops.deployment import Deployment

F = TypeVar("F", bound=Callable[..., Any])

#: Exit codes shared by every command.
EXIT_OK, EXIT_REJECTED, EXIT_ERROR = 0, 1, 2


class Fatal(click.ClickException):
    """One clear line on stderr and exit 2 (usage, database or broker error)."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"delivery-consumer: {self.format_message()}", err=True)


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module_name, attr = self.lazy[cmd_name].split(":")
            module = importlib.import_module(f".{module_name}", __package__)
            command: click.Command = getattr(module, attr)
            return command
        return super().get_command(ctx, cmd_name)


def handle_errors(fn: F) -> F:
    """Turn the library's errors into one line and exit 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            _reader_went_away()
        except (DeliveryError, OSError) as exc:
            raise Fatal(_naming_the_key(str(exc))) from None

    return wrapper  # type: ignore[return-value]


#: The exit code of a command whose reader closed the pipe (``| head``): 128 + SIGPIPE, as for cat or grep.
EXIT_BROKEN_PIPE = 141


def _reader_went_away() -> None:
    """Stop quietly: nobody reads stdout any more. Later writes (the interpreter's
    final flush included) go to /dev/null instead of printing a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test runner's stdout)
        pass
    sys.exit(EXIT_BROKEN_PIPE)


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


class DatabaseParam(click.ParamType["Path | str"]):
    """A database file (a Path), or a PostgreSQL URL (``postgresql://...``, kept as a str)."""

    name = "path|url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        if isinstance(value, str) and value.startswith(("postgresql://", "postgres://")):
            return value
        return Path(value)


def db_option(fn: F, *, help: str = "Database file (default: state/<consumer>/inbox.db).",
              envvar: str = "DELIVERY_DB", callback: Callable[[click.Context, click.Parameter, Any], Any] | None = None,
              ) -> F:
    """``--db PATH``: a consumer's database, the deployment file's when not given (its help
    says so); another database (the producer's) with its own *envvar* and *callback*."""
    # Any path, a directory included: ConsumerDB.open answers in one line, where
    # click's own checks would print a multi-line usage error.
    return click.option(
        "--db",
        "db_path",
        envvar=envvar,
        show_envvar=True,
        type=DatabaseParam(),
        callback=callback or from_deployment("db"),
        help=help + (" The deployment file's [consumers.<consumer>] db when not given." if callback is None else ""),
    )(fn)


class EventId(click.ParamType[str]):
    """An eventId on the command line: a UUID, any case, given in the contract's lowercase spelling."""

    name = "EVENT_ID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from ..model.envelope import is_event_id

        text = str(value).strip().lower()
        if not is_event_id(text):
            self.fail(f"{str(value)[:80]!r} is not a UUID: an eventId is written 8-4-4-4-12 in hex, "
                      "e.g. 0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11", param, ctx)
        return text


EVENT_ID = EventId()


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(fn)


def open_db(
    consumer: str | None, db_path: Path | None, *, create: bool = False, readonly: bool = False,
    empty_ok: bool = False,
) -> ConsumerDB:
    """Open a consumer database for a command, or exit 2 with one line."""
    if consumer is None and db_path is None:
        raise Fatal("give --consumer NAME or --db PATH (or DELIVERY_CONSUMER / DELIVERY_DB)")
    try:
        return open_consumer_db(db_path, consumer, create=create, readonly=readonly, empty_ok=empty_ok)
    except (DatabaseError, ConfigError) as exc:
        raise Fatal(_from_file(db_path) + str(exc)) from None
    except StoreUnavailable as exc:  # the disk's fault (full, busy, read-only): said as it is
        raise Fatal(_from_file(db_path) + exc.reason) from None


# -- the deployment file ---------------------------------------------------------
#
# The root group's --config loads the file once (config_option); each shared
# option factory (db_option, amqp_options, the producer's --db, run's
# consumer options) takes its value from it through from_deployment, only when
# neither the command line nor the option's environment variable gave one:
# command line > environment > deployment file > built-in default.

_DEPLOYMENT = "delivery_consumer.deployment"
_CONFIG_ARG = "delivery_consumer.config_arg"
_FROM_FILE = "delivery_consumer.from_file"


def _remember_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    ctx.meta[_CONFIG_ARG] = value


def config_option(fn: F) -> F:
    """``--config PATH`` of the root group (``$DELIVERY_CONFIG``, else ``./delivery.toml`` if present).

    The file is read on first use (by an option that takes its value from it,
    or a command that needs it), so ``--help`` works whatever the file says.
    """
    return click.option(
        "--config", "config_path", metavar="PATH", expose_value=False, callback=_remember_config,
        help="Deployment file (default: $DELIVERY_CONFIG, else ./delivery.toml when it exists).",
    )(fn)


def deployment() -> Deployment | None:
    """The deployment file of the running command, or None; a bad file exits 2 with one line."""
    from ..ops import deployment

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return None
    if _DEPLOYMENT not in ctx.meta:
        try:
            ctx.meta[_DEPLOYMENT] = deployment.load(ctx.meta.get(_CONFIG_ARG))
        except ConfigError as exc:
            raise Fatal(str(exc)) from None
    found: Deployment | None = ctx.meta[_DEPLOYMENT]
    return found


def _from_file(db_path: Path | None) -> str:
    """``<file>: <key>: `` when *db_path* came from the deployment file, else ''."""
    ctx = click.get_current_context(silent=True)
    source = ctx.meta.get(_FROM_FILE, {}) if ctx is not None else {}
    where = source.get(str(db_path)) if db_path is not None else None
    return f"{where}: " if where else ""


def _naming_the_key(message: str) -> str:
    """*message* prefixed with ``<file>: <key>: `` when it is about a database the deployment file named."""
    ctx = click.get_current_context(silent=True)
    for path, where in (ctx.meta.get(_FROM_FILE, {}) if ctx is not None else {}).items():
        if message.startswith(f"{path}: "):
            return f"{where}: {message}"
    return message


def _given(ctx: click.Context, name: str | None) -> bool:
    from click.core import ParameterSource

    source = ctx.get_parameter_source(name) if name else None
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.PROMPT)


def from_deployment(key: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """An option callback: the deployment file's value of *key* when the option was not given.

    ``amqp_url``, ``exchange``, ``queue_prefix``: the file's top level.
    ``producer_db``: the producer's database when the file names one producer.
    Any other key (``db``, ``webhook_url``, ``metrics_port``): the table
    ``[consumers.<consumer>]`` of the command's ``--consumer``.
    """

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if _given(ctx, param.name):
            return value
        found = deployment()
        if found is None:
            return value
        if key in ("amqp_url", "exchange", "queue_prefix"):
            return getattr(found, key)
        if key == "producer_db":
            producer = found.single_producer()
            if producer is None:
                return value
            ctx.meta.setdefault(_FROM_FILE, {})[str(producer.db)] = found.key(f"producers.{producer.name}.db")
            return producer.db
        consumer = ctx.params.get("consumer")
        entry = found.consumer(consumer) if isinstance(consumer, str) else None
        if entry is None:
            return value
        if key == "db":
            ctx.meta.setdefault(_FROM_FILE, {})[str(entry.db)] = found.key(f"consumers.{entry.name}.db")
            if isinstance(entry.db, Path):  # a PostgreSQL URL: run checks whose inbox it is when it opens it
                _check_owner(found, entry.name, entry.db)
            return entry.db
        return entry.options.get(key, value)

    return callback


def _check_owner(found: Deployment, consumer: str, db_path: Path) -> None:
    """A database named in the file for *consumer* that belongs to another one: exit 2 now,
    naming the key (``run`` would only find out in its worker process)."""
    if not db_path.is_file():
        return
    try:
        open_consumer_db(db_path, consumer, readonly=True).close()
    except WrongDatabase as exc:
        raise Fatal(f"{found.key(f'consumers.{consumer}.db')}: {exc}") from None
    except (DatabaseError, ConfigError):
        pass  # the command itself says what is wrong, naming the key


def checked_deployment(*, owners: bool = True) -> Deployment:
    """The deployment file, or exit 2 in one line; with *owners*, also when it gives a consumer
    a database of another consumer or of a producer (a mistake in the file, not a state to report)."""
    from ..ops.deployment import foreign_databases

    found = deployment()
    if found is None:
        raise Fatal("no deployment file: give --config PATH (or DELIVERY_CONFIG), or run where ./delivery.toml is")
    foreign = foreign_databases(found) if owners else []
    if foreign:
        raise Fatal(foreign[0] + (f" (and {len(foreign) - 1} more: config check lists them)"
                                  if len(foreign) > 1 else ""))
    return found


def setup_logging(level: str, fmt: str = "text", consumer: str | None = None) -> None:
    """Logging for a long-running command (see :mod:`delivery_consumer.observability.logs`)."""
    from ..observability import logs

    logs.setup(level, fmt, consumer)


def emit_json(value: Any) -> None:
    """One JSON document (or line) on stdout."""
    sys.stdout.buffer.write(orjson.dumps(value) + b"\n")
    sys.stdout.flush()
