"""The ``delivery-consumer`` command: a thin click layer over the library.

Each command module is imported only when its command runs, so that
``replay`` and the inspect commands never pay for importing pika. A
consumer's name is a command too: ``<consumer> list|show`` of its view.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from ..model.errors import DeliveryError
from ..version import __version__
from ._common import LazyGroup, config_option

# command name -> "module:attribute" (relative to this package)
COMMANDS: dict[str, str] = {
    "init": "replay:init",
    "replay": "replay:replay",
    "inbox": "inbox:inbox",
    "rejected": "inbox:rejected",
    "query": "inbox:query",
    "trace": "trace:trace",
    "dead": "dead:dead",
    "run": "run:run",
    "publish": "publish:publish",
    "topology": "topology:topology",
    "repartition": "partitions:repartition",
    "reroute": "partitions:reroute",
    "fence": "fence:fence",
    "dispatch": "outbox:dispatch",
    "outbox": "outbox:outbox",
    "produce": "outbox:produce",
    "config": "config:config",
    "status": "status:status",
    "console": "console:console",
    "asyncapi": "asyncapi:asyncapi",
}


def hoist_config(args: list[str]) -> list[str]:
    """``--config PATH`` moved to the front wherever it was given (``status --config
    x.toml`` means what ``--config x.toml status`` means); nothing after ``--`` moves."""
    end = args.index("--") if "--" in args else len(args)
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < end:
        arg = args[i]
        if arg == "--config" and i + 1 < end:
            front += args[i:i + 2]
            i += 2
            continue
        (front if arg.startswith("--config=") else rest).append(arg)
        i += 1
    return front + rest + args[end:]


class RootGroup(LazyGroup):
    """The root: its commands, then ``<consumer> list|show`` of every
    registered consumer whose spec has a view (``cli/views.py``).
    ``--config`` is the root's option, accepted after the command too."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_config(args))

    def main(self, *args: Any, **kwargs: Any) -> NoReturn:
        """click's main, except that a usage error is one line naming the
        command, what is wrong and where the help is (click prints the usage
        block, a hint and the error on four)."""
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:  # a group without its command: its help
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "delivery-consumer"
            click.echo(f"delivery-consumer: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        from .. import consumers

        try:
            extra = [name for name in consumers.names() if consumers.get(name).view is not None]
        except DeliveryError:  # a broken plugin: its own command says why
            extra = []
        return sorted(set(super().list_commands(ctx)) | set(extra))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        from .. import consumers
        from .views import consumer_group

        try:
            spec = consumers.find(cmd_name)
        except DeliveryError as exc:  # a plugin that cannot be loaded: say so, not "no such command"
            raise click.UsageError(str(exc)) from None
        return None if spec is None else consumer_group(spec)


@click.group(cls=RootGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="delivery-consumer")
@config_option
def main() -> None:
    """RabbitMQ consumers with a per-consumer SQLite inbox: every event is
    applied once, acknowledged only after its commit, and never lost."""
