"""A consumer has one layout on a broker, unpartitioned or partitioned, and the manual's partition block
works as written: the refusals that keep one event from being applied twice, the hint when both layouts'
databases are on disk, and a first `run --partition K` that takes the count from the broker."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace, RunProcess
from partitionkit import Cluster, make_events, model
from support import count_rows, wait_until

from delivery_consumer import consumers
from delivery_consumer.amqp.admin import queue_counts
from delivery_consumer.amqp.partitions import Identity


@pytest.mark.broker
def test_declaring_the_other_layout_of_a_consumer_is_refused_naming_repartition(ns: Namespace) -> None:
    """`topology declare --partitions N` is refused while the consumer's unpartitioned queue exists, and
    the unpartitioned declare while its partitions exist: one line naming repartition, nothing declared;
    the declare prints as bound only the queue it bound."""
    plain = ns.cli("topology", "declare", "--consumer", "catalog")
    assert plain.returncode == 0, plain.stderr
    base = ns.topology("catalog")
    others = ", ".join(q for q, _ in base.queues() if q != base.queue)
    assert plain.stdout == (f"catalog: {ns.exchange} -[material.*]-> {base.queue}; also declared, not bound: "
                            f"{others}\n")
    refused = ns.cli("topology", "declare", "--consumer", "catalog", "--partitions", "4")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "delivery-consumer repartition --consumer catalog --partitions 4" in refused.stderr, refused.stderr
    slots = [f"{ns.prefix}.catalog.partitions", f"{ns.prefix}.catalog.p0"]
    assert set(queue_counts(ns.url, slots).values()) == {None}

    audit = Cluster(ns, "audit", 2)
    try:
        audit.declare()
        again = ns.cli("topology", "declare", "--consumer", "audit")
        assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
        assert "repartition" in again.stderr and f"{ns.prefix}.audit.partitions" in again.stderr, again.stderr
        assert queue_counts(ns.url, [f"{ns.prefix}.audit"]) == {f"{ns.prefix}.audit": None}
    finally:
        audit.delete()


@pytest.mark.broker
def test_an_unpartitioned_run_of_a_partitioned_consumer_is_refused(ns: Namespace, tmp_path: Path) -> None:
    """`run` without --partition on a consumer the broker holds partitioned would bind its own queue beside
    the partitions and apply every event twice: refused in one line naming the layout, exit 2, no queue made."""
    audit = Cluster(ns, "audit", 2)
    try:
        audit.declare()
        refused = ns.cli("run", "--consumer", "audit", "--db", str(tmp_path / "audit.db"), "--exit-when-idle", "1s")
        assert refused.returncode == 2, refused.stderr
        assert f"{ns.prefix}.audit.partitions records the count" in refused.stderr, refused.stderr
        assert "give --partitions N" in refused.stderr, refused.stderr
        assert queue_counts(ns.url, [f"{ns.prefix}.audit"]) == {f"{ns.prefix}.audit": None}
        assert not (tmp_path / "audit.db").exists()
    finally:
        audit.delete()


def test_reading_the_unpartitioned_database_beside_partition_databases_says_so(tmp_path: Path) -> None:
    """`catalog list` on the default path reads state/catalog/inbox.db; when partition databases sit
    beside it, a note on stderr says they were not read and how to read them; --db DIR reads them."""
    state = tmp_path / "state" / "catalog"
    consumers.open_db(state / "inbox.db", "catalog", create=True).close()

    def listing(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "delivery_consumer", "catalog", "list", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    alone = listing()
    assert alone.returncode == 0 and "note:" not in alone.stderr, alone.stderr
    for k in range(2):
        consumers.open_db(state / f"p{k}" / "inbox.db", "catalog", create=True, partition=Identity(k, 2)).close()
    noted = listing()
    assert noted.returncode == 0, noted.stderr
    assert noted.stderr.startswith(f"note: {Path('state/catalog')} also holds 2 partition databases "
                                   f"(p<k>/inbox.db), not read here; --db {Path('state/catalog')} reads them\n")
    both = listing("--db", "state/catalog")
    assert both.returncode == 0 and "note:" not in both.stderr, both.stderr


@pytest.mark.broker
def test_the_readmes_partition_block_works_as_written(ns: Namespace) -> None:
    """docs/partitions.md's commands in order: declare 4 partitions, the first run with
    --partitions, a standby right after it (it waits for the partition's database) and the other
    partitions without it (first start: the count from the broker), publish, then the catalog of every
    partition, trace and a partition's dead list."""
    cluster = Cluster(ns, "catalog", 4)
    events = make_events(400, 40, seed=3)
    try:
        declared = ns.cli("topology", "declare", "--consumer", "catalog", "--partitions", "4")
        assert declared.returncode == 0, declared.stderr

        def run(*args: str) -> RunProcess:
            proc = RunProcess([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "catalog", *args],
                              cwd=ns.workdir, env=ns.env())
            cluster.procs.append(proc)
            return proc

        runs = [run("--partition", "0", "--partitions", "4"), run("--partition", "0")]
        runs += [run("--partition", str(k)) for k in (1, 2, 3)]
        for proc in runs:
            wait_until("every run consuming or standing by", lambda p=proc: any(
                text in p.output()[1] for text in ("consuming ", "standby: waiting")), 60, runs)
        # Partition 0's two runs: one holds its database and consumes, the other waits for it.
        assert sorted("consuming " in p.output()[1] for p in runs[:2]) == [False, True]
        path = ns.workdir / f"events-{uuid.uuid4().hex[:6]}.ndjson"
        path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
        published = ns.cli("publish", str(path))
        assert published.returncode == 0, published.stderr
        wait_until("every receipt", lambda: sum(count_rows(cluster.db(k), "inbox") for k in range(4)) >= len(events),
                   300, runs)

        listed = ns.cli("catalog", "list", "--consumer", "catalog", "--limit", "0", "--json")
        assert listed.returncode == 0, listed.stderr
        assert {row["articleId"]: row["revision"] for row in orjson.loads(listed.stdout)} == {
            article: revision for article, (revision, _title, _published) in model(events).items()}
        traced = ns.cli("trace", events[0]["eventId"], "--consumer", "catalog")
        assert traced.returncode == 0, traced.stderr
        dead = ns.cli("dead", "list", "--consumer", "catalog", "--partition", "1")
        assert dead.returncode == 0, dead.stderr
    finally:
        cluster.stop()
        cluster.delete()


def test_a_first_partition_run_without_a_broker_to_ask_is_a_temporary_failure(tmp_path: Path) -> None:
    """`run --partition K` with no database and no broker answering cannot know the count: one line, exit 75
    (a supervisor starts it again; not the configuration error that keeps a unit down)."""
    done = subprocess.run([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "catalog",
                           "--partition", "1", "--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2F"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "the broker cannot tell the count" in done.stderr
    assert not (tmp_path / "state").exists()
