"""The read-only inspect commands, through the real CLI on real SQLite files.

Databases are filled by the real ``replay`` command with the lesson's
sequence (published, duplicate, withdrawn, stale, eventId reused) plus a
revision conflict and a body that is not JSON.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner, Result

from delivery_consumer import consumers
from delivery_consumer.cli import COMMANDS, main
from delivery_consumer.cli.inbox import INBOX_COMMANDS
from delivery_consumer.inbox import ConsumerDB, apply_event
from delivery_consumer.inbox import reports as queries
from delivery_consumer.model.envelope import from_mapping

A = "0b1e9c1e-4a53-4f0e-9d2a-6f1f3f7b2c11"  # published r1, then reused with another title
B = "1a2b3c4d-0000-4000-8000-000000000002"  # withdrawn r2
C = "1a2b3c4d-0000-4000-8000-000000000003"  # published r1 again: stale
D = "1a2b3c4d-0000-4000-8000-000000000004"  # article-7 r1
E = "1a2b3c4d-0000-4000-8000-000000000005"  # article-7 r1 with another title: revision-conflict
TITLE = "Доставка без потерь"
URL = "https://example.org/a/42"


def event(
    event_id: str,
    *,
    type: str = "material.published",
    article: str = "article-42",
    revision: int = 1,
    title: str = TITLE,
) -> dict[str, Any]:
    """One envelope as a dict."""
    return {
        "eventId": event_id,
        "type": type,
        "articleId": article,
        "revision": revision,
        "occurredAt": "2026-11-29T10:00:00Z",
        "data": {"title": title, "url": URL},
    }


SEQUENCE = [
    event(A),
    event(A),
    event(B, type="material.withdrawn", revision=2),
    event(C),
    event(A, title="Другой заголовок"),
    event(D, article="article-7", title="Seven"),
    event(E, article="article-7", title="Not seven"),
]


def invoke(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    """Run ``delivery-consumer ARGS`` in-process; stdout and stderr apart."""
    return CliRunner(env=env).invoke(main, [str(a) for a in args])


def one_line_error(result: Result, exit_code: int, fragment: str) -> str:
    """Assert a clean failure: the exit code, nothing on stdout, one line on stderr."""
    assert result.exit_code == exit_code, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # no stray exception
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("delivery-consumer: ")
    assert fragment in lines[0]
    assert "Traceback" not in result.output
    return lines[0]


def columns(line: str) -> list[str]:
    """The cells of one line of an aligned table (columns are 2+ spaces apart)."""
    return re.split(r"\s{2,}", line.strip())


def listed(command: str, db: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """``COMMAND list --db DB``: its text lines (exit 0 asserted) and its ``--json`` rows."""
    text = invoke(command, "list", "--db", db)
    assert text.exit_code == 0, text.output
    return text.stdout.splitlines(), orjson.loads(invoke(command, "list", "--db", db, "--json").stdout)


def replay_into(path: Path, consumer: str, tmp_path: Path) -> Path:
    """Fill *path* with SEQUENCE (and one non-JSON line) through ``replay``."""
    source = tmp_path / f"{consumer}.ndjson"
    source.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in SEQUENCE) + b"not json\n")
    result = invoke("replay", "--consumer", consumer, "--db", path, source)
    assert result.exit_code == 1, result.output  # something was rejected, as intended
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No DELIVERY_* settings leak in; default paths resolve under tmp_path."""
    for name in ("DELIVERY_DB", "DELIVERY_CONSUMER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def catalog_db(tmp_path: Path) -> Path:
    """A catalog database after the lesson's sequence."""
    return replay_into(tmp_path / "catalog.db", "catalog", tmp_path)


@pytest.fixture
def audit_db(tmp_path: Path) -> Path:
    """An audit database after the lesson's sequence."""
    return replay_into(tmp_path / "audit.db", "audit", tmp_path)


# -- inbox ---------------------------------------------------------------------


def test_inbox_list_text_shows_aligned_receipts(catalog_db: Path) -> None:
    """inbox list prints a header, a rule and one aligned row per receipt."""
    result = invoke("inbox", "list", "--db", catalog_db)

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert columns(lines[0]) == ["receivedAt", "eventId", "type", "result"]
    rows = {columns(line)[1]: columns(line)[2:] for line in lines[2:]}
    assert rows == {
        A: ["material.published", "updated"],
        B: ["material.withdrawn", "updated"],
        C: ["material.published", "stale"],
        D: ["material.published", "updated"],
    }
    assert {line.index(columns(line)[1]) for line in lines[2:]} == {lines[0].index("eventId")}  # aligned


def test_inbox_list_json_is_an_array_newest_first(catalog_db: Path) -> None:
    """inbox list --json prints one array of receipts, newest first."""
    result = invoke("inbox", "list", "--db", catalog_db, "--json")

    assert result.exit_code == 0, result.output
    receipts = orjson.loads(result.stdout)
    assert {r["eventId"]: r["result"] for r in receipts} == {A: "updated", B: "updated", C: "stale", D: "updated"}
    assert [A, B, C, D][::-1] == [r["eventId"] for r in receipts]  # the reverse of the order received
    stamps = [r["receivedAt"] for r in receipts]
    assert stamps == sorted(stamps, reverse=True)
    assert set(receipts[0]) == {"eventId", "type", "result", "receivedAt", "fingerprint"}


def test_inbox_list_filters_by_result_and_limits(catalog_db: Path) -> None:
    """--result keeps one result; --limit caps the rows; --limit 0 lists all."""
    stale = orjson.loads(invoke("inbox", "list", "--db", catalog_db, "--result", "stale", "--json").stdout)
    one = orjson.loads(invoke("inbox", "list", "--db", catalog_db, "--limit", "1", "--json").stdout)
    every = orjson.loads(invoke("inbox", "list", "--db", catalog_db, "--limit", "0", "--json").stdout)

    assert [r["eventId"] for r in stale] == [C]
    assert len(one) == 1
    assert len(every) == 4


def test_inbox_list_of_an_empty_inbox_says_so_on_stderr(tmp_path: Path) -> None:
    """An empty inbox prints the header on stdout and '(no receipts)' on stderr, exit 0."""
    consumers.open_db(tmp_path / "empty.db", "catalog", create=True).close()
    result = invoke("inbox", "list", "--db", tmp_path / "empty.db")

    assert (result.exit_code, result.stderr) == (0, "(no receipts)\n")
    assert len(result.stdout.splitlines()) == 2


def test_inbox_show_text_gives_receipt_and_rejections(catalog_db: Path) -> None:
    """inbox show prints key: value lines for the receipt and each rejection of the eventId."""
    result = invoke("inbox", "show", A, "--db", catalog_db)

    assert result.exit_code == 0, result.output
    fields = dict(re.match(r"(\S+):\s+(.*)", line).groups() for line in result.stdout.splitlines()[:7])  # type: ignore[union-attr]
    assert fields["eventId"] == A
    assert fields["result"] == "updated"
    assert fields["type"] == "material.published"
    assert fields["rejected"] == "1"
    assert fields["deliveries"] == "1 (the applying one known from the receipt)"  # as trace counts them
    assert re.search(r"^rejection \d+:$", result.stdout, re.M)
    assert re.search(r"^  code:\s+event-id-reused$", result.stdout, re.M)
    assert re.search(r"^  source:\s+.*catalog\.ndjson:5$", result.stdout, re.M)


def test_inbox_show_json_is_an_object(catalog_db: Path) -> None:
    """inbox show --json gives the receipt, the rejections and the deliveries of the eventId."""
    shown = orjson.loads(invoke("inbox", "show", A, "--db", catalog_db, "--json").stdout)

    assert shown["eventId"] == A
    assert shown["receipt"]["result"] == "updated"
    assert shown["receipt"]["fingerprint"] == from_mapping(event(A)).fingerprint
    assert [r["code"] for r in shown["rejected"]] == ["event-id-reused"]
    assert shown["deliveries"] == []


def test_inbox_show_of_a_rejected_only_event(catalog_db: Path) -> None:
    """An eventId that was only rejected is shown with no receipt, exit 0."""
    result = invoke("inbox", "show", E, "--db", catalog_db)
    shown = orjson.loads(invoke("inbox", "show", E, "--db", catalog_db, "--json").stdout)

    assert result.exit_code == 0, result.output
    assert "result:      (no receipt: never applied)" in result.stdout
    assert shown["receipt"] is None
    assert [r["code"] for r in shown["rejected"]] == ["revision-conflict"]


def test_inbox_show_of_an_unknown_event_exits_1(catalog_db: Path) -> None:
    """inbox show of an unknown eventId: exit 1 with one 'not found' line."""
    unknown = "00000000-0000-4000-8000-000000000000"
    line = one_line_error(invoke("inbox", "show", unknown, "--db", catalog_db), 1, "not found")
    assert unknown in line
    line = one_line_error(invoke("inbox", "show", "no-such-event", "--db", catalog_db), 2, "not a UUID")
    assert "no-such-event" in line


def test_inbox_stats_json(catalog_db: Path) -> None:
    """inbox stats --json counts by result, overall and recently, and rejections by code."""
    result = invoke("inbox", "stats", "--db", catalog_db, "--json")

    assert result.exit_code == 0, result.output
    stats = orjson.loads(result.stdout)
    assert stats["consumer"] == "catalog"
    assert stats["receipts"] == 4
    assert stats["byResult"] == {"stale": 1, "updated": 3}
    assert stats["lastHour"] == {"stale": 1, "updated": 3}  # just replayed
    assert stats["lastDay"] == {"stale": 1, "updated": 3}
    assert 0 <= stats["oldestAgeSeconds"] < 600
    assert stats["oldestReceivedAt"] <= stats["newestReceivedAt"]
    assert stats["rejectedByCode"] == {"event-id-reused": 1, "malformed-json": 1, "revision-conflict": 1}


def test_inbox_stats_text(catalog_db: Path) -> None:
    """inbox stats prints key: value lines, then tables by result and by rejection code."""
    result = invoke("inbox", "stats", "--db", catalog_db)

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "consumer: catalog" in lines
    assert "receipts: 4" in lines
    assert "rejected: 3" in lines
    assert re.search(r"^oldest:\s+\S+Z \(\d+s ago\)$", result.stdout, re.M)
    tables = [columns(line) for line in lines if line and ":" not in line and not line.startswith("-")]
    assert ["result", "total", "last hour", "last day"] in tables
    assert ["updated", "3", "3", "3"] in tables
    assert ["stale", "1", "1", "1"] in tables
    assert ["revision-conflict", "1", "1"] in tables


def test_inbox_group_lists_its_lazy_subcommands() -> None:
    """`inbox --help` lists every subcommand of INBOX_COMMANDS (one line adds a new one)."""
    result = invoke("inbox", "--help")

    assert result.exit_code == 0, result.output
    assert sorted(INBOX_COMMANDS) == ["list", "prune", "recover", "show", "stats"]
    for name in INBOX_COMMANDS:
        assert re.search(rf"^\s+{name}\s+\S", result.stdout, re.M), name


# -- catalog and audit -----------------------------------------------------------


def test_catalog_list_text_and_json(catalog_db: Path) -> None:
    """catalog list shows each material's latest revision, in text and as a JSON array."""
    lines, rows = listed("catalog", catalog_db)

    assert columns(lines[0]) == ["articleId", "revision", "published", "title", "url"]
    assert [columns(line) for line in lines[2:]] == [
        ["article-42", "2", "no", TITLE, URL],
        ["article-7", "1", "yes", "Seven", URL],
    ]
    assert [(r["articleId"], r["revision"], r["published"], r["eventId"]) for r in rows] == [
        ("article-42", 2, False, B),
        ("article-7", 1, True, D),
    ]


def test_catalog_show_text_and_json(catalog_db: Path) -> None:
    """catalog show prints key: value lines, or one JSON object."""
    text = invoke("catalog", "show", "article-42", "--db", catalog_db)
    shown = orjson.loads(invoke("catalog", "show", "article-42", "--db", catalog_db, "--json").stdout)

    assert text.exit_code == 0, text.output
    assert "published:  no" in text.stdout.splitlines()
    assert f"title:      {TITLE}" in text.stdout.splitlines()
    assert shown == {
        "articleId": "article-42",
        "revision": 2,
        "published": False,
        "title": TITLE,
        "url": URL,
        "eventId": B,
        "occurredAt": "2026-11-29T10:00:00Z",
    }


def test_catalog_show_of_an_unknown_article_exits_1(catalog_db: Path) -> None:
    """catalog show of an unknown articleId: exit 1 with one 'not found' line."""
    one_line_error(invoke("catalog", "show", "article-0", "--db", catalog_db), 1, "articleId article-0 not found")


def test_catalog_uses_the_default_catalog_database(tmp_path: Path) -> None:
    """Without --db or --consumer, catalog reads state/catalog/inbox.db."""
    replay_into(tmp_path / "state" / "catalog" / "inbox.db", "catalog", tmp_path)
    result = invoke("catalog", "list", "--json")

    assert result.exit_code == 0, result.output
    assert [r["articleId"] for r in orjson.loads(result.stdout)] == ["article-42", "article-7"]


def test_audit_list_text_and_json(audit_db: Path) -> None:
    """audit list shows each distinct envelope once, newest first; --json includes the envelope."""
    lines, rows = listed("audit", audit_db)

    assert columns(lines[0]) == ["eventId", "type", "articleId", "revision", "occurredAt"]
    assert [columns(line)[0] for line in lines[2:]] == [E, D, C, B, A]
    assert [r["eventId"] for r in rows] == [E, D, C, B, A]
    assert rows[-1]["envelope"] == event(A)


def test_audit_list_limit(audit_db: Path) -> None:
    """audit list --limit N gives the N newest envelopes."""
    rows = orjson.loads(invoke("audit", "list", "--db", audit_db, "--limit", "2", "--json").stdout)
    assert [r["eventId"] for r in rows] == [E, D]


# -- rejected ------------------------------------------------------------------


def test_rejected_list_text_and_json(catalog_db: Path) -> None:
    """rejected list shows every rejection, newest first, in text and JSON."""
    lines, rows = listed("rejected", catalog_db)

    assert columns(lines[0]) == ["id", "rejectedAt", "code", "eventId", "source", "reason"]
    assert [columns(line)[2:4] for line in lines[2:]] == [
        ["malformed-json", "-"],
        ["revision-conflict", E],
        ["event-id-reused", A],
    ]
    assert [(r["code"], r["eventId"], r["source"].rsplit(":", 1)[1]) for r in rows] == [
        ("malformed-json", None, "8"),
        ("revision-conflict", E, "7"),
        ("event-id-reused", A, "5"),
    ]


def test_rejected_list_filters_by_code_and_limits(catalog_db: Path) -> None:
    """--code keeps one rejection code; --limit caps the rows."""
    reused = orjson.loads(invoke("rejected", "list", "--db", catalog_db, "--code", "event-id-reused", "--json").stdout)
    one = orjson.loads(invoke("rejected", "list", "--db", catalog_db, "-n", "1", "--json").stdout)

    assert [(r["code"], r["eventId"]) for r in reused] == [("event-id-reused", A)]
    assert [r["code"] for r in one] == ["malformed-json"]


# -- query ---------------------------------------------------------------------


def test_query_text_and_json(catalog_db: Path) -> None:
    """query prints an aligned table (NULL for nulls), or {"columns", "rows"} with --json."""
    sql = "SELECT article_id, revision, NULL AS missing FROM catalog ORDER BY article_id"
    text = invoke("query", sql, "--db", catalog_db)
    data = orjson.loads(invoke("query", sql, "--db", catalog_db, "--json").stdout)

    assert text.exit_code == 0, text.output
    assert [columns(line) for line in text.stdout.splitlines()] == [
        ["article_id", "revision", "missing"],
        ["----------", "--------", "-------"],
        ["article-42", "2", "NULL"],
        ["article-7", "1", "NULL"],
    ]
    assert data == {
        "columns": ["article_id", "revision", "missing"],
        "rows": [["article-42", 2, None], ["article-7", 1, None]],
    }


@pytest.mark.parametrize(
    ("sql", "fragment"),
    [
        ("INSERT INTO meta (key, value) VALUES ('k', 'v')", "may only read"),
        ("DELETE FROM inbox", "may only read"),
        ("UPDATE catalog SET title = 'x'", "may only read"),
        ("DROP TABLE rejected", "may only read"),
        ("ATTACH 'other.db' AS other", "ATTACH"),
        ("VACUUM INTO 'copy.db'", "ATTACH"),
        ("PRAGMA user_version = 9", "PRAGMA user_version"),
        ("PRAGMA query_only = OFF", "PRAGMA query_only"),
        ("PRAGMA journal_mode = DELETE", "PRAGMA journal_mode"),
        ("PRAGMA wal_checkpoint(TRUNCATE)", "PRAGMA wal_checkpoint"),
        ("PRAGMA optimize", "PRAGMA optimize"),
        ("BEGIN IMMEDIATE", "BEGIN"),
        ("SELECT 1; DELETE FROM inbox", "exactly one SQL statement"),
        ("SELECT * FROM no_such_table", "no such table"),
        ("SELEC 1", "syntax error"),
        ("", "empty"),
    ],
)
def test_query_refuses_writes_and_bad_sql(catalog_db: Path, tmp_path: Path, sql: str, fragment: str) -> None:
    """query refuses writes, ATTACH, setting pragmas, transactions, several statements and bad SQL: exit 2."""
    before = db_state(catalog_db)
    one_line_error(invoke("query", sql, "--db", catalog_db), 2, fragment)
    assert db_state(catalog_db) == before
    assert not (tmp_path / "copy.db").exists()
    assert not (tmp_path / "other.db").exists()


def test_an_endless_query_ends_with_one_line_and_exit_2(catalog_db: Path) -> None:
    """The real command stops an endless recursive CTE at --timeout: exit 2, one line on stderr, nothing on
    stdout (the subprocess's own timeout is only a safety net; how fast it stops is not asserted)."""
    script = Path(sys.executable).with_name("delivery-consumer")
    endless = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT x FROM n"
    result = subprocess.run([str(script), "query", "--db", str(catalog_db), "--timeout", "1s", endless],
                            capture_output=True, text=True, timeout=120)

    assert 2 == result.returncode
    assert "" == result.stdout
    assert ["delivery-consumer: query stopped: still running after 1s (give a longer --timeout if it is meant "
            "to take that long)"] == result.stderr.splitlines()


def test_a_bad_query_timeout_is_refused() -> None:
    """--timeout takes a positive duration."""
    for bad in ("0", "soon"):
        result = invoke("query", "SELECT 1", "--db", "x.db", "--timeout", bad)
        assert 2 == result.exit_code
        assert "--timeout" in result.stderr


# -- errors --------------------------------------------------------------------

READ_COMMANDS: list[list[str]] = [
    ["inbox", "list"],
    ["inbox", "show", A],
    ["inbox", "stats"],
    ["catalog", "list"],
    ["catalog", "show", "article-42"],
    ["audit", "list"],
    ["rejected", "list"],
    ["query", "SELECT count(*) FROM inbox"],
]
IDS = [" ".join(c[:2]) for c in READ_COMMANDS]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=IDS)
def test_missing_database_is_one_line_exit_2(command: list[str], tmp_path: Path) -> None:
    """A database file that does not exist: one line naming it, exit 2, and no file is created."""
    one_line_error(invoke(*command, "--db", tmp_path / "nope.db"), 2, "nope.db: no such database")
    assert not (tmp_path / "nope.db").exists()


@pytest.mark.parametrize("command", [*READ_COMMANDS, ["init"], ["replay", "-"]], ids=[*IDS, "init", "replay"])
def test_a_producers_database_is_one_line_exit_2(command: list[str], tmp_path: Path) -> None:
    """A consumer command given a producer's database (it holds an outbox): one line naming the file
    and what it is, exit 2, and the file is left as it was."""
    producer_db = tmp_path / "producer.db"
    produced = invoke("produce", "--db", producer_db, "--article", "a", "--title", "T", "--url", "https://x.test/a")
    assert 0 == produced.exit_code, produced.output
    before = producer_db.read_bytes()
    one_line_error(invoke(*command, "--db", producer_db), 2,
                   f"{producer_db}: this is a producer's database (it holds an outbox), not a consumer's inbox")
    assert before == producer_db.read_bytes()


@pytest.mark.parametrize("command", READ_COMMANDS, ids=IDS)
def test_corrupt_file_is_one_line_exit_2(command: list[str], tmp_path: Path) -> None:
    """A file that is not SQLite: one line, exit 2."""
    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(8192))
    one_line_error(invoke(*command, "--db", junk), 2, "junk.db")


@pytest.mark.parametrize("command", READ_COMMANDS, ids=IDS)
def test_directory_path_is_one_line_exit_2(command: list[str], tmp_path: Path) -> None:
    """A directory given as --db: one line saying so, exit 2."""
    (tmp_path / "adir").mkdir()
    one_line_error(invoke(*command, "--db", tmp_path / "adir"), 2, "is a directory")


@pytest.mark.parametrize("command", READ_COMMANDS, ids=IDS)
def test_no_database_given_is_one_line_exit_2(command: list[str]) -> None:
    """Neither --db nor --consumer (and no default that exists): one line, exit 2."""
    one_line_error(invoke(*command), 2, "")


@pytest.mark.parametrize(
    ("command", "fragment"),
    [
        (["catalog", "list"], "belongs to consumer 'audit', not 'catalog'"),
        (["catalog", "show", "article-42"], "belongs to consumer 'audit', not 'catalog'"),
        (["inbox", "list", "--consumer", "catalog"], "belongs to consumer 'audit', not 'catalog'"),
        (["catalog", "list", "--consumer", "audit"], "consumer 'audit' has no catalog table"),
    ],
)
def test_database_of_another_consumer_is_one_line_exit_2(audit_db: Path, command: list[str], fragment: str) -> None:
    """A database of another consumer is refused with one line, exit 2."""
    one_line_error(invoke(*command, "--db", audit_db), 2, fragment)


def test_audit_list_of_a_catalog_database_is_refused(catalog_db: Path) -> None:
    """audit list --db <catalog db>: one line, exit 2."""
    one_line_error(invoke("audit", "list", "--db", catalog_db), 2, "belongs to consumer 'catalog', not 'audit'")


def test_unknown_consumer_is_one_line_exit_2() -> None:
    """An unknown --consumer name: one line, exit 2."""
    one_line_error(invoke("inbox", "list", "--consumer", "nobody"), 2, "nobody")


def test_environment_variables_choose_the_database(catalog_db: Path, tmp_path: Path) -> None:
    """DELIVERY_DB and DELIVERY_CONSUMER stand for --db and --consumer."""
    by_db = invoke("inbox", "stats", "--json", env={"DELIVERY_DB": str(catalog_db)})
    replay_into(tmp_path / "state" / "audit" / "inbox.db", "audit", tmp_path)
    by_consumer = invoke("inbox", "stats", "--json", env={"DELIVERY_CONSUMER": "audit"})

    assert orjson.loads(by_db.stdout)["consumer"] == "catalog"
    assert orjson.loads(by_consumer.stdout)["consumer"] == "audit"


# -- read-only -----------------------------------------------------------------


def db_state(path: Path) -> dict[str, tuple[str, int]]:
    """SHA-256 and mtime of the database file, and of its WAL when that holds frames.

    An empty WAL is no change: SQLite creates empty -wal and -shm files when a
    read-only connection opens a WAL database that has none
    (https://sqlite.org/wal.html#readonly) and only a writer removes them.
    """
    state = {}
    for file in (path, path.with_name(path.name + "-wal")):
        if file.exists() and (file == path or file.stat().st_size > 0):
            state[file.name] = (hashlib.sha256(file.read_bytes()).hexdigest(), file.stat().st_mtime_ns)
    return state


ALL_RUNS = [[*c, *j] for c in READ_COMMANDS for j in ([], ["--json"])]


def test_commands_never_modify_the_database(catalog_db: Path, audit_db: Path) -> None:
    """Every inspect command, text and JSON, leaves the database file's bytes and mtime unchanged."""
    before = {p: db_state(p) for p in (catalog_db, audit_db)}
    for args in ALL_RUNS:
        path = audit_db if args[0] == "audit" else catalog_db
        result = invoke(*args, "--db", path)
        assert result.exit_code == 0, (args, result.output)
    assert {p: db_state(p) for p in (catalog_db, audit_db)} == before


def test_commands_do_not_touch_a_live_wal(catalog_db: Path) -> None:
    """With a writer's uncheckpointed WAL present, inspecting changes neither the database nor the WAL."""
    writer = consumers.open_db(catalog_db, "catalog")
    try:
        apply_event(writer, from_mapping(event("1a2b3c4d-0000-4000-8000-000000000009", article="wal")))
        before = db_state(catalog_db)
        assert f"{catalog_db.name}-wal" in before
        for args in ALL_RUNS:
            if args[0] != "audit":
                assert invoke(*args, "--db", catalog_db).exit_code == 0, args
        assert db_state(catalog_db) == before
    finally:
        writer.close()


def test_a_writer_commits_while_an_inspect_is_running(catalog_db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While an inspect command has the database open, a writer commits and checkpoints without waiting."""
    seen: list[tuple[int, int, int]] = []
    real = queries.inbox_list

    def inbox_list_then_write(db: ConsumerDB, **kwargs: Any) -> list[dict[str, Any]]:
        rows = real(db, **kwargs)
        with consumers.open_db(catalog_db, "catalog", busy_timeout_ms=100) as writer:
            apply_event(writer, from_mapping(event("1a2b3c4d-0000-4000-8000-000000000010", article="during")))
            seen.append(writer.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())
        return rows

    monkeypatch.setattr(queries, "inbox_list", inbox_list_then_write)
    result = invoke("inbox", "list", "--db", catalog_db, "--json")

    assert result.exit_code == 0, result.output
    assert seen == [(0, 0, 0)]  # committed, and no reader snapshot blocked the checkpoint
    assert len(orjson.loads(result.stdout)) == 4  # what the command read before the write
    assert len(orjson.loads(invoke("inbox", "list", "--db", catalog_db, "--json").stdout)) == 5


def test_inspect_works_while_a_writer_holds_the_write_lock(catalog_db: Path) -> None:
    """A writer inside BEGIN IMMEDIATE does not block inspect commands (WAL readers never wait)."""
    writer = consumers.open_db(catalog_db, "catalog", busy_timeout_ms=100)
    try:
        writer.conn.execute("BEGIN IMMEDIATE")
        writer.conn.execute("DELETE FROM catalog")
        for args in ALL_RUNS:
            if args[0] != "audit":
                assert invoke(*args, "--db", catalog_db).exit_code == 0, args
        rows = orjson.loads(invoke("catalog", "list", "--db", catalog_db, "--json").stdout)
        assert len(rows) == 2  # the uncommitted delete is not visible
    finally:
        writer.conn.execute("ROLLBACK")
        writer.close()


# -- output safety and help ------------------------------------------------------


def test_control_characters_are_escaped_in_text_output(tmp_path: Path) -> None:
    """A title with an escape sequence or a newline is printed escaped, keeping one row per line."""
    db = tmp_path / "catalog.db"
    with consumers.open_db(db, "catalog", create=True) as writer:
        apply_event(writer, from_mapping(event(A, title="red\x1b[31m\nline")))
    result = invoke("catalog", "list", "--db", db)

    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout
    assert columns(result.stdout.splitlines()[2])[3] == "red\\x1b[31m\\x0aline"
    assert orjson.loads(invoke("catalog", "show", "article-42", "--db", db, "--json").stdout)["title"] == (
        "red\x1b[31m\nline"
    )


@pytest.mark.parametrize("command", [*[c[:2] for c in READ_COMMANDS if c[0] != "query"], ["query"]], ids=str)
def test_every_inspect_command_has_help(command: list[str]) -> None:
    """Every inspect command answers --help with its description and the --db/--consumer/--json options."""
    result = invoke(*command, "--help")

    assert result.exit_code == 0, result.output
    for option in ("--db", "--consumer", "--json", "DELIVERY_DB"):
        assert option in result.stdout, option


def test_inspect_commands_are_registered() -> None:
    """The top-level group knows inbox, rejected and query, and catalog and audit from their specs' views."""
    assert {name: COMMANDS[name] for name in ("inbox", "rejected", "query")} == {
        "inbox": "inbox:inbox",
        "rejected": "inbox:rejected",
        "query": "inbox:query",
    }
    listed = invoke("--help").stdout
    assert re.search(r"^\s+catalog\s", listed, re.M) and re.search(r"^\s+audit\s", listed, re.M)
    assert not re.search(r"^\s+webhook\s", listed, re.M)  # no view, no command


# -- a directory that cannot be written ---------------------------------------------


def _as_unprivileged() -> list[str] | None:
    """A command prefix that runs as a user without write access, or None."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    """A directory outside tmp_path (whose parents are private to root) that others can read."""
    path = Path(tempfile.mkdtemp(prefix="inspect-ro-"))
    path.chmod(0o755)
    yield path
    path.chmod(0o755)
    shutil.rmtree(path)


def test_database_in_an_unwritable_directory_is_one_clear_line(
    world_readable_dir: Path, tmp_path: Path, catalog_db: Path
) -> None:
    """A WAL database in a directory the user cannot write: one line explaining why, exit 2, no traceback."""
    prefix = _as_unprivileged()
    if prefix is None:
        pytest.skip("needs a non-root user or setpriv")
    db = world_readable_dir / "inbox.db"
    shutil.copyfile(catalog_db, db)
    db.chmod(0o644)
    world_readable_dir.chmod(0o555)
    script = Path(sys.executable).with_name("delivery-consumer")
    result = subprocess.run(
        [*prefix, str(script), "inbox", "list", "--db", str(db)], capture_output=True, text=True, cwd="/"
    )

    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "directory" in result.stderr and "not writable" in result.stderr
    assert "Traceback" not in result.stderr
