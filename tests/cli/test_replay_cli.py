"""The ``init`` and ``replay`` commands: paths, options, sources, batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import WITHDRAWN, cli, json_lines, make_envelope, ndjson, new_event, read_rows, subprocess_env

from delivery_consumer import consumers

A = make_envelope()
B = new_event(type=WITHDRAWN, revision=2)
C = new_event(revision=1)


def test_init_creates_the_database_and_is_idempotent(tmp_path: Path) -> None:
    """init creates the consumer's database and says so; running it again changes nothing."""
    db = tmp_path / "deep" / "dir" / "catalog.db"

    first = cli(["init", "--consumer", "catalog", "--db", str(db)])
    schema = read_rows(db, "sqlite_schema", "name, sql")
    second = cli(["init", "--consumer", "catalog", "--db", str(db)])

    assert (0, 0) == (first.exit_code, second.exit_code)
    assert f"{db}: consumer catalog" in first.stdout
    assert schema == read_rows(db, "sqlite_schema", "name, sql")
    with consumers.open_db(db, readonly=True) as opened:
        assert "catalog" == opened.consumer


def test_init_uses_the_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --db the database is state/<consumer>/inbox.db under the working directory."""
    monkeypatch.chdir(tmp_path)

    assert 0 == cli(["init", "--consumer", "audit"]).exit_code
    assert (tmp_path / "state" / "audit" / "inbox.db").is_file()


def test_init_of_an_unknown_consumer_exits_2(tmp_path: Path) -> None:
    """init --consumer with an unknown name: exit 2 and one line naming the known consumers."""
    result = cli(["init", "--consumer", "nope", "--db", str(tmp_path / "x.db")])

    assert 2 == result.exit_code
    assert "unknown consumer 'nope'" in result.stderr
    assert 1 == len(result.stderr.strip().splitlines())
    assert not (tmp_path / "x.db").exists()


def test_replay_into_the_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """replay --consumer without --db creates and fills state/<consumer>/inbox.db."""
    monkeypatch.chdir(tmp_path)
    Path("e.ndjson").write_bytes(ndjson([A, B, C]))

    result = cli(["replay", "--consumer", "catalog", "e.ndjson"])

    assert 0 == result.exit_code, result.output
    assert [("article-42", 2, 0)] == read_rows(
        tmp_path / "state" / "catalog" / "inbox.db", "catalog", "article_id, revision, published"
    )


def test_environment_variables_give_the_options(tmp_path: Path) -> None:
    """DELIVERY_DB and DELIVERY_CONSUMER stand for --db and --consumer."""
    db = tmp_path / "env.db"
    (tmp_path / "e.ndjson").write_bytes(ndjson([A]))

    result = cli(["replay", str(tmp_path / "e.ndjson")], env={"DELIVERY_DB": str(db), "DELIVERY_CONSUMER": "audit"})

    assert 0 == result.exit_code, result.output
    assert [(A["eventId"], "recorded")] == read_rows(db, "inbox", "event_id, result")


def test_db_alone_uses_the_recorded_consumer(tmp_path: Path) -> None:
    """replay --db on an existing database needs no --consumer."""
    db = tmp_path / "a.db"
    cli(["init", "--consumer", "audit", "--db", str(db)])
    (tmp_path / "e.ndjson").write_bytes(ndjson([A]))

    result = cli(["replay", "--db", str(db), str(tmp_path / "e.ndjson")])

    assert 0 == result.exit_code, result.output
    assert f"{A['eventId']} recorded" == result.stdout.splitlines()[0]


def test_directory_is_read_in_name_order_and_not_recursively(tmp_path: Path) -> None:
    """A directory source gives its .json/.ndjson/.jsonl files in name order; subfolders and other files are skipped."""
    events = tmp_path / "events"
    (events / "sub").mkdir(parents=True)
    (events / "b.ndjson").write_bytes(ndjson([B]))
    (events / "a.json").write_bytes(ndjson([A]))
    (events / "c.JSONL").write_bytes(ndjson([C]))
    (events / "notes.txt").write_text("not an event")
    (events / "sub" / "0.json").write_bytes(ndjson([new_event(article_id="hidden")]))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", str(events)])

    assert [
        {"eventId": A["eventId"], "result": "updated"},
        {"eventId": B["eventId"], "result": "updated"},
        {"eventId": C["eventId"], "result": "stale"},
    ] == json_lines(result.stdout)


def test_sources_are_applied_in_the_order_given(tmp_path: Path) -> None:
    """Several SOURCE arguments are applied in command-line order, not sorted."""
    (tmp_path / "1.json").write_bytes(ndjson([A]))
    (tmp_path / "2.json").write_bytes(ndjson([B]))

    result = cli(["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json",
                  str(tmp_path / "2.json"), str(tmp_path / "1.json")])

    assert ["updated", "stale"] == [line["result"] for line in json_lines(result.stdout)]


@pytest.mark.parametrize("consumer", ["catalog", "audit"])
def test_batch_size_does_not_change_results(tmp_path: Path, consumer: str) -> None:
    """--batch 1, 3 and 100 print the same lines and leave the same tables."""
    events = [A, B, C, A, new_event(article_id="article-7"), {**A, "data": {"title": "x", "url": ""}}, C]
    (tmp_path / "e.ndjson").write_bytes(ndjson(events))
    outputs, tables = [], []
    for batch in ("1", "3", "100"):
        db = tmp_path / f"{batch}.db"
        result = cli(["replay", "--consumer", consumer, "--db", str(db), "--batch", batch, str(tmp_path / "e.ndjson")])
        outputs.append(result.stdout)
        tables.append((read_rows(db, consumer), read_rows(db, "inbox", "event_id, fingerprint, result")))

    assert outputs[0] == outputs[1] == outputs[2]
    assert tables[0] == tables[1] == tables[2]


def test_replaying_twice_gives_only_duplicates(tmp_path: Path) -> None:
    """A second replay of the same file changes nothing and answers duplicate:<first result> for each event."""
    (tmp_path / "e.ndjson").write_bytes(ndjson([A, B, C]))
    args = ["replay", "--consumer", "catalog", "--db", str(tmp_path / "c.db"), "--json", str(tmp_path / "e.ndjson")]

    first = json_lines(cli(args).stdout)
    second = json_lines(cli(args).stdout)

    assert [{**line, "result": "duplicate:" + line["result"]} for line in first] == second


PROGRESS_REPLAY = """
import sys
import delivery_consumer.cli.replay as replay_cmd
replay_cmd.PROGRESS_MIN_BYTES = int(sys.argv.pop(1))  # "large" made small, to keep the test fast
from delivery_consumer import consumers
from delivery_consumer.cli import main
main(prog_name="delivery-consumer")
"""


def _replay_with_stderr_on_a_terminal(tmp_path: Path, min_bytes: int) -> str:
    """Run replay with stderr on a pseudo-terminal; return what the terminal showed."""
    (tmp_path / "e.ndjson").write_bytes(ndjson([A, B, C]))
    master, slave = os.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", PROGRESS_REPLAY, str(min_bytes), "replay", "--consumer", "catalog",
             "--db", str(tmp_path / f"{min_bytes}.db"), "--json", str(tmp_path / "e.ndjson")],
            stdout=subprocess.DEVNULL, stderr=slave, env=subprocess_env(),
        )
        os.close(slave)
        shown = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        assert 0 == child.wait(timeout=60)
    finally:
        os.close(master)
    return shown.decode(errors="replace")


def test_progress_bar_only_on_a_terminal_and_for_large_input(tmp_path: Path) -> None:
    """On a terminal, large input shows a progress bar on stderr; small input shows only the summary."""
    large = _replay_with_stderr_on_a_terminal(tmp_path, min_bytes=1)
    small = _replay_with_stderr_on_a_terminal(tmp_path, min_bytes=1 << 30)

    assert "replaying" in large
    assert "replaying" not in small
    assert "3 events: 1 stale, 2 updated" in small


def test_replay_of_stdin_stops_cleanly_on_ctrl_c_while_input_still_arrives(tmp_path: Path) -> None:
    """replay - at a large batch: SIGINT while waiting for the rest of a batch, the producer still
    connected, ends the process with an ordinary exit code and no fatal error (nothing reads stdin
    in a thread that outlives the command)."""
    import signal

    child = subprocess.Popen(
        [sys.executable, "-c", "from delivery_consumer.cli import main; main(prog_name='delivery-consumer')",
         "replay", "--consumer", "catalog", "--db", str(tmp_path / "stdin.db"), "--batch", "100", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(),
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    try:
        child.stdin.write(ndjson([new_event(article_id=f"a-{i}") for i in range(103)]))
        child.stdin.flush()
        for _ in range(100):  # the first batch applied; the next one is waiting for input
            assert child.stdout.readline().endswith(b"\n"), "replay stopped early"
        code = None
        for _ in range(5):  # stdin stays open: the producer has more to say
            child.send_signal(signal.SIGINT)
            try:
                code = child.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                # A signal that lands just before a blocking read is handled
                # only when the read returns (in any Python program): again.
                continue
        assert code is not None, "replay did not stop on SIGINT"
        stderr = child.stderr.read().decode(errors="replace")
    finally:
        child.stdin.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert code >= 0, f"killed by signal {-code}: {stderr[-500:]}"
    assert "Fatal Python error" not in stderr
