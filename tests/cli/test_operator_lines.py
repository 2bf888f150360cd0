"""What the operator's commands say, checked without a broker: the oldest
pending outbox row (quarantined rows aside), rejections resolved by hand,
counts written with the right plural, ``outbox list`` in the order its help
gives."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import orjson
from deploykit import write_deployment
from support import cli


def with_config(config: Path, *args: str) -> tuple[int, str, str]:
    result = cli(["--config", str(config), *args])
    return result.exit_code, result.stdout, result.stderr


def _produce(config: Path, article: str) -> str:
    code, out, err = with_config(config, "produce", "--article", article, "--title", "T", "--url", "https://x/1",
                                 "--json")
    assert 0 == code, err
    return str(orjson.loads(out)["eventId"])


def test_a_quarantined_row_is_not_the_oldest_pending_one(tmp_path: Path) -> None:
    """An old quarantined row beside a fresh pending one: status names the quarantined row as such and does
    not ask whether dispatch runs; the stats and the metric give the pending row's age, not the quarantined one's."""
    from prometheus_client import generate_latest

    from delivery_consumer.outbox.metrics import registry

    config = write_deployment(tmp_path, consumers=("catalog",), extra='[status]\noutbox_max_age = "1h"')
    old = _produce(config, "a-1")
    _produce(config, "a-2")
    with sqlite3.connect(tmp_path / "producer.db") as conn:
        conn.execute("UPDATE outbox SET status = 'quarantined', quarantined_at = '2026-01-01T08:00:00.000Z',"
                     " created_at = '2026-01-01T07:00:00.000Z', quarantine_reason = 'returned: unroutable'"
                     " WHERE event_id = ?", (old,))
    code, out, _err = with_config(config, "status", "--offline", "--json")
    shown = orjson.loads(out)
    assert 1 == code and ["producer material: 1 quarantined outbox row"] == shown["problems"]
    producer = shown["producers"][0]
    assert producer["oldestPendingAgeSeconds"] < 3600 and producer["oldestQuarantinedAt"].startswith("2026-01-01T08")
    page = generate_latest(registry(tmp_path / "producer.db")).decode()
    age = re.search(r"^outbox_oldest_pending_age_seconds (\S+)$", page, re.M)
    assert age is not None and float(age.group(1)) < 3600, page
    assert "outbox_oldest_unpublished_age_seconds" not in page


def test_a_dispatcher_waiting_for_confirms_says_so_once_and_says_when_they_came(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Confirms that do not come (a blackholed broker): one warning once the bound has passed, none
    repeated while it lasts, and one line when the answer comes."""
    import logging
    import threading
    from contextlib import closing

    from outboxkit import Clock, FakePublisher, add, dispatcher, envelope

    from delivery_consumer import outbox
    from delivery_consumer.outbox import dispatcher as dispatch_module

    monkeypatch.setattr(dispatch_module, "STALL_LOG_S", 0.05)
    lines: list[str] = []
    warned, release = threading.Event(), threading.Event()
    marked: list[int] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            if "no answer from the broker" in record.getMessage():
                warned.set()

    class Stalled(FakePublisher):
        def collect(self, ticket: Any) -> Any:
            assert release.wait(60), "the test never released the confirms"
            return super().collect(ticket)

    handler = Lines()
    logger = logging.getLogger("delivery_consumer.dispatch")
    logger.addHandler(handler)
    try:
        def dispatch_one() -> None:  # its own thread: the test watches the log meanwhile
            with closing(outbox.connect(tmp_path / "producer.db")) as conn:
                add(conn, envelope("a-1"))
                marked.append(dispatcher(conn, Stalled(), Clock()).step())

        stepping = threading.Thread(target=dispatch_one)
        stepping.start()
        assert warned.wait(60), lines
        release.set()
        stepping.join()
    finally:
        logger.removeHandler(handler)
    assert [1] == marked
    stalls = [line for line in lines if "broker" in line]
    assert 2 == len(stalls), lines
    assert "the confirms of a batch of 1: no answer from the broker" in stalls[0]
    assert "the confirms of a batch of 1: the broker's answer came after" in stalls[1]


def test_run_against_a_refused_port_prints_the_error_alone(tmp_path: Path) -> None:
    """``run --exit-when-idle`` that never reached the broker: exit 2 with the broker's error, and no
    "exiting: 0 deliveries acked" line before it."""
    import subprocess
    import sys

    from support import subprocess_env

    done = subprocess.run([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "catalog", "--db",
                           str(tmp_path / "inbox.db"), "--amqp-url", "amqp://guest:guest@127.0.0.1:9/%2F",
                           "--exit-when-idle", "1s"], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert 2 == done.returncode, done.stderr
    assert "exiting:" not in done.stderr and "deliveries acked" not in done.stderr, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("delivery-consumer: the broker could not be reached in 1s: broker unreachable"), last
    assert last.endswith("Connection refused"), last


def test_counts_are_singular_for_one_and_plural_otherwise() -> None:
    """plural.count, the CLI's one helper: "1 dead letter", "2 dead letters", "0 batches", "1 batch"."""
    from hypothesis import given
    from hypothesis import strategies as st

    from delivery_consumer.model.plural import count

    @given(st.integers(min_value=0, max_value=10**9), st.sampled_from(["dead letter", "row", "rejection"]))
    def law(n: int, noun: str) -> None:
        assert count(n, noun) == f"{n} {noun}" + ("" if n == 1 else "s")

    law()
    assert ("1 batch", "3 batches", "1 delivery", "0 deliveries") == (
        count(1, "batch", "batches"), count(3, "batch", "batches"), count(1, "delivery", "deliveries"),
        count(0, "delivery", "deliveries"))


def test_a_dispatch_of_one_row_says_one_batch(tmp_path: Path) -> None:
    """The dispatcher's exit line after one batch and no outage: "1 published in 1 batch", "0 broker outages"."""
    from contextlib import closing

    from outboxkit import Clock, FakePublisher, add, dispatcher, envelope

    from delivery_consumer import outbox

    with closing(outbox.connect(tmp_path / "producer.db")) as conn:
        add(conn, envelope("a-1"))
        d = dispatcher(conn, FakePublisher(), Clock())
        assert 1 == d.step()
    assert "1 published in 1 batch, 0 failed, 0 quarantined; 0 broker outages;" in d.stats.line()


def test_query_of_a_gigabyte_blob_ends_at_once_with_one_line(tmp_path: Path) -> None:
    """``query --timeout 5s "SELECT randomblob(1000000000)"``: exit 2 with one line naming the size limit."""
    from delivery_consumer import consumers

    consumers.open_db(tmp_path / "inbox.db", "catalog", create=True).close()
    result = cli(["query", "--db", str(tmp_path / "inbox.db"), "--timeout", "5s", "SELECT randomblob(1000000000)"])
    assert 2 == result.exit_code
    assert ["delivery-consumer: query stopped: it makes a value over 32 MB (the most a query may show)"] == \
        result.stderr.splitlines()


def test_outbox_list_orders_rows_as_its_help_says(tmp_path: Path) -> None:
    """Waiting rows oldest first (the order they go out); dropped, published and all newest first --
    and the help says exactly that."""
    config = write_deployment(tmp_path, consumers=("catalog",))
    ids = [_produce(config, f"a-{i}") for i in range(4)]
    with sqlite3.connect(tmp_path / "producer.db") as conn:  # only a quarantined row may be dropped
        conn.execute("UPDATE outbox SET status = 'quarantined', quarantined_at = created_at,"
                     " quarantine_reason = 'test' WHERE event_id IN (?, ?)", (ids[0], ids[1]))
    code, _out, err = with_config(config, "outbox", "drop", ids[0], ids[1], "--reason", "test")
    assert 0 == code, err

    def listed(state: str) -> list[str]:
        code, out, err = with_config(config, "outbox", "list", "--state", state, "--json")
        assert 0 == code, err
        return [row["eventId"] for row in orjson.loads(out)]

    assert [ids[2], ids[3]] == listed("pending") == listed("due")
    assert [ids[1], ids[0]] == listed("dropped")
    assert [ids[3], ids[2], ids[1], ids[0]] == listed("all")
    code, out, _err = with_config(config, "outbox", "list", "--help")
    assert "oldest first, the order they go out; published, dropped and all newest first" in " ".join(out.split())


def test_a_replayed_rejection_can_be_resolved_and_status_turns_green(tmp_path: Path) -> None:
    """replay records a rejection with no dead-letter copy: status --offline stays red until
    ``rejected resolve ID``; a rejection whose copy went to a dead queue is left (exit 1, naming
    dead requeue/purge), and --older-than 0s resolves the rest."""
    config = write_deployment(tmp_path, consumers=("catalog",))
    source = tmp_path / "events.ndjson"
    source.write_text("{not json\n[]\n", encoding="utf-8")
    code, out, err = with_config(config, "replay", "--consumer", "catalog", str(source))
    assert 1 == code and "2 events: 2 rejected" in out, (out, err)
    code, out, _err = with_config(config, "status", "--offline", "--json")
    assert 1 == code and "2 unresolved rejections" in orjson.loads(out)["problems"][0]
    code, out, _err = with_config(config, "rejected", "list", "--consumer", "catalog", "--json")
    first, second = sorted(row["id"] for row in orjson.loads(out))
    db = tmp_path / "state" / "catalog" / "inbox.db"
    with sqlite3.connect(db) as conn:  # as run records one whose copy was dead-lettered
        conn.execute("INSERT INTO rejected (code, reason, rejected_at, dead_letter) VALUES"
                     " ('malformed-json', 'x', '2026-01-01T00:00:00.000Z', 'q.catalog.dead')")
        (dead,) = conn.execute("SELECT max(id) FROM rejected").fetchone()

    code, out, err = with_config(config, "rejected", "resolve", "--consumer", "catalog", str(first), str(dead))
    assert 1 == code and f"left {dead}: its copy went to q.catalog.dead: dead requeue or dead purge" in out, out
    assert out.startswith("resolved 1 rejection in ") and "1 rejection not resolved" in err, (out, err)
    code, out, _err = with_config(config, "status", "--offline", "--json")
    assert 1 == code and "2 unresolved rejections" in orjson.loads(out)["problems"][0]  # second, and dead

    code, out, _err = with_config(config, "rejected", "resolve", "--consumer", "catalog", "--older-than", "0s")
    assert 0 == code and out.startswith(f"resolved 1 rejection in {db}: {second}"), out
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE rejected SET resolved_at = rejected_at WHERE id = ?", (dead,))  # as dead purge would
    code, out, _err = with_config(config, "status", "--offline")
    assert 0 == code and out.rstrip().endswith("healthy"), out
