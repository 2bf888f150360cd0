"""The producer side: a transactional outbox in the producer's own database
(SQLite, or PostgreSQL through psycopg 3), and the dispatcher that moves its
rows to RabbitMQ.

The producer writes its own change and the event in **one** transaction::

    conn = outbox.connect("producer.db")            # WAL, synchronous=FULL, outbox installed
    with outbox.transaction(conn):                  # BEGIN IMMEDIATE ... COMMIT
        conn.execute("UPDATE material SET ...")
        outbox.enqueue(conn, envelope)               # validated, canonical bytes stored

so the change and the event commit together or not at all.

* :mod:`.table` -- the schema (versioned, forward-only), ``connect``,
  ``transaction``, ``enqueue``, ``notify`` and the routing-key check;
* :mod:`.db` -- the storage seam (its interface: :mod:`.seam`): the shared
  code's connection, on SQLite or PostgreSQL (:mod:`.pg`: install, enqueue,
  claims, LISTEN/NOTIFY);
* :mod:`.wake` -- a commit wakes the dispatchers on its host at once;
* :mod:`.dispatcher` -- ``delivery-consumer dispatch``: leases, batches in
  flight, order per article, quarantine, exit when idle;
* :mod:`.owners` -- which dispatcher holds a lease and whether it is alive;
* :mod:`.queries` -- ``outbox list | stats | show | prune | requeue | drop``
  and the read functions other views call.

Design notes: docs/outbox.md.
"""

from __future__ import annotations

from .db import OutboxDb, SqliteDb, as_db, display, exists, is_pg_url, open_db
from .dispatcher import PERMANENT, Claimed, DispatchConfig, Dispatcher, DispatchStats, PublisherLike, default_owner
from .queries import (
    STATES,
    Row,
    describe_waiting,
    drop,
    list_rows,
    pending_states,
    prune,
    quarantined_ids,
    requeue,
    show,
    stats,
    unpublished,
    waiting,
)
from .table import (
    MAX_ERROR_CHARS,
    MAX_ROUTING_KEY_BYTES,
    MIGRATIONS,
    VERSION,
    OutboxError,
    connect,
    enqueue,
    install,
    installed_version,
    notify,
    routing_key_problem,
    transaction,
)

__all__ = [
    "MAX_ERROR_CHARS",
    "MAX_ROUTING_KEY_BYTES",
    "MIGRATIONS",
    "PERMANENT",
    "STATES",
    "VERSION",
    "Claimed",
    "DispatchConfig",
    "DispatchStats",
    "Dispatcher",
    "OutboxDb",
    "OutboxError",
    "PublisherLike",
    "Row",
    "SqliteDb",
    "as_db",
    "connect",
    "default_owner",
    "describe_waiting",
    "display",
    "drop",
    "enqueue",
    "exists",
    "install",
    "installed_version",
    "is_pg_url",
    "list_rows",
    "notify",
    "open_db",
    "pending_states",
    "prune",
    "quarantined_ids",
    "requeue",
    "routing_key_problem",
    "show",
    "stats",
    "transaction",
    "unpublished",
    "waiting",
]
