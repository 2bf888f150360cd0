"""The catalog projection: the latest revision of each material.

Ordering is by ``revision``, never by arrival or ``occurredAt``:

* no row, or a higher revision than stored -> write it, ``updated``
  (``material.withdrawn`` writes ``published = 0`` and keeps the title and
  url of its own revision);
* a lower revision -> nothing changes, ``stale``;
* the same revision -> compare the stored domain state (title, url,
  published) with the event's: equal -> ``same-state``, different ->
  rejection ``revision-conflict`` (two facts claim the same version).

The ordering is ``state.RevisionTable``'s, which any consumer can use on its
own table.

Because the outcome depends only on the highest revision seen, any order and
any duplication of a set of events converges to the same table
(``tests/core/test_properties.py`` checks it).
"""

from __future__ import annotations

from ..model.contract import ConsumerSpec, View
from ..model.envelope import Envelope
from ..model.state import RevisionTable

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

#: The projection's revision-aware state (``state.py``: the one implementation).
TABLE = RevisionTable("catalog", key="article_id", state=("title", "url", "published"))


def _state(env: Envelope) -> tuple[str, str, int]:
    data = env.data
    return (data["title"], data["url"], int(env.type == PUBLISHED))


#: Apply one material event to the projection (see the module docstring), and
#: its batch form (``RevisionTable.effect``).
apply, apply_many = TABLE.effect(_state)


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
        key_column="article_id",
        event="event_id",
        decode={"published": bool},
        empty="the catalog is empty",
    ),
)
