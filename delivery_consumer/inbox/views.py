"""A consumer's own view of its effect table, read from the :class:`View` in its spec.

``<consumer> list|show`` and ``trace`` call these functions, so any registered
consumer -- built-in or plugin -- gets them from data alone. Read-only and
short, like :mod:`queries`; several databases (the partitions of one consumer)
read as one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..model.contract import View
from ..model.errors import DatabaseError, NotFound
from .reports import Row, camel, pg_inbox, reads, sql_limit

if TYPE_CHECKING:
    from .seam import InboxReader

#: (partition, database); partition None for an unpartitioned consumer.
Part = tuple[int | None, "InboxReader"]


def name(view: View, column: str) -> str:
    """The output name of *column*."""
    return view.rename.get(column) or camel(column)


def _require(db: InboxReader, view: View) -> None:
    spec = db.spec
    if view.table not in spec.tables and (spec.view is None or spec.view.table != view.table):
        raise DatabaseError(f"{db.path}: consumer {db.consumer!r} has no {view.table} table")


def _row(view: View, values: Sequence[Any]) -> Row:
    return {name(view, c): view.decode[c](v) if c in view.decode and v is not None else v
            for c, v in zip(view.columns, values, strict=False)}


def _terms(view: View) -> list[tuple[str, bool]]:
    """(column, descending) of the view's order."""
    return [(term.lstrip("-"), term.startswith("-")) for term in view.order]


@reads
def _select(db: InboxReader, view: View, where: Mapping[str, Any], limit: int) -> list[tuple[tuple[Any, ...], Row]]:
    """(sort key, row) of one database, in the view's order."""
    _require(db, view)
    width = len(view.columns)
    if (pg := pg_inbox(db)) is not None:  # inbox/pg_queries.py words it
        from .pg_queries import view_select

        return [(tuple(row[width:]), _row(view, row[:width])) for row in view_select(pg, view, where, limit)]
    terms = _terms(view)
    picks = [*view.columns, *(c for c, _ in terms)]
    conds = " AND ".join(f"{column} = ?" for column in where)
    order = ", ".join(f"{c} DESC" if desc else c for c, desc in terms)
    sql = (f"SELECT {', '.join(picks)} FROM {view.table}" + (f" WHERE {conds}" if conds else "")
           + (f" ORDER BY {order}" if order else "") + " LIMIT ?")
    rows = db.conn.execute(sql, [*where.values(), sql_limit(limit)]).fetchall()
    return [(tuple(row[width:]), _row(view, row[:width])) for row in rows]


def list_rows(parts: Sequence[Part], view: View, *, filters: Mapping[str, Any] | None = None,
              limit: int = 0) -> list[Row]:
    """The view's rows of every part, in its order, at most *limit* (0: all).

    *filters*: option name (a key of ``view.filters``) -> value; None values are ignored.
    Rows of a partition carry ``partition`` when there are several parts.
    """
    where = {view.filters[k]: v for k, v in (filters or {}).items() if v is not None}
    keyed = [(key, row if k is None else {**row, "partition": k})
             for k, db in parts for key, row in _select(db, view, where, limit)]
    for i, (_, desc) in reversed(list(enumerate(_terms(view)))):  # stable sorts, last term first
        keyed.sort(key=lambda item: item[0][i], reverse=desc)
    rows = [row for _, row in keyed]
    return rows[:limit] if limit else rows


@reads
def find(db: InboxReader, view: View, column: str, value: Any) -> Row:
    """The view's row whose *column* equals *value*, or NotFound."""
    _require(db, view)
    found = db.conn.execute(f"SELECT {', '.join(view.columns)} FROM {view.table} WHERE {column} = ? LIMIT 1",
                            (value,)).fetchall()
    if not found:
        raise NotFound(f"{name(view, column)} {value} not found in {db.path}")
    return _row(view, found[0])


def show(db: InboxReader, view: View, key: str) -> Row:
    """The view's row of *key* (``show KEY``), or NotFound."""
    if view.key is None:
        raise NotFound(f"consumer {db.consumer!r} has no show: its view declares no key")
    return find(db, view, view.key, key)


def key_row(db: InboxReader, event_id: str, key: str | None,
            field: str = "key") -> tuple[str | None, Row | None, str | None]:
    """For ``trace``: (the key, its row in the consumer's view or None, why not).
    The key is *key* when given (the one named, or the receipt's), else the
    one whose row this event wrote last (``view.event``). *field* is the
    type's key field, for the note (``orderId``)."""
    view = db.spec.view
    assert view is not None and view.key_column is not None
    if key is None:
        rows = [] if view.event is None else db.conn.execute(
            f"SELECT {view.key_column} FROM {view.table} WHERE {view.event} = ?", (event_id,)).fetchall()
        if not rows:
            return None, None, (f"no receipt of this event holds its {field}, and it wrote no current row; "
                                f"give --key VALUE to show the row of that {field}")
        key = str(rows[0][0])
    try:
        row = find(db, view, view.key_column, key)
    except NotFound:
        return key, None, f"{field} {key} is not in the {view.table}"
    if view.event is not None:
        row["currentEvent"] = row[name(view, view.event)] == event_id
    return key, row, None


__all__ = ["Part", "find", "key_row", "list_rows", "name", "show"]
