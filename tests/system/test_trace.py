"""``trace EVENT_ID``: receipt, deliveries, rejections and the key's row, from
databases filled by ``run`` against the real broker (the lesson's samples,
through catalog and audit)."""

from __future__ import annotations

import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace

from delivery_consumer.inbox import history as trace
from delivery_consumer.model import errors

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_events"

FIRST = "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11"  # 01, 02 (same body) and 05 (event-id-reused)
WITHDRAWN = "ff5f1999-6620-44d3-a614-e22b3ac3bd8c"  # 03: article-42 revision 2
STALE = "7cd9b4f9-87c4-4ace-b40b-7f2aa00c35fe"  # 04: article-42 revision 1, late
CONFLICT = "9cafb02f-e044-4629-b890-e9daa7100938"  # 09: revision-conflict in catalog


@pytest.fixture(scope="module")
def samples_ns(amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Namespace]:
    """The samples published once and consumed by catalog and audit."""
    space = Namespace(amqp_url, f"t{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("trace"))
    try:
        published = space.cli("publish", "--consumer", "catalog", "--consumer", "audit", str(SAMPLES))
        assert 0 == published.returncode, published.stderr
        runs = [space.start_run(c, "--exit-when-idle", "1") for c in ("catalog", "audit")]
        for proc in runs:
            _out, err = proc.communicate(timeout=60)
            assert 0 == proc.returncode, err
        yield space
    finally:
        space.delete()


def traced(ns: Namespace, consumer: str, event_id: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = ns.cli("trace", "--db", str(ns.db(consumer)), event_id, "--json", *args)
    return done, (orjson.loads(done.stdout) if done.returncode == 0 else {})


def test_applied_event_has_receipt_every_delivery_and_the_other_bodys_rejection(samples_ns: Namespace) -> None:
    """The first event: receipt 'updated', three deliveries of its message id, and the
    event-id-reused copy named with its dead queue, unresolved."""
    done, shown = traced(samples_ns, "catalog", FIRST)
    assert 0 == done.returncode, done.stderr
    assert "applied" == shown["status"]
    assert "updated" == shown["receipt"]["result"]
    assert shown["receipt"]["fingerprint"]
    assert 3 == shown["deliveries"]["deliveries"]
    assert 1 == shown["deliveries"]["attempts"]
    (rejection,) = shown["rejections"]
    assert "event-id-reused" == rejection["code"]
    assert samples_ns.topology("catalog").dead_queue == rejection["deadLetter"]
    assert rejection["resolvedAt"] is None
    assert "another copy was rejected (event-id-reused), unresolved" in shown["summary"]


def test_catalog_trace_shows_the_current_row_of_the_article(samples_ns: Namespace) -> None:
    """The withdrawn revision 2 is article-42's current row: trace shows it, marked current."""
    done, shown = traced(samples_ns, "catalog", WITHDRAWN)
    assert 0 == done.returncode, done.stderr
    assert (1, 1, True) == (shown["deliveries"]["deliveries"], shown["deliveries"]["attempts"],
                            shown["deliveries"]["fromReceipt"])  # run keeps no row for a first, applied delivery
    assert ("articleId", "article-42") == (shown["key"]["field"], shown["key"]["value"])
    article = shown["key"]["row"]
    assert ("article-42", 2, False, True) == (
        article["articleId"], article["revision"], article["published"], article["currentEvent"])


def test_stale_event_shows_its_article_from_the_receipts_key(samples_ns: Namespace) -> None:
    """A stale event is not its article's current revision: trace finds the row that made it
    stale from the key its receipt holds, and says so in the text ("articleId article-42:")."""
    done, shown = traced(samples_ns, "catalog", STALE)
    assert 0 == done.returncode, done.stderr
    assert ("stale", "article-42") == (shown["receipt"]["result"], shown["receipt"]["key"])
    assert ("articleId", "article-42") == (shown["key"]["field"], shown["key"]["value"])
    assert (2, False) == (shown["key"]["row"]["revision"], shown["key"]["row"]["currentEvent"])
    text = samples_ns.cli("trace", "--db", str(samples_ns.db("catalog")), STALE)
    assert 0 == text.returncode, text.stderr
    assert re.search(r"^articleId article-42:\n  articleId: +article-42\n", text.stdout, re.M), text.stdout


def test_key_and_article_options_name_the_row_of_an_event_without_receipt(samples_ns: Namespace) -> None:
    """A rejected event has no receipt to hold its key, its rejection does: trace shows that key's row; --key
    (or its alias --article) names a key, and one nothing holds (here: a key the event does not name) says how
    to name it."""
    done, shown = traced(samples_ns, "catalog", CONFLICT)
    assert 0 == done.returncode, done.stderr
    assert ("article-7", "article-7") == (shown["key"]["value"], shown["rejections"][0]["key"])
    done, shown = traced(samples_ns, "catalog", CONFLICT, "--key", "article-0")
    assert ("article-0", None) == (shown["key"]["value"], shown["key"]["row"])
    assert "articleId article-0 is not in the catalog" == shown["key"]["note"]
    for option in ("--key", "--article"):
        done, shown = traced(samples_ns, "catalog", CONFLICT, option, "article-7")
        assert 0 == done.returncode, done.stderr
        assert ("article-7", 2, False) == (shown["key"]["value"], shown["key"]["row"]["revision"],
                                           shown["key"]["row"]["currentEvent"])


def test_rejected_event_says_why_it_stopped_and_where_the_copy_went(samples_ns: Namespace) -> None:
    """A revision-conflict: no receipt, status rejected, code, reason and dead queue in
    the summary and in the text output."""
    done, shown = traced(samples_ns, "catalog", CONFLICT)
    assert 0 == done.returncode, done.stderr
    dead_queue = samples_ns.topology("catalog").dead_queue
    assert ("rejected", None) == (shown["status"], shown["receipt"])
    assert ["revision-conflict"] == [r["code"] for r in shown["rejections"]]
    assert f"copy in {dead_queue}" in shown["summary"]
    text = samples_ns.cli("trace", "--db", str(samples_ns.db("catalog")), CONFLICT)
    assert 0 == text.returncode, text.stderr
    assert re.search(r"^status: +rejected$", text.stdout, re.M)
    assert re.search(rf"^ +copy: +{re.escape(dead_queue)}$", text.stdout, re.M)
    assert re.search(r"^ +resolved: +no$", text.stdout, re.M)


def test_audit_trace_shows_its_row_without_the_payload(samples_ns: Namespace) -> None:
    """In audit the conflicting event is simply recorded; trace shows its audit row but
    never the stored envelope."""
    done, shown = traced(samples_ns, "audit", CONFLICT)
    assert 0 == done.returncode, done.stderr
    assert "recorded" == shown["receipt"]["result"]
    (row,) = shown["effects"]["audit"]
    assert ("article-7", 2) == (row["articleId"], row["revision"])
    assert "envelope" not in row
    assert "key" not in shown  # audit's view names no key column


def test_unknown_event_id_exits_1(samples_ns: Namespace) -> None:
    """An eventId the database never saw: one line on stderr, exit 1."""
    unknown = str(uuid.uuid4())
    done = samples_ns.cli("trace", "--db", str(samples_ns.db("catalog")), unknown)
    assert 1 == done.returncode
    assert f"eventId {unknown} not found" in done.stderr
    assert "" == done.stdout


@pytest.mark.parametrize("code", errors.REJECTION_CODES)
def test_trace_counts_every_registered_code_as_a_rejection(code: str) -> None:
    """A delivery whose last outcome is any code of the registry (run's poison code, delivery-limit, among them)
    is rejected in trace's summary, even without a rejection row that names its eventId."""
    deliveries = {"lastOutcome": code, "lastAt": "2026-01-01T00:00:00.000Z", "deliveries": 1, "crashes": 0}
    status, summary = trace._status(None, [], deliveries)
    assert trace.REJECTED == status
    assert summary.startswith(f"rejected {code} at 2026-01-01T00:00:00.000Z")


def test_trace_does_not_count_a_result_as_a_rejection() -> None:
    """A last outcome that is no registered code (a crash, a result) is not summarised as a rejection."""
    deliveries = {"lastOutcome": "crashed", "lastAt": "2026-01-01T00:00:00.000Z", "deliveries": 1, "crashes": 1}
    assert trace.REJECTED != trace._status(None, [], deliveries)[0]
