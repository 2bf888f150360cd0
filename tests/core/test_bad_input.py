"""Bad input through ``replay``: every rejection code from a real malformed
input, the valid events around it still applied, exit codes, huge lines."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import orjson
import pytest
from support import (
    EVENT_ID,
    WITHDRAWN,
    body,
    cli,
    json_lines,
    make_envelope,
    ndjson,
    new_event,
    read_rows,
)

from delivery_consumer import consumers
from delivery_consumer.model.envelope import MAX_BODY_BYTES
from delivery_consumer.model.errors import CONTENT_CODES
from delivery_consumer.ops import replay as replay_lib
from delivery_consumer.ops import sources

A = make_envelope()
B = new_event(article_id="article-7", title="Очередь повторов", url="https://example.org/a/7")
C = new_event(article_id="article-8", title="Inbox в SQLite", url="https://example.org/a/8")
D = new_event(type=WITHDRAWN, revision=2)
E = new_event(article_id="article-9", title="Ack после commit", url="https://example.org/a/9")

#: line -> (body, what replay must answer): each rejection code between valid events.
MIXED = [
    (body(A), "updated"),
    (b'{"eventId": "' + EVENT_ID.encode() + b'", "type": "material.published", "revision": 1,', "malformed-json"),
    (body(B), "updated"),
    (body({**new_event(), "revision": 0}), "invalid-envelope"),
    (body(C), "updated"),
    (body(new_event(type="material.deleted")), "unknown-type"),
    (body(D), "updated"),
    (body({**A, "data": {"title": "Доставка без потерь и без дублей", "url": A["data"]["url"]}}), "event-id-reused"),
    (body({**B, "eventId": new_event()["eventId"], "data": {"title": "Черновик", "url": B["data"]["url"]}}),
     "revision-conflict"),
    (body(E), "updated"),
]


def write_mixed(tmp_path: Path) -> Path:
    source = tmp_path / "mixed.ndjson"
    source.write_bytes(ndjson([raw for raw, _ in MIXED]))
    return source


@pytest.mark.parametrize("batch", ["1", "4", "100"])
def test_every_rejection_code_in_one_replay(tmp_path: Path, batch: str) -> None:
    """One replay meets each rejection code; the valid events around them are applied, exit 1."""
    source = write_mixed(tmp_path)
    db = tmp_path / "catalog.db"

    result = cli(["replay", "--consumer", "catalog", "--db", str(db), "--batch", batch, "--json", str(source)])

    assert 1 == result.exit_code
    lines = json_lines(result.stdout)
    assert [expected for _, expected in MIXED] == [line.get("result", line.get("rejected")) for line in lines]
    assert set(CONTENT_CODES) == {line["rejected"] for line in lines if "rejected" in line}
    assert [
        ("article-42", 2, 0), ("article-7", 1, 1), ("article-8", 1, 1), ("article-9", 1, 1)
    ] == read_rows(db, "catalog", "article_id, revision, published")
    assert sorted(e["eventId"] for e in (A, B, C, D, E)) == [r[0] for r in read_rows(db, "inbox", "event_id")]
    assert [
        ("malformed-json", f"{source}:2"), ("invalid-envelope", f"{source}:4"), ("unknown-type", f"{source}:6"),
        ("event-id-reused", f"{source}:8"), ("revision-conflict", f"{source}:9"),
    ] == [(code, where) for _, code, where in read_rows(db, "rejected", "id, code, source")]


def test_json_lines_have_the_documented_shape(tmp_path: Path) -> None:
    """--json: results are {eventId, result}; rejections {eventId or null, rejected, reason, source}."""
    source = write_mixed(tmp_path)

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", str(source)])

    lines = json_lines(result.stdout)
    assert {"eventId": A["eventId"], "result": "updated"} == lines[0]
    assert {"eventId", "rejected", "reason", "source"} == set(lines[1])
    assert (None, f"{source}:2") == (lines[1]["eventId"], lines[1]["source"])
    assert (D["eventId"], "updated") == (lines[6]["eventId"], lines[6]["result"])
    assert {"eventId": EVENT_ID, "rejected": "event-id-reused", "source": f"{source}:8"}.items() <= lines[7].items()
    assert all(isinstance(line.get("reason", ""), str) for line in lines)
    assert "10 events: 5 updated, 5 rejected (1 event-id-reused, 1 invalid-envelope, 1 malformed-json, " \
        "1 revision-conflict, 1 unknown-type)" == result.stderr.strip().splitlines()[-1]


def test_text_output_and_summary_line(tmp_path: Path) -> None:
    """Without --json: one line per event (eventId and result, or code, reason and file:line), then the summary."""
    source = write_mixed(tmp_path)

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), str(source)])

    lines = result.stdout.splitlines()
    assert 11 == len(lines)
    assert f"{A['eventId']} updated" == lines[0]
    assert lines[1].startswith("- rejected malformed-json: ") and lines[1].endswith(f"({source}:2)")
    assert lines[7].startswith(f"{EVENT_ID} rejected event-id-reused: ") and lines[7].endswith(f"({source}:8)")
    assert lines[10].startswith("10 events: 5 updated, 5 rejected (")


def test_exit_0_when_nothing_is_rejected(tmp_path: Path) -> None:
    """Duplicates and stale events are not rejections: exit 0."""
    source = tmp_path / "ok.ndjson"
    source.write_bytes(ndjson([A, A, D, A, new_event(revision=1)]))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), str(source)])

    assert 0 == result.exit_code, result.output
    assert "5 events: 2 duplicate:updated, 1 stale, 2 updated" == result.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "--consumer", "catalog", "{tmp}/missing.ndjson"], "no such file or directory"),
        (["replay", "--consumer", "catalog", "{tmp}/events.txt"], "unsupported file type"),
        (["replay", "{tmp}/ok.ndjson"], "give --consumer"),
        (["replay", "--consumer", "catalog", "--batch", "0", "{tmp}/ok.ndjson"], "--batch"),
        (["replay", "--consumer", "nope", "{tmp}/ok.ndjson"], "unknown consumer 'nope'"),
        (["replay", "--consumer", "audit", "--db", "{tmp}/catalog.db", "{tmp}/ok.ndjson"], "belongs to consumer"),
        (["replay", "--consumer", "catalog", "--db", "{tmp}/corrupt.db", "{tmp}/ok.ndjson"], "not a database"),
        (["replay", "--consumer", "catalog", "--db", "{tmp}", "{tmp}/ok.ndjson"], "directory"),
        (["replay", "--db", "{tmp}/none.db", "{tmp}/ok.ndjson"], "no such database"),
        (["replay", "--consumer", "catalog"], "Missing argument"),
    ],
    ids=["missing-source", "unsupported-type", "no-consumer", "batch-0", "unknown-consumer", "other-consumer",
         "corrupt-db", "db-is-directory", "missing-db", "no-source"],
)
def test_usage_and_database_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    """Usage and database errors: exit 2, a message on stderr naming the cause, no traceback, nothing applied."""
    (tmp_path / "ok.ndjson").write_bytes(ndjson([A]))
    (tmp_path / "events.txt").write_bytes(ndjson([A]))
    (tmp_path / "corrupt.db").write_bytes(b"\x00garbage" * 512)
    consumers.open_db(tmp_path / "catalog.db", "catalog", create=True).close()
    before = sorted(p.name for p in tmp_path.iterdir())

    result = cli([arg.replace("{tmp}", str(tmp_path)) for arg in args])

    assert 2 == result.exit_code
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "" == result.stdout
    assert before == sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm")))
    assert [] == read_rows(tmp_path / "catalog.db", "inbox")


def test_a_huge_line_is_rejected_and_the_next_line_applies(tmp_path: Path) -> None:
    """A 5 MiB NDJSON line is rejected invalid-envelope (over the limit) and the following line still applies."""
    huge = body(new_event(title="x" * (5 << 20)))
    source = tmp_path / "huge.ndjson"
    source.write_bytes(ndjson([A, huge, B]))
    db = tmp_path / "c.db"

    result = cli(["replay", "--consumer", "catalog", "--db", str(db), "--json", str(source)])

    lines = json_lines(result.stdout)
    assert 1 == result.exit_code
    assert ["updated", "invalid-envelope", "updated"] == [line.get("result", line.get("rejected")) for line in lines]
    assert f"{source}:2" == lines[1]["source"]
    assert str(MAX_BODY_BYTES) in lines[1]["reason"]
    assert 2 == len(read_rows(db, "catalog"))


@pytest.mark.parametrize("suffix", [".ndjson", ".json"])
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b""])
def test_a_body_over_the_limit_is_refused_with_its_own_size(tmp_path: Path, suffix: str, end: bytes) -> None:
    """The refusal of a body over --max-bytes gives the body's size, not the limit + 1 bytes kept of it, for a
    line (whatever its end) or a whole file, in replay and in publish's check."""
    huge = body(new_event(title="x" * 5000))
    source = tmp_path / f"huge{suffix}"
    source.write_bytes(huge + end if suffix == ".json" else huge + end + (ndjson([A]) if end else b""))
    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--max-bytes", "1000", "--json",
                  str(source)])
    refused = json_lines(result.stdout)[0]
    assert f"body is {len(huge) + (len(end) if suffix == '.json' else 0)} bytes, over the limit of 1000" == (
        refused["reason"])


def test_a_huge_line_is_never_held_in_memory_whole(tmp_path: Path) -> None:
    """Reading and replaying a file with a 5 MiB line allocates far less than the line (it is cut at the limit)."""
    source = tmp_path / "huge.ndjson"
    source.write_bytes(ndjson([A, body(new_event(title="x" * (5 << 20))), B]))

    with consumers.open_db(tmp_path / "c.db", "catalog", create=True) as db:
        tracemalloc.start()
        try:
            items = sources.read(sources.expand([str(source)]))
            statuses = [outcome.status for _, outcome in replay_lib.replay(db, items, batch=2)]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

    assert ["updated", "invalid-envelope", "updated"] == statuses
    assert peak < 3 * MAX_BODY_BYTES, f"peak {peak} bytes"


def test_a_json_file_over_the_limit_is_rejected(tmp_path: Path) -> None:
    """A .json file larger than the limit is rejected invalid-envelope; the other files still apply."""
    (tmp_path / "1_big.json").write_bytes(body(new_event(title="x" * (2 << 20))))
    (tmp_path / "2_ok.json").write_bytes(body(A))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", str(tmp_path)])

    assert ["invalid-envelope", "updated"] == [
        line.get("result", line.get("rejected")) for line in json_lines(result.stdout)
    ]


def test_max_bytes_option(tmp_path: Path) -> None:
    """--max-bytes lowers the body limit."""
    source = tmp_path / "e.ndjson"
    source.write_bytes(ndjson([A]))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--max-bytes", "100",
                  "--json", str(source)])

    assert 1 == result.exit_code
    assert "invalid-envelope" == json_lines(result.stdout)[0]["rejected"]


def test_stdin_dash(tmp_path: Path) -> None:
    """SOURCE '-' reads NDJSON from stdin; locations read '-:LINE'."""
    stdin = ndjson([A, b"not json", B])

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", "-"], input=stdin)

    lines = json_lines(result.stdout)
    assert 1 == result.exit_code
    assert ["updated", "malformed-json", "updated"] == [line.get("result", line.get("rejected")) for line in lines]
    assert "-:2" == lines[1]["source"]


def test_blank_lines_are_skipped_but_counted_and_crlf_accepted(tmp_path: Path) -> None:
    """Blank lines are not events, yet line numbers stay those of the file; CRLF line ends are fine."""
    source = tmp_path / "crlf.ndjson"
    source.write_bytes(body(A) + b"\r\n\r\n   \r\n" + b"{oops}\r\n" + body(B) + b"\r\n")

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", str(source)])

    lines = json_lines(result.stdout)
    assert ["updated", "malformed-json", "updated"] == [line.get("result", line.get("rejected")) for line in lines]
    assert f"{source}:4" == lines[1]["source"]


def test_a_json_file_with_two_envelopes_is_malformed(tmp_path: Path) -> None:
    """A .json file holds one envelope: NDJSON in a .json file is malformed-json, not two events."""
    source = tmp_path / "two.json"
    source.write_bytes(ndjson([A, B]))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", str(source)])

    assert [{"eventId": None, "rejected": "malformed-json"}] == [
        {k: line[k] for k in ("eventId", "rejected")} for line in json_lines(result.stdout)
    ]


def test_rejected_rows_keep_a_digest_not_the_body(tmp_path: Path) -> None:
    """A body that did not parse is recorded by its SHA-256 and a short reason, never by its content."""
    secret = "Пароль-s3cr3t"
    stdin = b'{"title": "' + secret.encode() + b'", oops}\n'

    cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "-"], input=stdin)

    [(code, reason, body_sha256)] = read_rows(tmp_path / "c.db", "rejected", "code, reason, body_sha256")
    assert "malformed-json" == code
    assert secret not in reason
    assert 64 == len(body_sha256)
    assert orjson.dumps(secret).decode().strip('"') not in reason


BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("suffix", [".json", ".ndjson", ".jsonl", "-"])
def test_a_byte_order_mark_at_the_start_of_a_file_is_skipped(tmp_path: Path, suffix: str) -> None:
    """A UTF-8 BOM at the start of a file or of stdin (Windows editors, PowerShell) is not part of the
    first envelope; the limit counts the envelope alone."""
    db = str(tmp_path / "c.db")
    exact = body(A)
    if suffix == "-":
        result = cli(["replay", "--consumer", "catalog", "--db", db, "--max-bytes", str(len(exact)), "--json", "-"],
                     input=BOM + ndjson([A, B]))
    else:
        source = tmp_path / f"e{suffix}"
        source.write_bytes(BOM + (exact if suffix == ".json" else ndjson([A, B])))
        result = cli(["replay", "--consumer", "catalog", "--db", db, "--max-bytes", str(len(exact)), "--json",
                      str(source)])

    assert 0 == result.exit_code, result.output
    assert ["updated"] * (1 if suffix == ".json" else 2) == [line["result"] for line in json_lines(result.stdout)]


def test_a_byte_order_mark_elsewhere_is_named_in_the_rejection(tmp_path: Path) -> None:
    """A BOM that does not start the file (a concatenated file's second line) is refused in the user's
    words, not with Python's decoding hint."""
    source = tmp_path / "e.ndjson"
    source.write_bytes(ndjson([A, BOM + body(B)]))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", str(source)])

    second = json_lines(result.stdout)[1]
    assert ("malformed-json", "body starts with a UTF-8 byte order mark (BOM): send the JSON without it") == (
        second["rejected"], second["reason"])


def test_the_body_limit_is_exact_on_ndjson_lines(tmp_path: Path) -> None:
    """With --max-bytes N, an NDJSON line of N bytes applies (CRLF not counted), one of N + 1 is rejected."""
    exact = body(A)
    one_more = body(B) + b" " * (len(exact) + 1 - len(body(B)))
    assert (len(exact) + 1, len(exact)) == (len(one_more), len(body(A)))
    source = tmp_path / "limit.ndjson"
    source.write_bytes(exact + b"\r\n" + one_more + b"\n" + body(C))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--max-bytes", str(len(exact)),
                  "--json", str(source)])

    assert ["updated", "invalid-envelope", "updated"] == [
        line.get("result", line.get("rejected")) for line in json_lines(result.stdout)
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--consumer", "catalog", "--exit-when-idle", "5x"], "'5x' is not a duration"),
        (["console", "--window", "0"], "0 is out of range"),
        (["query", "--timeout", "soon", "SELECT 1"], "'soon' is not a duration"),
        (["replay", "--consumer", "catalog", "--batch", "0", "x.ndjson"], "--batch"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (["inbox", "list", "--no-such-option"], "No such option '--no-such-option'"),
    ],
    ids=["duration", "window-0", "timeout", "batch-0", "command", "option"],
)
def test_a_usage_error_is_one_line(args: list[str], message: str) -> None:
    """A bad option value, command or option: exit 2 and one line on stderr naming the command, what is wrong
    and where the help is -- not click's four-line usage block."""
    result = cli(args)

    assert 2 == result.exit_code
    lines = result.stderr.strip().splitlines()
    assert 1 == len(lines), result.stderr
    assert message in lines[0] and "--help" in lines[0]
    assert "" == result.stdout
