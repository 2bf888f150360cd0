"""Property tests: the fingerprint ignores key order; any delivery order converges.

Convergence, precisely. A generated *set* of events covers a few articles and
revisions; every (article, revision) has one domain state (title, url,
published), carried by one or two events with different eventIds (the second
one is a same-state duplicate), so there are no conflicts. The set is
delivered in any order, with any redeliveries (the same eventId and body,
with its keys in another order), in batches of any size. Compared with
applying each distinct event once, in revision order:

* the catalog's domain state (article_id, revision, title, url, published) is
  equal. Its ``event_id``/``occurred_at`` columns are *not* compared: when two
  events carry the same state at the top revision, the first to arrive is the
  one written and the other is ``same-state``, by design;
* the set of receipts (event_id, fingerprint) is equal: one per distinct
  event, whatever the number of deliveries;
* the per-event results are *not* equal, and must not be: a lower revision
  arriving after a higher one is ``stale`` instead of ``updated``. What holds
  instead: at each article's top revision exactly one event is ``updated``
  and the others are ``same-state``; every redelivery answers
  ``duplicate:<its receipt's result>``; nothing is rejected;
* the audit table holds each distinct envelope exactly once (event_id,
  fingerprint, canonical JSON), every first delivery is ``recorded`` and
  every later one ``duplicate:recorded``.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import tempfile
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import PUBLISHED, WITHDRAWN, rows

from delivery_consumer import consumers
from delivery_consumer.inbox import ConsumerDB, apply_batch, apply_event
from delivery_consumer.model import envelope
from delivery_consumer.model.envelope import Envelope

# -- fingerprint: invariant to key order ------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=5),
    max_leaves=15,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=8)


def shuffled(value: Any, rnd: random.Random) -> Any:
    """*value* with the keys of every nested dict in a random order (lists keep theirs)."""
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: shuffled(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [shuffled(v, rnd) for v in value]
    return value


@settings(max_examples=100, deadline=None)
@given(obj=json_objects, rnd=st.randoms(use_true_random=False))
def test_fingerprint_is_invariant_to_key_order(obj: dict[str, Any], rnd: random.Random) -> None:
    """Any permutation of the keys of nested dicts gives the same canonical bytes and fingerprint."""
    permuted = shuffled(obj, rnd)
    expected = hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()

    assert envelope.canonical_bytes(obj) == envelope.canonical_bytes(permuted)
    assert expected == envelope.fingerprint(permuted)


@settings(max_examples=50, deadline=None)
@given(obj=json_objects, key=st.text(max_size=8), value=json_scalars)
def test_fingerprint_changes_with_any_added_or_changed_value(obj: dict[str, Any], key: str, value: Any) -> None:
    """Setting a key to a value it did not have gives another fingerprint."""
    changed = {**obj, key: value}
    if key in obj and orjson.dumps(obj[key]) == orjson.dumps(value):
        return  # the same JSON: nothing changed

    assert envelope.fingerprint(obj) != envelope.fingerprint(changed)


# -- convergence of the catalog and audit ---------------------------------------------

ARTICLES = ["article-1", "article-2", "article-3"]
titles = st.sampled_from(["Доставка без потерь", "Inbox в SQLite", "Ack после commit", "café", "cafe\u0301"])


@st.composite
def event_sets(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Distinct envelopes over a few articles: one domain state per (article, revision),
    carried by one or two events (same state, different eventIds)."""
    ids = itertools.count(1)
    events: list[dict[str, Any]] = []
    for article in ARTICLES[: draw(st.integers(1, len(ARTICLES)))]:
        for revision in sorted(draw(st.sets(st.integers(1, 6), min_size=1, max_size=4))):
            title = draw(titles)
            url = f"https://example.org/{article}/{draw(st.integers(1, 2))}"
            kind = draw(st.sampled_from([PUBLISHED, WITHDRAWN]))
            for copy in range(draw(st.integers(1, 2))):
                data: dict[str, Any] = {"title": title, "url": url}
                if copy:
                    data["producer"] = "second"  # not domain state: still same-state
                events.append({
                    "eventId": str(uuid.UUID(int=next(ids))),
                    "type": kind,
                    "articleId": article,
                    "revision": revision,
                    "occurredAt": f"2026-11-29T10:{revision:02d}:{copy:02d}Z",
                    "data": data,
                })
    return events


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[bytes], int]:
    """(distinct events, the bodies delivered in some order with redeliveries, batch size)."""
    events = draw(event_sets())
    sends = [e for e in events for _ in range(draw(st.integers(1, 3)))]
    order = draw(st.permutations(sends))
    rnd = draw(st.randoms(use_true_random=False))
    bodies = [orjson.dumps(shuffled(e, rnd)) for e in order]
    return events, bodies, draw(st.integers(1, 6))


def replay_bodies(db: ConsumerDB, bodies: list[bytes], batch: int) -> list[str]:
    """Parse and apply *bodies* in order, *batch* per transaction; the status of each."""
    statuses: list[str] = []
    for start in range(0, len(bodies), batch):
        chunk = [envelope.parse(b) for b in bodies[start : start + batch]]
        statuses += [outcome.status for outcome in apply_batch(db, chunk)]
    return statuses


def in_revision_order(events: list[dict[str, Any]]) -> list[Envelope]:
    ordered = sorted(events, key=lambda e: (e["articleId"], e["revision"], e["eventId"]))
    return [envelope.from_mapping(e) for e in ordered]


CATALOG_STATE = "article_id, revision, title, url, published"
RECEIPTS = "event_id, fingerprint"

# Each example opens fresh databases in its own temporary directory (tmp_path
# would be shared by all examples of one test).
convergence_settings = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@convergence_settings
@given(case=deliveries())
def test_catalog_converges_whatever_the_order_and_duplicates(
    case: tuple[list[dict[str, Any]], list[bytes], int],
) -> None:
    """Any order, any redeliveries, any batch size: the same catalog state and receipts as revision order."""
    events, bodies, batch = case
    with tempfile.TemporaryDirectory() as tmp:
        with consumers.open_db(Path(tmp, "ref.db"), "catalog", create=True) as ref:
            reference = [apply_event(ref, e) for e in in_revision_order(events)]
            expected_catalog = rows(ref, "catalog", CATALOG_STATE)
            expected_receipts = rows(ref, "inbox", RECEIPTS)
        with consumers.open_db(Path(tmp, "db.db"), "catalog", create=True) as db:
            statuses = replay_bodies(db, bodies, batch)
            catalog = rows(db, "catalog", CATALOG_STATE)
            written_by = dict(rows(db, "catalog", "article_id, event_id"))
            receipts = rows(db, "inbox", RECEIPTS)
            result_of = dict(rows(db, "inbox", "event_id, result"))
            rejected = rows(db, "rejected")

    assert "stale" not in reference
    assert expected_catalog == catalog
    assert expected_receipts == receipts
    assert [] == rejected
    # The first delivery of an eventId gave its receipt's result; later ones duplicate it.
    seen: set[str] = set()
    for raw, status in zip(bodies, statuses, strict=True):
        event_id = orjson.loads(raw)["eventId"]
        expected = result_of[event_id] if event_id not in seen else "duplicate:" + result_of[event_id]
        assert expected == status
        seen.add(event_id)
    # At each article's top revision: exactly one updated, the others same-state.
    top: dict[str, list[str]] = defaultdict(list)
    top_revision = {article: revision for article, revision, *_ in catalog}
    for e in events:
        if e["revision"] == top_revision[e["articleId"]]:
            top[e["articleId"]].append(e["eventId"])
    for article, event_ids in top.items():
        results = sorted(result_of[i] for i in event_ids)
        assert ["same-state"] * (len(event_ids) - 1) + ["updated"] == results
        assert written_by[article] in event_ids


@convergence_settings
@given(case=deliveries())
def test_audit_records_each_distinct_envelope_once(case: tuple[list[dict[str, Any]], list[bytes], int]) -> None:
    """Any order and redeliveries: audit holds each distinct envelope once; later deliveries are duplicates."""
    events, bodies, batch = case
    expected_rows = sorted(
        (e.event_id, e.fingerprint, e.canonical.decode()) for e in map(envelope.from_mapping, events)
    )
    with tempfile.TemporaryDirectory() as tmp, consumers.open_db(Path(tmp, "a.db"), "audit", create=True) as db:
        statuses = replay_bodies(db, bodies, batch)
        audit = rows(db, "audit", "event_id, fingerprint, envelope")
        receipts = rows(db, "inbox", "event_id, result")

    assert expected_rows == audit
    assert sorted((e["eventId"], "recorded") for e in events) == receipts
    first_seen = {orjson.loads(b)["eventId"]: i for i, b in reversed(list(enumerate(bodies)))}
    assert sorted(first_seen.values()) == [i for i, s in enumerate(statuses) if s == "recorded"]
    assert len(bodies) - len(events) == statuses.count("duplicate:recorded")


@settings(max_examples=25, deadline=None)
@given(case=deliveries())
def test_results_do_not_depend_on_the_batch_size(case: tuple[list[dict[str, Any]], list[bytes], int]) -> None:
    """The same deliveries give the same statuses and tables with --batch 1 and any other batch size."""
    _, bodies, batch = case
    tables: dict[int, Any] = {}
    statuses: dict[int, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in (("one", 1), ("many", batch)):
            with consumers.open_db(Path(tmp, f"{name}.db"), "catalog", create=True) as db:
                statuses[size] = replay_bodies(db, bodies, size)
                tables[size] = (rows(db, "catalog"), rows(db, "inbox", "event_id, fingerprint, result"))

    assert statuses[1] == statuses[batch]
    assert tables[1] == tables[batch]
