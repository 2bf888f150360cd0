"""``<consumer> list|show``: the commands of a consumer's own view, made from
the :class:`~delivery_consumer.model.contract.View` in its spec (any registered
consumer: built-in, ``DELIVERY_PLUGINS`` or an entry point).

The reading is :mod:`delivery_consumer.inbox.views`; the database handling
(read-only, partitions, exit codes) is the one of :mod:`.inbox`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..amqp.partitions import partition_of
from ..inbox import views
from ..model.contract import ConsumerSpec, View
from ._common import emit_json, handle_errors
from ._output import echo_record, echo_table
from .inbox import find_first, limit_option, partition_paths, read_options, reading, reading_all


def _list_command(consumer: str, view: View) -> click.Command:
    keys = [views.name(view, column) for column in (view.brief or view.columns)]

    @handle_errors
    def list_rows(consumer: str, db_path: Path | None, as_json: bool, limit: int, **filters: Any) -> None:
        with reading_all(consumer, db_path) as dbs:
            rows = views.list_rows(dbs, view, filters=filters, limit=limit)
        if as_json:
            emit_json(rows)
            return
        echo_table(keys, [[row[key] for key in keys] for row in rows], empty=view.empty)

    fn = read_options(consumer)(limit_option(list_rows, view.limit))
    for option, column in view.filters.items():
        fn = click.option(f"--{option}", option, help=f"Only rows whose {views.name(view, column)} is this.")(fn)
    return click.command("list", help=f"The rows of {view.table}{_order_text(view)} "
                                      "(of every partition, when partitioned).")(fn)


def _order_text(view: View) -> str:
    """``, by articleId`` / ``, newest first`` for the help of ``list``."""
    terms = []
    for term in view.order:
        column, desc = term.lstrip("-"), term.startswith("-")
        terms.append(("newest first" if desc else "oldest first") if column == "rowid"
                     else f"by {views.name(view, column)}" + (" descending" if desc else ""))
    return "".join(f", {t}" for t in terms)


def _show_command(consumer: str, view: View, key: str) -> click.Command:
    label = views.name(view, key)

    @handle_errors
    def show(consumer: str, db_path: Path | None, as_json: bool, value: str) -> None:
        paths = partition_paths(consumer, db_path)
        if paths is not None and key == view.key_column:  # the key's own partition, by the routing function
            k = partition_of(value, len(paths))
            with reading(consumer, paths[k]) as db:
                row = {**views.show(db, view, value), "partition": k}
        else:
            with reading_all(consumer, db_path) as dbs:
                row = find_first(dbs, lambda db: views.show(db, view, value))
        if as_json:
            emit_json(row)
            return
        echo_record(list(row.items()))

    fn = click.argument("value", metavar=key.upper())(read_options(consumer)(show))
    return click.command("show", help=f"The {view.table} row of {label} {key.upper()}.")(fn)


def consumer_group(spec: ConsumerSpec) -> click.Group | None:
    """``<name> list`` (and ``show`` when the view has a key), or None without a view."""
    view = spec.view
    if view is None:
        return None
    about = f": {spec.description}" if spec.description else ""
    group = click.Group(spec.name, help=f"The {view.table} table of the {spec.name} consumer{about}.")
    group.add_command(_list_command(spec.name, view))
    if view.key is not None:
        group.add_command(_show_command(spec.name, view, view.key))
    return group


__all__ = ["consumer_group"]
