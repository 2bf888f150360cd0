"""The deployment file: where it is read from, what it sets, what it refuses;
and the system view offline (trace and status without the broker)."""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from deploykit import deploy_env, write_deployment
from hypothesis import given
from hypothesis import strategies as st
from support import EVENT_ID, SAMPLES, cli

from delivery_consumer.ops.system_view import topic_matches


def with_config(config: Path, *args: str, **env: str) -> tuple[int, str, str]:
    result = cli(["--config", str(config), *args], env=env or None)
    return result.exit_code, result.stdout, result.stderr


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert 1 == len(lines), text
    return lines[0]


def test_an_unknown_key_is_one_line_naming_the_file_and_the_key(tmp_path: Path) -> None:
    """A misspelt key: exit 2, one line with the file and the dotted key, for any command."""
    config = write_deployment(tmp_path, extra="")
    config.write_text(config.read_text() + "dbb = 'x'\n")  # lands in [producers.material]
    code, _out, err = with_config(config, "inbox", "list", "--consumer", "catalog")
    assert 2 == code
    line = one_line(err)
    assert f"{config}: producers.material.dbb: unknown key" in line, line


@pytest.mark.parametrize("text, key", [
    ("amqp_url = 5\n", "amqp_url"),
    ("[consumers.nosuch]\ndb = 'x.db'\n", "consumers.nosuch"),
    ("[consumers.catalog]\n", "consumers.catalog.db"),
    ("[status]\noutbox_max_age = 'soon'\n", "status.outbox_max_age"),
    ("[consumers.catalog]\ndb = 'a.db'\n[producers.p]\ndb = 'a.db'\n", "producers.p.db"),
    ("amqp_url = \n", "not valid TOML"),
    ('management_url = "127.0.0.1:15672"\n', "management_url"),
    ('management_url = "http://[bad"\n', "management_url"),
])
def test_every_mistake_names_its_key(tmp_path: Path, text: str, key: str) -> None:
    """Wrong types, unknown consumers, a missing db, a bad duration, one file named twice,
    broken TOML: each is one line naming the file and what is wrong, exit 2."""
    config = tmp_path / "delivery.toml"
    config.write_text(text)
    code, _out, err = with_config(config, "config", "check")
    assert 2 == code
    assert one_line(err).startswith(f"delivery-consumer: {config}: {key}"), err


@pytest.mark.parametrize("value, seconds", [("300", 300.0), ("2.5", 2.5), ('"5m"', 300.0), ('"300"', 300.0)])
def test_outbox_max_age_reads_the_duration_grammar_a_toml_number_being_seconds(
        tmp_path: Path, value: str, seconds: float) -> None:
    """A bare number means seconds in the one duration grammar, in a TOML number as in a string."""
    config = tmp_path / "delivery.toml"
    config.write_text(f"[status]\noutbox_max_age = {value}\n")
    code, out, _err = with_config(config, "config", "check", "--json")
    assert 0 == code and seconds == orjson.loads(out)["outboxMaxAgeSeconds"]


@pytest.mark.parametrize("value", ["true", "[1]", "-1", "nan", '"soon"'])
def test_outbox_max_age_refuses_what_is_no_duration(tmp_path: Path, value: str) -> None:
    """A boolean, an array, a negative number, NaN: one line naming the key, exit 2."""
    config = tmp_path / "delivery.toml"
    config.write_text(f"[status]\noutbox_max_age = {value}\n")
    code, _out, err = with_config(config, "config", "check")
    assert 2 == code and one_line(err).startswith(f"delivery-consumer: {config}: status.outbox_max_age: "), err


def test_a_missing_file_named_by_flag_or_environment_is_an_error(tmp_path: Path) -> None:
    """--config and DELIVERY_CONFIG must name a file that exists; only the default may be absent."""
    missing = tmp_path / "nope.toml"
    code, _out, err = with_config(missing, "status")
    assert 2 == code and f"{missing}: no such deployment file (named by --config)" in one_line(err)
    result = cli(["status"], env={"DELIVERY_CONFIG": str(missing)})
    assert 2 == result.exit_code and "named by $DELIVERY_CONFIG" in one_line(result.stderr)


def test_paths_are_relative_to_the_file_and_flags_override_it(tmp_path: Path) -> None:
    """replay and catalog list find state/catalog/inbox.db beside the file, from any
    working directory; an explicit --db wins over the file."""
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    config = write_deployment(deploy)
    code, _out, _err = with_config(config, "replay", "--consumer", "catalog", str(SAMPLES))
    assert 1 == code  # the samples hold two rejections
    assert (deploy / "state" / "catalog" / "inbox.db").is_file()
    code, out, _err = with_config(config, "catalog", "list", "--json")
    assert 0 == code and 4 == len(orjson.loads(out))
    other = tmp_path / "other.db"
    code, _out, _err = with_config(config, "init", "--consumer", "catalog", "--db", str(other))
    assert 0 == code and other.is_file()
    code, out, _err = with_config(config, "catalog", "list", "--json", "--db", str(other))
    assert 0 == code and [] == orjson.loads(out)


@pytest.mark.parametrize("given", [["--config", "{config}"], ["--config={config}"]])
def test_config_may_follow_the_command(tmp_path: Path, given: list[str]) -> None:
    """``status --config PATH`` (the flag after the command, where an operator types it) reads PATH,
    as ``--config PATH status`` does; a --config after ``--`` is an argument, not the flag."""
    (tmp_path / "deploy").mkdir()
    config = write_deployment(tmp_path / "deploy")  # not the working directory's ./delivery.toml
    flag = [arg.format(config=config) for arg in given]
    result = cli(["status", "--offline", "--json", *flag])
    assert 0 == result.exit_code, result.stderr
    assert str(config) == orjson.loads(result.stdout)["deployment"]

    from delivery_consumer.cli import hoist_config

    assert ["--config", "a", "x", "--", "--config", "b"] == hoist_config(["x", "--config", "a", "--", "--config", "b"])


def test_a_database_of_another_consumer_is_refused_naming_the_key(tmp_path: Path) -> None:
    """The file names a catalog database for audit: every command using it, config check and the
    system view (status, trace, console) exit 2 with one line naming the file and consumers.audit.db."""
    config = write_deployment(tmp_path, consumers=("catalog", "audit"))
    assert 0 == with_config(config, "init", "--consumer", "catalog", "--db", str(tmp_path / "state/audit/inbox.db"))[0]
    for args in (["inbox", "list", "--consumer", "audit"], ["run", "--consumer", "audit", "--exit-when-idle", "1"],
                 ["config", "check"], ["status", "--offline"], ["trace", EVENT_ID, "--offline"],
                 ["console", "--port", "0"]):
        code, _out, err = with_config(config, *args)
        assert 2 == code, (args, err)
        line = [x for x in err.splitlines() if "consumers.audit.db" in x]
        assert line and "belongs to consumer 'catalog'" in line[0], err


def test_a_producer_and_a_consumer_database_swapped_in_the_file_are_named_for_what_they_are(
        tmp_path: Path) -> None:
    """The producer's database named as catalog's, the catalog's as the producer's: every command
    says which key names which kind of database, in one line, exit 2."""
    config = write_deployment(tmp_path, consumers=("catalog",))
    assert 0 == with_config(config, "produce", "--article", "a", "--title", "T", "--url", "u")[0]
    assert 1 == with_config(config, "replay", "--consumer", "catalog", str(SAMPLES))[0]
    text = config.read_text().replace('"state/catalog/inbox.db"', '"SWAP"')
    config.write_text(text.replace('"producer.db"', '"state/catalog/inbox.db"').replace('"SWAP"', '"producer.db"'))
    as_consumer = f"{config}: consumers.catalog.db: {tmp_path / 'producer.db'}: this is a producer's database"
    for args in (["config", "check"], ["inbox", "list", "--consumer", "catalog"],
                 ["run", "--consumer", "catalog", "--exit-when-idle", "1"], ["status", "--offline"]):
        code, _out, err = with_config(config, *args)
        assert 2 == code and any(line.startswith(f"delivery-consumer: {as_consumer}") for line in err.splitlines()), (
            args, err)
    as_producer = (f"{config}: producers.material.db: {tmp_path / 'state/catalog/inbox.db'}: "
                   "this is a consumer's inbox database, not a producer's")
    for args in (["outbox", "list"], ["outbox", "stats"], ["produce", "--article", "a", "--title", "T"]):
        code, _out, err = with_config(config, *args)
        assert 2 == code and as_producer == one_line(err).removeprefix("delivery-consumer: "), (args, err)


def test_the_broker_options_come_from_the_file_unless_given(tmp_path: Path) -> None:
    """Precedence: command line > environment > file > default (unreachable ports show which won)."""
    config = write_deployment(tmp_path, extra='amqp_url = "amqp://guest:guest@127.0.0.1:9/%2F"')
    _code, _out, err = with_config(config, "dead", "list", "--consumer", "catalog")
    assert "127.0.0.1:9/" in err, err
    _code, _out, err = with_config(config, "dead", "list", "--consumer", "catalog",
                                   DELIVERY_AMQP_URL="amqp://guest:guest@127.0.0.1:7/%2F")
    assert "127.0.0.1:7/" in err, err
    _code, _out, err = with_config(config, "dead", "list", "--consumer", "catalog",
                                   "--amqp-url", "amqp://guest:guest@127.0.0.1:13/%2F",
                                   DELIVERY_AMQP_URL="amqp://guest:guest@127.0.0.1:7/%2F")
    assert "127.0.0.1:13/" in err, err


def test_the_system_commands_look_where_the_environment_points_the_broker_commands(tmp_path: Path) -> None:
    """DELIVERY_AMQP_URL / _EXCHANGE / _QUEUE_PREFIX override the file for run and dispatch,
    so status, trace and config check must use them too (else they watch another broker)."""
    config = write_deployment(tmp_path, extra='amqp_url = "amqp://guest:guest@127.0.0.1:9/%2F"')
    env = {"DELIVERY_AMQP_URL": "amqp://guest:guest@127.0.0.1:7/%2F", "DELIVERY_QUEUE_PREFIX": "envprefix",
           "DELIVERY_EXCHANGE": "env.events"}
    code, out, _err = with_config(config, "status", "--json", **env)
    shown = orjson.loads(out)
    assert 1 == code and "127.0.0.1:7/" in shown["broker"]["url"] and "127.0.0.1:7/" in shown["problems"][0]
    assert "envprefix.catalog" == shown["consumers"][0]["queue"]
    code, out, _err = with_config(config, "config", "check", **env)
    assert 0 == code and "envprefix (from $DELIVERY_QUEUE_PREFIX)" in out and "env.events (from" in out, out
    code, out, _err = with_config(config, "config", "check", "--json")
    assert "127.0.0.1:9/" in orjson.loads(out)["amqpUrl"] and "delivery" == orjson.loads(out)["queuePrefix"]


def test_config_check_shows_what_each_command_would_use(tmp_path: Path) -> None:
    """Resolved paths, queues, the run command line and the producer default."""
    config = write_deployment(tmp_path, webhook_url="http://127.0.0.1:1/notify")
    code, out, _err = with_config(config, "config", "check", "--json")
    assert 0 == code
    shown = orjson.loads(out)
    hook = next(c for c in shown["consumers"] if c["consumer"] == "webhook")
    assert str(tmp_path / "state/webhook/inbox.db") == hook["db"]
    assert "--webhook-url=http://127.0.0.1:1/notify" in hook["run"]
    assert str(tmp_path / "producer.db") == shown["producerCommandsUse"]
    code, out, _err = with_config(config, "config", "check")
    assert 0 == code and "delivery.catalog.dead" in out and "(not created yet)" in out


def test_config_check_s_run_line_names_the_file_s_queues_and_survives_the_shell(tmp_path: Path) -> None:
    """The run line config check prints, pasted into a shell without the file, reads the same
    queues (a non-default exchange and prefix are on it) and the same database (quoted)."""
    deploy = tmp_path / "my deploy"
    deploy.mkdir()
    config = write_deployment(deploy, consumers=("catalog",), extra='exchange = "x.events"\nqueue_prefix = "xq"')
    code, out, _err = with_config(config, "config", "check", "--json")
    line = orjson.loads(out)["consumers"][0]["run"]
    args = shlex.split(line)
    assert 0 == code and "--exchange=x.events" in args and "--queue-prefix=xq" in args, line
    assert str(deploy / "state/catalog/inbox.db") == args[args.index("--db") + 1]
    code, out, _err = with_config(write_deployment(tmp_path, consumers=("catalog",)), "config", "check", "--json")
    assert "--exchange" not in out and "--queue-prefix" not in out  # the defaults need no flag


def test_trace_and_status_offline_across_producer_and_consumer(tmp_path: Path) -> None:
    """produce (its --db from the file), replay into catalog: trace shows the outbox row
    unpublished and the receipt; an unknown id exits 1, one that is not a UUID 2; status
    --offline names the unresolved rejections (it cannot see the dead queues) and exits 1."""
    config = write_deployment(tmp_path, consumers=("catalog", "audit"))
    code, out, _err = with_config(config, "produce", "--article", "a-1", "--title", "T", "--url", "https://x/1",
                                  "--json")
    assert 0 == code, out
    produced = orjson.loads(out)["eventId"]
    with_config(config, "replay", "--consumer", "catalog", str(SAMPLES))
    code, out, _err = with_config(config, "trace", produced, "--offline", "--json")
    assert 0 == code
    shown = orjson.loads(out)
    assert shown["outbox"][0]["publishedAt"] is None and "a-1" == shown["outbox"][0]["articleId"]
    assert {"catalog": "not published yet", "audit": "not published yet"} == {
        c["consumer"]: c["verdict"] for c in shown["consumers"]}
    code, out, _err = with_config(config, "trace", EVENT_ID, "--offline")
    assert 0 == code and re.search(r"catalog\s+applied updated", out), out
    code, _out, err = with_config(config, "trace", "00000000-0000-4000-8000-000000000000", "--offline")
    assert 1 == code and "known to no producer and no consumer" in one_line(err)
    code, _out, err = with_config(config, "trace", "no-such-id", "--offline")  # nor a CloudEvent's id known here
    assert 1 == code and "not a UUID" in one_line(err) and "--ce-source" in one_line(err)
    code, out, _err = with_config(config, "trace", "--article", "a-1", "--json")
    assert 0 == code and [produced] == [e["eventId"] for e in orjson.loads(out)["events"]]
    # The samples' two refused events: offline, the database's unresolved rejections are what is known.
    code, out, _err = with_config(config, "status", "--offline", "--json")
    shown = orjson.loads(out)
    assert 1 == code and not shown["healthy"] and shown["broker"] is None
    assert ["catalog: 2 unresolved rejections (1 event-id-reused, 1 revision-conflict); the broker was not asked "
            "for its dead letters"] == shown["problems"]
    code, out, _err = with_config(config, "status", "--offline")
    assert 1 == code and "broker not asked (--offline)" in out, out


def test_status_thresholds_come_from_the_file_and_flags_override_them(tmp_path: Path) -> None:
    """outbox_max_age = "0s" in the file: an unpublished row needs a person (exit 1, the row named);
    --outbox-max-age 1h on the command line wins (exit 0)."""
    config = write_deployment(tmp_path, consumers=("catalog",), extra='[status]\noutbox_max_age = "0s"')
    assert 0 == with_config(config, "produce", "--article", "a-1", "--title", "T", "--url", "https://x/1")[0]
    code, out, _err = with_config(config, "status", "--offline")
    assert 1 == code and re.search(r"NEEDS A PERSON: producer material: 1 pending row, the oldest \d+s old "
                                   r"\(more than 0s\): is dispatch running\?", out), out
    code, out, _err = with_config(config, "status", "--offline", "--outbox-max-age", "1h")
    assert 0 == code and out.rstrip().endswith("healthy"), out


def test_a_reader_that_closes_the_pipe_stops_the_command_quietly(tmp_path: Path) -> None:
    """``config check | head -1``: the reader is gone before the first line; no error line,
    no traceback, exit 141 (128 + SIGPIPE, as cat or grep would give)."""
    config = write_deployment(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "delivery_consumer", "config", "check"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=deploy_env(config), timeout=60)
    finally:
        os.close(write_end)
    assert 141 == done.returncode and "" == done.stderr, done.stderr


def test_trace_tells_an_outbox_row_s_history_and_no_stale_error_as_current(tmp_path: Path) -> None:
    """A row quarantined, requeued by a person and then published: trace (text and console)
    says so in that order, and shows no "last error" as if the published row were failing."""
    from delivery_consumer.console.server import Console
    from delivery_consumer.ops.deployment import parse_file

    config = write_deployment(tmp_path, consumers=("catalog",), extra='amqp_url = "amqp://guest:guest@127.0.0.1:9/%2F"')
    code, out, _err = with_config(config, "produce", "--article", "a-1", "--title", "T", "--url", "https://x/1",
                                  "--json")
    event_id = orjson.loads(out)["eventId"]
    with sqlite3.connect(tmp_path / "producer.db") as conn:
        conn.execute("UPDATE outbox SET status = 'quarantined', quarantined_at = '2026-12-01T08:00:00.000Z',"
                     " quarantine_reason = 'returned: unroutable: 312 NO_ROUTE', attempts = 1,"
                     " last_error = 'returned: unroutable: 312 NO_ROUTE'")
    code, _out, _err = with_config(config, "outbox", "requeue", event_id, "--by", "night-shift")
    assert 0 == code
    with sqlite3.connect(tmp_path / "producer.db") as conn:
        conn.execute("UPDATE outbox SET status = 'published', published_at = '2026-12-01T09:00:00.000Z',"
                     " attempts = 2, last_error = 'nacked: queue full'")
    code, out, _err = with_config(config, "trace", event_id, "--offline")
    assert 0 == code
    outbox_part = out.split("consumer catalog")[0]
    assert "last error" not in outbox_part, outbox_part
    history = [line.split(":", 1)[1].strip() for line in outbox_part.splitlines() if "history:" in line]
    assert 3 == len(history), outbox_part
    assert history[0].startswith("quarantined at 2026-12-01T08:00:00.000Z: returned: unroutable")
    assert history[1].startswith("requeued at ") and history[1].endswith(" by night-shift")
    assert "published after an error: nacked: queue full" == history[2]
    _status, page = Console(parse_file(config)).trace_page(event_id)
    assert "requeued at " in page and "by night-shift" in page and "nacked: queue full" in page


def test_the_console_gives_the_newest_receipt_s_age_and_a_readable_peak(tmp_path: Path) -> None:
    """At 3 a.m. the age of the newest receipt is what is compared with the clock: the console
    shows it as the CLI's status does ('… ago', the time on hover); the chart's peak label has
    a halo so the newest bars cannot hide it."""
    from delivery_consumer.console.server import Console
    from delivery_consumer.ops.deployment import parse_file

    config = write_deployment(tmp_path, consumers=("catalog",), extra='amqp_url = "amqp://guest:guest@127.0.0.1:9/%2F"')
    with_config(config, "replay", "--consumer", "catalog", str(SAMPLES))
    with_config(config, "produce", "--article", "a", "--title", "T", "--url", "u")
    page = Console(parse_file(config)).status_page()
    ages = re.findall(r'<span title="\d{4}-\d\d-\d\dT[^"]+Z">\d+s ago</span>', page)
    assert 2 == len(ages), page  # the newest receipt, the oldest pending outbox row
    assert 'paint-order="stroke">peak ' in page


def test_a_console_on_every_address_accepts_actions_addressed_to_this_machine(tmp_path: Path) -> None:
    """console --allow-actions --host 0.0.0.0 refused every POST, since no browser sends 'Host:
    0.0.0.0'. It accepts the loopback names and this machine's own; any other Host is refused
    with the names it would accept."""
    import socket

    from delivery_consumer.console.server import Console, make_server
    from delivery_consumer.ops.deployment import parse_file

    console = Console(parse_file(write_deployment(tmp_path)), allow_actions=True)
    server = make_server(console, "0.0.0.0", 0)
    try:
        port = server.server_address[1]
        form = {"csrf": console.token}
        for name in ("127.0.0.1", "localhost", socket.gethostname()):
            assert console.check_post(f"{name}:{port}", form) is None, name
        refused = console.check_post(f"evil.example:{port}", form) or ""
        assert refused.startswith("the Host header 'evil.example:") and f"localhost:{port}" in refused
        assert console.check_post(f"localhost:{port}", {"csrf": "forged"}) is not None
    finally:
        server.server_close()


def test_a_page_asked_for_under_another_host_name_is_refused(tmp_path: Path) -> None:
    """DNS rebinding: a page of another site, its name rebound to 127.0.0.1, asks the console for
    its pages. Any GET whose Host does not name the console is refused (403); /healthz stays open."""
    import http.client
    import threading

    from delivery_consumer.console.server import Console, make_server
    from delivery_consumer.ops.deployment import parse_file

    config = write_deployment(tmp_path, consumers=("catalog",), extra='amqp_url = "amqp://guest:guest@127.0.0.1:9/%2F"')
    server = make_server(Console(parse_file(config)), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]

        def get(path: str, host: str) -> tuple[int, str]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", path, headers={"Host": host})
            answer = conn.getresponse()
            body = answer.read().decode()
            conn.close()
            return answer.status, body

        for path in ("/", "/trace?q=x", "/dead/confirm?consumer=catalog&action=purge&code=c"):
            status, body = get(path, f"evil.example:{port}")
            assert 403 == status and "the Host header &#x27;evil.example:" in body, (path, body[-500:])
        assert 200 == get("/healthz", f"evil.example:{port}")[0]
        assert 200 == get("/", f"localhost:{port}")[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def test_trace_without_a_deployment_file_or_consumer_says_what_to_give(tmp_path: Path) -> None:
    """No file, no --consumer: exit 2 with one line; with --consumer the per-consumer trace runs."""
    result = cli(["trace", "00000000-0000-4000-8000-000000000000"])
    assert 2 == result.exit_code and "no deployment file" in one_line(result.stderr)


WORDS = st.sampled_from(["a", "b", "material"])


@given(st.lists(st.one_of(WORDS, st.just("*")), min_size=1, max_size=4), st.lists(WORDS, min_size=1, max_size=4))
def test_topic_matching_without_hash_is_word_by_word(pattern: list[str], key: list[str]) -> None:
    """Without #, a pattern matches exactly the keys of its length whose words equal
    its words where it has no *."""
    expected = len(pattern) == len(key) and all(p in ("*", k) for p, k in zip(pattern, key, strict=True))
    assert expected == topic_matches(".".join(pattern), ".".join(key))


@given(st.lists(WORDS, max_size=3), st.lists(WORDS, max_size=3), st.lists(WORDS, min_size=0, max_size=3))
def test_hash_matches_any_number_of_words(head: list[str], tail: list[str], middle: list[str]) -> None:
    """head.#.tail matches head + anything + tail."""
    pattern = ".".join([*head, "#", *tail])
    key = ".".join([*head, *middle, *tail])
    if key:
        assert topic_matches(pattern, key)


def test_a_partition_directory_is_read_database_by_database(tmp_path: Path) -> None:
    """db naming a directory of p<k>/inbox.db: status and trace show one line per
    partition, in partition order (p2 before p10)."""
    config = tmp_path / "delivery.toml"
    config.write_text('[consumers.catalog]\ndb = "state/catalog"\n')
    for k in (10, 0, 2):
        assert 0 == with_config(config, "init", "--consumer", "catalog", "--db",
                                str(tmp_path / f"state/catalog/p{k}/inbox.db"))[0]
    with_config(config, "replay", "--consumer", "catalog", "--db", str(tmp_path / "state/catalog/p2/inbox.db"),
                str(SAMPLES))
    code, out, _err = with_config(config, "status", "--offline", "--json")
    assert 1 == code  # the samples' two refused events are unresolved, and offline that is what is known
    dbs = orjson.loads(out)["consumers"][0]["databases"]
    assert ["p0", "p2", "p10"] == [db["partition"] for db in dbs]
    assert [0, 9, 0] == [db["receiptsLastHour"] for db in dbs]
    code, out, _err = with_config(config, "trace", EVENT_ID, "--offline")
    assert 0 == code and re.search(r"catalog/p2\s+applied updated", out) and "catalog/p0" in out, out


def test_a_directory_without_partitions_is_an_error_not_a_consumer_with_no_database(tmp_path: Path) -> None:
    """db = the consumer's directory instead of its inbox.db: config check exits 2 naming the key,
    status needs a person, trace says which database it could not read; none calls it healthy."""
    config = write_deployment(tmp_path, consumers=("catalog",))
    with_config(config, "replay", "--consumer", "catalog", str(SAMPLES))
    config.write_text(config.read_text().replace('"state/catalog/inbox.db"', '"state/catalog"'))
    not_a_file = f"{tmp_path / 'state/catalog'}: is a directory, not a database file"
    code, _out, err = with_config(config, "config", "check")
    assert 2 == code and f"{config}: consumers.catalog.db: {not_a_file}" in err, err
    code, out, _err = with_config(config, "status", "--offline")
    assert 1 == code and f"NEEDS A PERSON: catalog: {not_a_file}" in out, out
    code, _out, err = with_config(config, "trace", EVENT_ID, "--offline")
    assert 1 == code and one_line(err).endswith(f"; not read: catalog: {not_a_file}"), err


def test_unacked_counts_come_from_the_management_api_when_it_is_named(tmp_path: Path) -> None:
    """management_url set: the queue's messages_unacknowledged, asked with the AMQP URL's
    user and vhost; an endpoint that fails gives None (unknown), never an error."""
    import base64
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from delivery_consumer.ops.deployment import parse_file
    from delivery_consumer.ops.system_view import unacknowledged

    asked: list[tuple[str, str | None]] = []

    class Api(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append((self.path, self.headers.get("Authorization")))
            body = b'{"messages_unacknowledged": 7}' if "catalog" in self.path else b"{}"
            self.send_response(200 if "catalog" in self.path else 500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = tmp_path / "delivery.toml"
        config.write_text(f'amqp_url = "amqp://bob:pw@127.0.0.1:5672/v1"\n'
                          f'management_url = "http://127.0.0.1:{server.server_address[1]}"\n')
        dep = parse_file(config)
        assert 7 == unacknowledged(dep, "delivery.catalog")
        assert unacknowledged(dep, "delivery.audit") is None
    finally:
        server.shutdown()
        server.server_close()
    assert "/api/queues/v1/delivery.catalog" == asked[0][0]
    assert "Basic " + base64.b64encode(b"bob:pw").decode() == asked[0][1]


def test_a_partitioned_consumer_in_the_file_runs_and_is_checked_partition_by_partition(tmp_path: Path) -> None:
    """partitions = N: config check gives each partition its database, queues and run line (metrics port
    + K); run without --partition is one line naming the key; a partition database that records another
    count is refused by config check; a count out of range is refused when the file is read."""
    config = write_deployment(tmp_path, consumers=("catalog",), partitions={"catalog": 2})
    config.write_text(config.read_text().replace("partitions = 2", "partitions = 2\nmetrics_port = 9500"))
    code, out, err = with_config(config, "config", "check", "--json")
    assert 0 == code, err
    catalog = orjson.loads(out)["consumers"][0]
    assert 2 == catalog["partitions"] and catalog["run"] is None
    runs = catalog["partitionRuns"]
    assert [str(tmp_path / f"state/catalog/p{k}/inbox.db") for k in (0, 1)] == [r["database"] for r in runs]
    assert ["delivery.catalog.p0", "delivery.catalog.p1"] == [r["queue"] for r in runs]
    args = shlex.split(runs[1]["run"])
    assert ["--partition", "1", "--partitions", "2"] == args[args.index("--partition"):args.index("--partition") + 4]
    assert "--metrics-port=9501" in args

    code, _out, err = with_config(config, "run", "--consumer", "catalog")
    assert 2 == code and one_line(err) == (f"delivery-consumer: {config}: consumers.catalog: catalog is partitioned "
                                           "(2 partitions): give --partition K (one run per partition)")
    for args, what in ((["dead", "list"], "read its dead queue"), (["dead", "requeue", "--all"], "requeue its dead "
                       "letters"), (["inbox", "prune", "--older-than", "30d"], "prune it")):
        code, _out, err = with_config(config, *args, "--consumer", "catalog")
        assert 2 == code and one_line(err) == (f"delivery-consumer: {config}: consumers.catalog: catalog is "
                                               f"partitioned (2 partitions): give --partition K to {what} (each "
                                               "partition has its own queues and database)"), err

    from delivery_consumer.amqp.partitions import Identity
    from delivery_consumer.consumers import open_db

    open_db(tmp_path / "state/catalog/p1/inbox.db", "catalog", create=True,
            partition=Identity(1, 4)).close()  # a partition of 4, where the file says 2
    code, _out, err = with_config(config, "config", "check")
    assert 2 == code and f"{config}: consumers.catalog.partitions: {tmp_path / 'state/catalog/p1/inbox.db'}: " \
                         "records partition 1 of 4, the file makes it partition 1 of 2" in err, err

    config.write_text(config.read_text().replace("partitions = 2", "partitions = 300"))
    code, _out, err = with_config(config, "status", "--offline")
    assert 2 == code and one_line(err) == f"delivery-consumer: {config}: consumers.catalog.partitions: must be a " \
                                          "partition count (1-256)"
