"""The routing contract of partitioned consumers, and the partition identity of a database."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import cli

from delivery_consumer import consumers
from delivery_consumer.amqp.partitions import (
    SLOT_COUNT,
    SLOT_HEADER,
    Identity,
    check_partition,
    partition_of,
    route,
    slot_headers,
    slot_of,
)
from delivery_consumer.amqp.topology import Topology
from delivery_consumer.model.errors import ConfigError, DatabaseError

articles = st.text(min_size=1, max_size=64)
counts = st.integers(1, SLOT_COUNT)

#: Fixed vectors, also printed in docs/partitions.md for producers in other languages.
VECTORS = {"article-0": 219, "article-1": 80, "42": 141, "материал-7": 239}


def independent_slot(article_id: str) -> int:
    """The documented formula, written out again without the module's code."""
    (value,) = struct.unpack(">Q", hashlib.sha256(article_id.encode("utf-8")).digest()[:8])
    return int(value % 256)


@given(articles)
def test_slot_matches_the_documented_formula(article_id: str) -> None:
    """slot = first 8 bytes of SHA-256(UTF-8 articleId), big-endian, mod 256; sent as a decimal string."""
    assert slot_of(article_id) == independent_slot(article_id)
    slot = independent_slot(article_id)
    assert slot_headers(article_id) == {SLOT_HEADER: str(slot), f"{SLOT_HEADER}-{slot}": "1"}


def test_slot_vectors() -> None:
    """The published test vectors hold (a producer in another language checks itself against them)."""
    assert {a: slot_of(a) for a in VECTORS} == VECTORS


@given(articles, counts)
def test_every_article_in_exactly_one_partition(article_id: str, count: int) -> None:
    """The route binds the article's slot to exactly one partition queue, the one partition_of names."""
    base = Topology("catalog", binding_keys=("material.*",), exchange="x.events", prefix="x")
    headers = slot_headers(article_id)
    queues = [b.destination for b in route(base, count).bind
              if b.arguments and b.arguments.get("x-match") == "any"
              and any(b.arguments.get(h) == v for h, v in headers.items())]
    assert queues == [f"x.catalog.p{partition_of(article_id, count)}"]
    assert 0 <= partition_of(article_id, count) < count


@given(articles, st.integers(1, 16), st.integers(1, 16))
def test_doubling_the_count_splits_each_partition_in_two(article_id: str, count: int, factor: int) -> None:
    """With a count that is a multiple of the old one, an article moves only to k + i*old (a split)."""
    if count * factor > SLOT_COUNT:
        return
    assert partition_of(article_id, count * factor) % count == partition_of(article_id, count)


def test_route_switch_binds_every_slot_once_and_removes_the_old_bindings() -> None:
    """Repartitioning 4 -> 8 binds each of the 256 slots to one of 8 partitions (one binding each)
    and removes the 4 old bindings; the same count removes nothing."""
    base = Topology("catalog", binding_keys=("material.*",), exchange="x.events", prefix="x")
    r = route(base, 8, previous=4)
    partition_bindings = [b for b in r.bind if b.arguments]
    assert len(partition_bindings) == 8
    slots = sorted(key for b in partition_bindings if b.arguments for key in b.arguments if key != "x-match")
    assert slots == sorted(f"{SLOT_HEADER}-{s}" for s in range(SLOT_COUNT))
    assert [b.destination for b in r.unbind] == [f"x.catalog.p{k}" for k in range(4)]
    assert route(base, 4, previous=4).unbind == ()


def test_partition_out_of_range() -> None:
    """A partition outside 0 .. count-1, or a count outside 1 .. 256, is a ConfigError."""
    with pytest.raises(ConfigError):
        check_partition(4, 4)
    with pytest.raises(ConfigError):
        check_partition(0, SLOT_COUNT + 1)


def test_database_refuses_another_partition(tmp_path: Path) -> None:
    """A partition database records consumer, partition and count and refuses to be opened as another."""
    path = tmp_path / "p1" / "inbox.db"
    consumers.open_db(path, "catalog", create=True, partition=Identity(1, 4)).close()
    consumers.open_db(path, "catalog", create=True, partition=Identity(1, 4)).close()
    for other in (Identity(0, 4), Identity(1, 8)):
        with pytest.raises(DatabaseError, match="is partition 1 of 4 of consumer 'catalog', not partition"):
            consumers.open_db(path, "catalog", create=True, partition=other)
    with pytest.raises(DatabaseError, match="not the unpartitioned consumer"):
        consumers.open_db(path, "catalog", create=True, unpartitioned=True)
    plain = tmp_path / "plain.db"
    consumers.open_db(plain, "catalog", create=True).close()
    with pytest.raises(DatabaseError, match="is the unpartitioned 'catalog', not partition 0 of 4"):
        consumers.open_db(plain, "catalog", create=True, partition=Identity(0, 4))


def test_run_refuses_another_partition_in_one_line(tmp_path: Path) -> None:
    """run --partition on another partition's database: one line on stderr, exit 2 (before any broker call)."""
    path = tmp_path / "inbox.db"
    consumers.open_db(path, "catalog", create=True, partition=Identity(1, 4)).close()
    result = cli(["run", "--consumer", "catalog", "--partition", "0", "--db", str(path),
                  "--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2F"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is partition 1 of 4" in lines[0], result.stderr
    result = cli(["run", "--consumer", "catalog", "--partition", "5", "--db", str(path)])
    assert result.exit_code == 2 and "partition 5 does not exist among 4" in result.stderr


def test_slots_are_the_same_in_another_process() -> None:
    """The mapping does not depend on the process (no salted hash): a fresh interpreter with another
    PYTHONHASHSEED computes the same slots."""
    import json
    import os
    import subprocess
    import sys

    ids = [f"article-{i}" for i in range(200)] + ["материал-7", "42", ""]
    code = "import json,sys; from delivery_consumer.amqp.partitions import slot_of; " \
           "print(json.dumps([slot_of(a) for a in json.load(sys.stdin)]))"
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(ids), capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert json.loads(out) == [slot_of(a) for a in ids]


def test_a_partition_directory_given_as_db_reads_as_one_consumer(tmp_path: Path) -> None:
    """--db naming a directory of p<k>/inbox.db (as a deployment file may): catalog list merges the
    partitions, --partition K picks one, and a command that needs one partition says so in one line."""
    import orjson

    from delivery_consumer.inbox import apply_event
    from delivery_consumer.model.envelope import parse

    directory = tmp_path / "catalog"
    articles = [f"article-{i}" for i in range(12)]
    for k in range(3):
        with consumers.open_db(directory / f"p{k}" / "inbox.db", "catalog", create=True,
                             partition=Identity(k, 3)) as db:
            for i, article in enumerate(a for a in articles if partition_of(a, 3) == k):
                apply_event(db, parse(orjson.dumps({
                    "eventId": f"00000000-0000-4000-8000-{k:04d}{i:08d}", "type": "material.published",
                    "articleId": article, "revision": 1, "occurredAt": "2026-12-01T10:00:00Z",
                    "data": {"title": article, "url": "https://example.org/a"}})))
    listed = cli(["catalog", "list", "--db", str(directory), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = orjson.loads(listed.stdout)
    assert [r["articleId"] for r in rows] == sorted(articles)
    assert all(r["partition"] == partition_of(r["articleId"], 3) for r in rows)
    one = cli(["inbox", "stats", "--db", str(directory), "--partition", "1", "--json"])
    assert one.exit_code == 0 and orjson.loads(one.stdout)["receipts"] == sum(
        partition_of(a, 3) == 1 for a in articles)
    refused = cli(["inbox", "stats", "--db", str(directory)])
    assert refused.exit_code == 2 and "give --partition K" in refused.stderr


def test_a_partition_database_refuses_another_partitions_article(tmp_path: Path) -> None:
    """An event of an article that belongs to another partition (a producer computing another slot) is
    rejected wrong-partition, nothing of it applied; its own articles apply."""
    import orjson

    from delivery_consumer.inbox import apply_event
    from delivery_consumer.model.envelope import parse
    from delivery_consumer.model.errors import Rejection

    def event(article: str, n: int) -> bytes:
        return orjson.dumps({"eventId": f"00000000-0000-4000-8000-{n:012d}", "type": "material.published",
                             "articleId": article, "revision": 1, "occurredAt": "2026-12-01T10:00:00Z",
                             "data": {"title": article, "url": "https://example.org/a"}})

    ours = next(f"a-{i}" for i in range(100) if partition_of(f"a-{i}", 2) == 0)
    theirs = next(f"a-{i}" for i in range(100) if partition_of(f"a-{i}", 2) == 1)
    with consumers.open_db(tmp_path / "p0.db", "catalog", create=True, partition=Identity(0, 2)) as db:
        assert apply_event(db, parse(event(ours, 1))) == "updated"
        with pytest.raises(Rejection) as refused:
            apply_event(db, parse(event(theirs, 2)))
        assert refused.value.code == "wrong-partition"
        assert "belongs to partition 1 of 2" in refused.value.reason
        assert db.conn.execute("SELECT article_id FROM catalog").fetchall() == [(ours,)]
        assert db.conn.execute("SELECT code FROM rejected").fetchall() == [("wrong-partition",)]


def test_a_wrong_partition_reason_names_the_types_key_field(tmp_path: Path) -> None:
    """An order of another partition is rejected wrong-partition with a reason naming orderId, not articleId."""
    import orders_consumer
    import orjson

    from delivery_consumer.inbox import apply_event
    from delivery_consumer.model.envelope import parse
    from delivery_consumer.model.errors import Rejection

    theirs = next(f"order-{i}" for i in range(100) if partition_of(f"order-{i}", 2) == 1)
    body = orjson.dumps({"eventId": "00000000-0000-4000-8000-000000000001", "type": "order.placed",
                         "orderId": theirs, "revision": 1, "occurredAt": "2026-12-01T10:00:00Z",
                         "data": {"status": "placed", "totalCents": 1}})
    with consumers.open_db(tmp_path / "p0.db", "orders", create=True, partition=Identity(0, 2)) as db, \
            pytest.raises(Rejection) as refused:
        apply_event(db, parse(body, types=orders_consumer.TYPES))
    assert refused.value.code == "wrong-partition"
    assert refused.value.reason.startswith("orderId belongs to partition 1 of 2"), refused.value.reason
