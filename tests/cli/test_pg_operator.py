"""The operator's read commands on a consumer's inbox in PostgreSQL (``--db postgresql://...``): the views,
``rejected``, ``inbox list|show|stats`` and ``query``, which stays read-only (a READ ONLY transaction, one
statement, a timeout)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from support import cli, new_event

from delivery_consumer.consumers import audit, catalog
from delivery_consumer.inbox import apply_batch
from delivery_consumer.inbox.pg import PgInboxDB
from delivery_consumer.model.envelope import Envelope, from_mapping

pytestmark = pytest.mark.postgres


@pytest.fixture
def filled(pg_url: str) -> Iterator[tuple[str, list[Envelope]]]:
    """The catalog's and the audit's inboxes in one database: three articles, and a conflict in the catalog."""
    events = [from_mapping(new_event(article_id=f"a{i}", revision=2)) for i in range(3)]
    clash = from_mapping(new_event(article_id="a1", revision=2, title="clash"))
    for spec in (catalog.SPEC, audit.SPEC):
        with PgInboxDB.open(pg_url, spec, create=True) as db:
            apply_batch(db, [*events, clash])
    yield pg_url, [*events, clash]


def json_of(args: list[str]) -> object:
    result = cli([*args, "--json"])
    assert 0 == result.exit_code, result.output
    return orjson.loads(result.output)


def test_a_consumers_view_lists_and_shows_its_rows(filled: tuple[str, list[Envelope]]) -> None:
    """``catalog list|show`` read the catalog's schema; ``audit list`` is newest first (its rowid order)."""
    url, events = filled
    assert ["a0", "a1", "a2"] == [row["articleId"] for row in json_of(["catalog", "list", "--db", url])]
    shown = json_of(["catalog", "show", "a1", "--db", url])
    assert {"articleId": "a1", "revision": 2, "published": True} == {k: shown[k] for k in
                                                                       ("articleId", "revision", "published")}
    newest_first = [row["eventId"] for row in json_of(["audit", "list", "--db", url])]
    assert [e.event_id for e in reversed(events)] == newest_first
    missing = cli(["catalog", "show", "zz", "--db", url])
    assert 1 == missing.exit_code


def test_rejections_receipts_and_their_counts(filled: tuple[str, list[Envelope]]) -> None:
    """``rejected list``, ``inbox list|show|stats`` answer as on SQLite, from the consumer's schema."""
    url, events = filled
    (rejection,) = json_of(["rejected", "list", "--consumer", "catalog", "--db", url])
    assert ("revision-conflict", events[-1].event_id) == (rejection["code"], rejection["eventId"])
    receipts = json_of(["inbox", "list", "--consumer", "catalog", "--db", url])
    assert [e.event_id for e in reversed(events[:3])] == [r["eventId"] for r in receipts]
    shown = json_of(["inbox", "show", events[0].event_id, "--consumer", "audit", "--db", url])
    assert ("recorded", 1) == (shown["receipt"]["result"], shown["deliveryCount"])
    stats = json_of(["inbox", "stats", "--consumer", "catalog", "--db", url])
    assert ({"updated": 3}, {"updated": 3}, {"revision-conflict": 1}) == (
        stats["byResult"], stats["lastHour"], stats["rejectedByCode"])


@pytest.mark.parametrize(("sql", "said"), [
    ("DELETE FROM catalog", "read-only transaction"),
    ("SELECT 1; DELETE FROM catalog", "multiple commands"),
    ("SELECT nope FROM catalog", "does not exist"),
])
def test_query_reads_and_refuses_anything_else(filled: tuple[str, list[Envelope]], sql: str, said: str) -> None:
    """``query`` answers one SELECT; a write, a second statement or a bad name is refused (exit 2), and
    the catalog is left as it was."""
    url, _ = filled
    assert {"columns": ["n"], "rows": [[3]]} == json_of(
        ["query", "--consumer", "catalog", "--db", url, "SELECT count(*) AS n FROM catalog"])
    refused = cli(["query", "--consumer", "catalog", "--db", url, sql])
    assert 2 == refused.exit_code and said in refused.output
    assert {"columns": ["n"], "rows": [[3]]} == json_of(
        ["query", "--consumer", "catalog", "--db", url, "SELECT count(*) AS n FROM catalog"])


def test_query_stops_a_statement_past_its_timeout(filled: tuple[str, list[Envelope]]) -> None:
    """A statement still running after --timeout is cancelled by the server (statement_timeout): exit 2."""
    url, _ = filled
    stopped = cli(["query", "--consumer", "catalog", "--db", url, "--timeout", "200ms", "SELECT pg_sleep(5)"])
    assert 2 == stopped.exit_code and "still running after" in stopped.output


def test_a_url_needs_the_consumer_and_never_shows_its_password(filled: tuple[str, list[Envelope]]) -> None:
    """Without --consumer a URL names no inbox (exit 2); an unreachable database is named without the password."""
    url, _ = filled
    assert 2 == cli(["inbox", "list", "--db", url]).exit_code
    wrong = url.replace("postgres@", "postgres:s3cret@", 1).rsplit("/", 1)[0] + "/no_such_db"
    failed = cli(["catalog", "list", "--db", wrong])
    assert 2 == failed.exit_code and "s3cret" not in failed.output and "no_such_db" in failed.output


def test_trace_follows_an_event_through_a_postgresql_inbox(filled: tuple[str, list[Envelope]]) -> None:
    """``trace EVENT_ID`` of an applied event and of a rejected one: the receipt, the rejection, the effect's
    row and the current row of the event's key, from the consumer's schema."""
    url, events = filled
    applied = json_of(["trace", events[0].event_id, "--consumer", "catalog", "--db", url])
    assert ("applied", "updated") == (applied["status"], applied["receipt"]["result"])
    assert [events[0].event_id] == [row["eventId"] for row in applied["effects"]["catalog"]]
    assert ("articleId", "a0") == (applied["key"]["field"], applied["key"]["value"])
    refused = json_of(["trace", events[-1].event_id, "--consumer", "catalog", "--db", url])
    assert ("rejected", ["revision-conflict"]) == (refused["status"], [r["code"] for r in refused["rejections"]])
    assert "a1" == refused["key"]["value"]
    assert 1 == cli(["trace", "01938b10-0000-7000-8000-00000000dead", "--consumer", "catalog", "--db", url]).exit_code


def test_the_deployment_file_names_a_postgresql_inbox(filled: tuple[str, list[Envelope]], tmp_path: Path) -> None:
    """``db = "postgresql://..."`` for a consumer in the deployment file: its commands read that inbox, and
    ``config check`` shows the URL (not a file under the file's directory) in the run line it prints."""
    url, _ = filled
    config = tmp_path / "delivery.toml"
    config.write_text(f'[consumers.catalog]\ndb = "{url}"\n', "utf-8")
    listed = cli(["--config", str(config), "catalog", "list", "--json"])
    assert 0 == listed.exit_code, listed.output
    assert ["a0", "a1", "a2"] == [row["articleId"] for row in orjson.loads(listed.output)]
    shown = cli(["--config", str(config), "config", "check", "--json"])
    assert 0 == shown.exit_code, shown.output
    (entry,) = orjson.loads(shown.output)["consumers"]
    assert (url, f"delivery-consumer run --consumer catalog --db {url}") == (entry["db"], entry["run"])


def test_rejected_resolve_writes_to_a_postgresql_inbox(filled: tuple[str, list[Envelope]]) -> None:
    """``rejected resolve ID`` resolves a rejection recorded without a dead-letter copy, leaves one whose
    copy went to a dead queue (exit 1, naming dead requeue/purge) and names an id that is not there;
    ``--older-than 0s --dry-run`` changes nothing, then ``--older-than 0s`` resolves the rest."""
    url, _ = filled
    with PgInboxDB.open(url, catalog.SPEC) as db:
        db.conn.execute("INSERT INTO rejected (code, reason, rejected_at, dead_letter) VALUES"
                        " ('malformed-json', 'x', '2026-01-01T00:00:00.000Z', 'q.catalog.dead')")
        db.conn.execute("INSERT INTO rejected (code, reason, rejected_at) VALUES"
                        " ('malformed-json', 'y', '2026-01-01T00:00:00.000Z')")
        (first, dead, other) = [row[0] for row in db.conn.execute("SELECT id FROM rejected ORDER BY id")]
    where = ["--consumer", "catalog", "--db", url]
    done = cli(["rejected", "resolve", *where, str(first), str(dead), "999"])
    assert 1 == done.exit_code, done.output
    assert f"left {dead}: its copy went to q.catalog.dead" in done.output and "not found: 999" in done.output
    dry = json_of(["rejected", "resolve", *where, "--older-than", "0s", "--dry-run"])
    assert ([other], True) == (dry["resolved"], dry["dryRun"])
    assert [other] == json_of(["rejected", "resolve", *where, "--older-than", "0s"])["resolved"]
    unresolved = {r["id"] for r in json_of(["rejected", "list", *where]) if r["resolvedAt"] is None}
    assert {dead} == unresolved
    assert done.output.startswith("resolved 1 rejection in ") and "(schema dc_catalog)" in done.output


def test_inbox_prune_deletes_old_receipts_of_a_postgresql_inbox(filled: tuple[str, list[Envelope]]) -> None:
    """``inbox prune --db postgresql://...`` (the broker unreachable, so --without-dead-queue): the receipts
    older than --older-than go, the young stay, the unresolved rejection's receipt stays; without the flag
    it is refused and deletes nothing."""
    url, events = filled
    with PgInboxDB.open(url, catalog.SPEC) as db:
        db.conn.execute("UPDATE inbox SET received_at = '2020-01-01T00:00:00.000Z' WHERE event_id <> ?",
                        (events[2].event_id,))
    where = ["--consumer", "catalog", "--db", url, "--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2F"]
    refused = cli(["inbox", "prune", *where, "--older-than", "30d"])
    assert 2 == refused.exit_code and "--without-dead-queue" in refused.output
    forced = cli(["inbox", "prune", *where, "--older-than", "30d", "--without-dead-queue", "--json"])
    assert 0 == forced.exit_code and "dead queue not read" in forced.stderr, forced.output
    report = orjson.loads(forced.stdout)
    assert (2, 0) == (report["receipts"], report["keptUnresolved"])
    assert [events[2].event_id] == [r["eventId"] for r in json_of(["inbox", "list", "--consumer", "catalog",
                                                                    "--db", url])]
    for args in (["inbox", "prune", *where, "--older-than", "30d"], ["inbox", "list", "--consumer", "catalog",
                                                                     "--db", url]):
        refused = cli([*args, "--partition", "1"])
        assert 2 == refused.exit_code and "?schema=dc_catalog_p<K>of<N>" in refused.output, refused.output
