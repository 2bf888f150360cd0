"""The catalog projection: the latest revision of each material.

Ordering is by ``revision``, never by arrival or ``occurredAt``:

* no row, or a higher revision than stored -> write it, ``updated``
  (``material.withdrawn`` writes ``published = 0`` and keeps the title and
  url of its own revision);
* a lower revision -> nothing changes, ``stale``;
* the same revision -> compare the fingerprint of the domain state
  (articleId, title, url, published): equal -> ``same-state``, different ->
  rejection ``revision-conflict`` (two facts claim the same version).

Because the outcome depends only on the highest revision seen, any order and
any duplication of a set of events converges to the same table
(``tests/test_properties.py`` checks it).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import orjson

from ..contract import ConsumerSpec, View
from ..envelope import Envelope, fingerprint
from ..errors import REVISION_CONFLICT, Rejection

PUBLISHED = "material.published"
WITHDRAWN = "material.withdrawn"

MIGRATIONS = (
    """
    CREATE TABLE catalog (
        article_id  TEXT PRIMARY KEY,
        revision    INTEGER NOT NULL CHECK (revision >= 1),
        title       TEXT NOT NULL,
        url         TEXT NOT NULL,
        published   INTEGER NOT NULL CHECK (published IN (0, 1)),
        event_id    TEXT NOT NULL,
        occurred_at TEXT NOT NULL
    ) STRICT;
    """,
)

_SELECT = "SELECT revision, title, url, published FROM catalog WHERE article_id = ?"
# One statement for the common case: write the row when it is new or older.
# When the stored revision is the same or higher nothing changes (rowcount 0)
# and a SELECT tells stale from same-state from conflict.
_UPSERT_IF_NEWER = """
INSERT INTO catalog (article_id, revision, title, url, published, event_id, occurred_at)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (article_id) DO UPDATE SET
    revision = excluded.revision, title = excluded.title, url = excluded.url,
    published = excluded.published, event_id = excluded.event_id,
    occurred_at = excluded.occurred_at
WHERE excluded.revision > catalog.revision
"""


def state_fingerprint(article_id: str, title: str, url: str, published: bool) -> str:
    """Fingerprint of the domain state of one material at one revision."""
    return fingerprint(
        {"articleId": article_id, "title": title, "url": url, "published": bool(published)}
    )


def apply(conn: sqlite3.Connection, env: Envelope) -> str:
    """Apply one material event to the projection; see the module docstring."""
    published = env.type == PUBLISHED
    title, url = env.title, env.url
    written = conn.execute(
        _UPSERT_IF_NEWER,
        (env.article_id, env.revision, title, url, int(published), env.event_id, env.occurred_at),
    ).rowcount
    if written:
        return "updated"
    row = conn.execute(_SELECT, (env.article_id,)).fetchone()
    if env.revision < row[0]:
        return "stale"
    stored = state_fingerprint(env.article_id, row[1], row[2], bool(row[3]))
    if stored == state_fingerprint(env.article_id, title, url, published):
        return "same-state"
    raise Rejection(
        REVISION_CONFLICT,
        f"revision {env.revision} of article is already stored with another state",
        event_id=env.event_id,
        fingerprint=env.fingerprint,
    )


_SELECT_MANY = (
    "SELECT article_id, revision, title, url, published FROM catalog"
    " WHERE article_id IN (SELECT value FROM json_each(?))"
)


def apply_many(conn: sqlite3.Connection, envs: Sequence[Envelope]) -> list[str]:
    """:func:`apply` for a batch: one SELECT of the batch's articles, the
    results worked out in memory in delivery order, one upsert per article
    (its highest revision). Raises the conflict's rejection before writing."""
    if len(envs) == 1:
        return [apply(conn, envs[0])]
    articles = orjson.dumps(list({env.article_id: None for env in envs})).decode()
    state: dict[str, tuple[int, str, str, int]] = {
        row[0]: row[1:] for row in conn.execute(_SELECT_MANY, (articles,))
    }
    # article -> the row to write; a dict keeps the order of first writes, so
    # new articles get their rowids in the order apply() would give them.
    writes: dict[str, tuple[str, int, str, str, int, str, str]] = {}
    results: list[str] = []
    for env in envs:
        article, revision = env.article_id, env.revision
        published = int(env.type == PUBLISHED)
        title, url = env.title, env.url
        stored = state.get(article)
        if stored is None or revision > stored[0]:
            state[article] = (revision, title, url, published)
            writes[article] = (article, revision, title, url, published, env.event_id, env.occurred_at)
            results.append("updated")
        elif revision < stored[0]:
            results.append("stale")
        elif (stored[1], stored[2], stored[3]) == (title, url, published):
            results.append("same-state")
        else:
            raise Rejection(REVISION_CONFLICT, "revision conflict in a batch", event_id=env.event_id)
    conn.executemany(_UPSERT_IF_NEWER, writes.values())
    return results


SPEC = ConsumerSpec(
    name="catalog",
    apply=apply,
    apply_many=apply_many,
    migrations=MIGRATIONS,
    binding_keys=("material.*",),
    description="projection of the latest revision of each material",
    tables=("catalog",),
    view=View(
        table="catalog",
        columns=("article_id", "revision", "published", "title", "url", "event_id", "occurred_at"),
        order=("article_id",),
        key="article_id",
        brief=("article_id", "revision", "published", "title", "url"),
        article="article_id",
        event="event_id",
        decode={"published": bool},
        empty="the catalog is empty",
    ),
)
