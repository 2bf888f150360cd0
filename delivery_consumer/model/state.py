"""Revision-aware state in a consumer's own table: the latest revision of each key.

:class:`RevisionTable` is what the catalog uses, for any table keyed by any
event type's key. Called from a consumer's ``apply`` (inside the store's
transaction: it never commits), it orders by ``revision``, never by arrival:

* no row, or a higher revision than stored -> the row is written, ``updated``;
* a lower revision -> nothing changes, ``stale``;
* the same revision -> the stored state columns are compared with the
  event's: equal -> ``same-state``; different -> rejection
  ``revision-conflict`` (two facts claim one version), whose reason names
  the key (``revision 2 of orderId order-7 ...``).

The outcome depends only on the highest revision seen, so any order and any
duplication of a set of events converges to the same table.

The table has a unique key column, an INTEGER revision column, the state
columns, and optionally an event-id and an occurred-at column (written with
the row, not compared). The consumer creates it in its migrations;
:meth:`RevisionTable.check` (in ``ConsumerSpec.checks``) refuses, at start-up,
a table that lacks one of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import orjson

from .contract import ApplyFn, ApplyManyFn, Connection, dialect
from .envelope import Envelope
from .errors import REVISION_CONFLICT, ConfigError, Rejection, safe_reason

#: What an event writes into the state columns, in their order.
StateOf = Callable[[Envelope], Sequence[Any]]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class RevisionTable:
    """The latest revision of each key in *table* (see the module docstring).

    *key*: the key column (holds ``env.key``); *state*: the state columns, in
    the order :meth:`apply` receives their values; *revision*, *event_id*,
    *occurred_at*: the other columns (None: the table has no such column).
    """

    def __init__(
        self,
        table: str,
        *,
        key: str,
        state: Sequence[str],
        revision: str = "revision",
        event_id: str | None = "event_id",
        occurred_at: str | None = "occurred_at",
    ) -> None:
        extra = [c for c in (event_id, occurred_at) if c is not None]
        names = [table, key, revision, *state, *extra]
        for name in names:
            if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
                raise ConfigError(f"RevisionTable: {name!r} is not a plain SQL identifier")
        if len(set(names[1:])) != len(names) - 1:
            raise ConfigError(f"RevisionTable {table}: a column is named twice")
        self.table, self.key, self.revision, self.state = table, key, revision, tuple(state)
        self._with_event_id, self._with_occurred_at = event_id is not None, occurred_at is not None
        self._extra = tuple(extra)
        columns = [key, revision, *state, *extra]
        updates = ", ".join(f"{c} = excluded.{c}" for c in columns[1:])
        # One statement for the common case: write the row when it is new or
        # older. When the stored revision is the same or higher nothing
        # changes (rowcount 0) and a SELECT tells stale, same-state and conflict apart.
        self._upsert = (
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
            f" ON CONFLICT ({key}) DO UPDATE SET {updates} WHERE excluded.{revision} > {table}.{revision}"
        )
        selected = ", ".join([revision, *state])
        self._select = f"SELECT {selected} FROM {table} WHERE {key} = ?"
        #: The keys of a batch as one JSON parameter, per dialect (``contract.dialect``).
        self._select_many = {
            "sqlite": f"SELECT {key}, {selected} FROM {table} WHERE {key} IN (SELECT value FROM json_each(?))",
            "postgres": f"SELECT {key}, {selected} FROM {table} WHERE {key} IN"
                        " (SELECT value FROM json_array_elements_text(CAST(? AS json)))",
        }

    def check(self, conn: Connection) -> None:
        """ConfigError, in one line, unless *conn*'s database has this table with its
        columns and a key column that is unique (its PRIMARY KEY or a UNIQUE index):
        what :meth:`apply` needs, checked when the database opens (``ConsumerSpec.checks``)."""
        if dialect(conn) == "postgres":
            return self._check_columns(*_pg_columns(conn, self.table, self.key))
        columns = {row[1]: row for row in conn.execute(f'PRAGMA table_info("{self.table}")')}
        keyed = columns[self.key][5] == 1 and sum(1 for row in columns.values() if row[5]) == 1 if (
            self.key in columns) else False
        if columns and not keyed:
            for index in conn.execute(f'PRAGMA index_list("{self.table}")').fetchall():
                names = [row[2] for row in conn.execute(f'PRAGMA index_info("{index[1]}")')]
                keyed = keyed or (bool(index[2]) and names == [self.key])
        self._check_columns(set(columns), keyed)

    def _check_columns(self, columns: set[str], keyed: bool) -> None:
        """ConfigError unless the table has *columns* as :meth:`check` says and its key is *keyed*."""
        if not columns:
            raise ConfigError(f"RevisionTable {self.table}: no such table (create it in the consumer's migrations)")
        wanted = [self.key, self.revision, *self.state, *self._extra]
        missing = [name for name in wanted if name not in columns]
        if missing:
            raise ConfigError(f"RevisionTable {self.table}: no column {', '.join(missing)} (it needs "
                              f"{', '.join(wanted)})")
        if not keyed:
            raise ConfigError(f"RevisionTable {self.table}: {self.key} must be its PRIMARY KEY or UNIQUE "
                              "(one row per key)")

    def _row(self, env: Envelope, state: Sequence[Any]) -> tuple[Any, ...]:
        if self._with_event_id and self._with_occurred_at:  # the usual table: no tail to build
            return (env.key, env.revision, *state, env.event_id, env.occurred_at)
        tail = (env.event_id,) * self._with_event_id + (env.occurred_at,) * self._with_occurred_at
        return (env.key, env.revision, *state, *tail)

    def _no_revision(self, env: Envelope) -> NoReturn:
        """Refuse *env*, whose type carries no revision (its revision reads 0)."""
        raise ConfigError(f"{self.table}: events of type {env.type} carry no revision (declare revision=True)")

    def conflict(self, env: Envelope) -> Rejection:
        """The rejection of *env*, whose revision is stored with another state."""
        return Rejection(
            REVISION_CONFLICT,
            f"revision {env.revision} of {env.key_field} {safe_reason(env.key, 80)} is already stored"
            " with another state",
            event_id=env.event_id,
            fingerprint=env.fingerprint,
        )

    def apply(self, conn: Connection, env: Envelope, state: Sequence[Any]) -> str:
        """Apply *env* with *state* (the state columns' values) to the table;
        returns ``updated``, ``stale`` or ``same-state``, raises the conflict."""
        revision = env.revision
        if revision < 1:
            self._no_revision(env)
        if conn.execute(self._upsert, self._row(env, state)).rowcount:
            return "updated"
        row = conn.execute(self._select, (env.key,)).fetchone()
        if revision < row[0]:
            return "stale"
        if tuple(row[1:]) == tuple(state):
            return "same-state"
        raise self.conflict(env)

    def apply_many(self, conn: Connection, envs: Sequence[Envelope], state_of: StateOf) -> list[str]:
        """:meth:`apply` for a batch (a consumer's ``apply_many``): one SELECT
        of the batch's keys, the results worked out in memory in delivery
        order, one upsert per key (its highest revision). Raises the first
        conflict's rejection before writing anything."""
        if len(envs) == 1:
            return [self.apply(conn, envs[0], state_of(envs[0]))]
        keys = orjson.dumps(list({env.key: None for env in envs})).decode()
        rows = conn.execute(self._select_many[dialect(conn)], (keys,))
        stored: dict[str, tuple[Any, ...]] = {row[0]: tuple(row[1:]) for row in rows}
        # key -> the row to write; a dict keeps the order of first writes, so
        # new keys get their rowids in the order apply() would give them.
        writes: dict[str, tuple[Any, ...]] = {}
        results: list[str] = []
        usual = self._with_event_id and self._with_occurred_at  # _row's usual table, built inline below
        for env in envs:
            revision = env.revision
            if revision < 1:
                self._no_revision(env)
            state = tuple(state_of(env))
            key = env.key  # read once: a field of a NamedTuple is not a cheap read
            current = stored.get(key)
            if current is None or revision > current[0]:
                stored[key] = (revision, *state)
                writes[key] = (key, revision, *state, env.event_id, env.occurred_at) if usual else self._row(env, state)
                results.append("updated")
            elif revision < current[0]:
                results.append("stale")
            elif current[1:] == state:
                results.append("same-state")
            else:
                raise self.conflict(env)
        conn.executemany(self._upsert, writes.values())
        return results

    def effect(self, state_of: StateOf) -> tuple[ApplyFn, ApplyManyFn]:
        """A consumer's ``apply`` and ``apply_many`` on this table, *state_of*
        giving an event's state columns: :meth:`apply` and :meth:`apply_many`."""

        def apply(conn: Connection, env: Envelope) -> str:
            return self.apply(conn, env, state_of(env))

        def apply_many(conn: Connection, envs: Sequence[Envelope]) -> list[str]:
            return self.apply_many(conn, envs, state_of)

        return apply, apply_many


def _pg_columns(conn: Connection, table: str, key: str) -> tuple[set[str], bool]:
    """The columns of *table* in the connection's schema, and whether *key* alone is unique (PostgreSQL)."""
    columns = {str(row[0]) for row in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
        " AND table_name = ?", (table,))}
    keyed = conn.execute(
        "SELECT count(*) FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]"
        " WHERE i.indrelid = to_regclass(?) AND i.indisunique AND i.indnatts = 1 AND a.attname = ?",
        (f'"{table}"', key)).fetchone()[0]
    return columns, bool(keyed)


__all__ = ["RevisionTable", "StateOf"]
