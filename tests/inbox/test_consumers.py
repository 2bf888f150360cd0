"""Consumers: the registry, a third consumer added without touching the store,
and the contract every consumer meets."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from support import (
    TESTS,
    OpenDB,
    cli,
    console_script,
    effect_and_inbox,
    env,
    json_lines,
    make_envelope,
    ndjson,
    new_event,
    read_rows,
    rows,
    subprocess_env,
)

from delivery_consumer import consumers
from delivery_consumer.inbox import ConsumerDB, apply_event
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.envelope import from_mapping
from delivery_consumer.model.errors import EVENT_ID_REUSED, ConfigError, DatabaseError, Rejection
from delivery_consumer.ops.partition_databases import split_merge

# -- the registry -------------------------------------------------------------


def test_builtin_consumers_are_known() -> None:
    """catalog and audit are available by name, with their effect tables."""
    assert ("catalog", ("catalog",)) == (consumers.get("catalog").name, tuple(consumers.get("catalog").tables))
    assert ("audit", ("audit",)) == (consumers.get("audit").name, tuple(consumers.get("audit").tables))
    assert {"catalog", "audit"} <= set(consumers.names())


def test_unknown_consumer_lists_the_known_ones() -> None:
    """Asking for an unknown consumer is a ConfigError naming the known ones."""
    with pytest.raises(ConfigError, match=r"unknown consumer 'nope' \(known: .*audit.*catalog"):
        consumers.get("nope")


def test_a_name_cannot_be_registered_twice(counter: ConsumerSpec) -> None:
    """Registering another spec under a taken name is refused unless replace is asked for."""
    impostor = ConsumerSpec(name="counter", apply=counter.apply, migrations=())

    with pytest.raises(ConfigError, match="already registered"):
        consumers.register(impostor)
    assert counter is consumers.get("counter")
    assert counter is consumers.register(counter)  # the same spec again is fine


def test_unregister_forgets_a_consumer(counter: ConsumerSpec) -> None:
    """After unregister, the test consumer is unknown again."""
    consumers.unregister("counter")

    with pytest.raises(ConfigError):
        consumers.get("counter")


# -- a third consumer, defined only in the tests -------------------------------------


def test_counter_consumer_through_the_library(counter: ConsumerSpec, open_db: OpenDB) -> None:
    """The counter consumer gets its own tables and the inbox absorbs its duplicates."""
    db = open_db("counter")
    first, second = new_event(), new_event(revision=2)

    results = [apply_event(db, from_mapping(e)) for e in (first, second, first, second, first)]

    assert ["counted", "counted", "duplicate:counted", "duplicate:counted", "duplicate:counted"] == results
    assert [("article-42", 2, second["eventId"])] == rows(db, "counter")
    assert "counter" == db.meta()["consumer"]


def _counter_events() -> list[dict[str, object]]:
    """Five distinct events over two articles (with a stale one: the counter counts it too)."""
    return [
        new_event(revision=1),
        new_event(revision=2),
        new_event(revision=1),
        new_event(article_id="article-7", revision=1),
        new_event(article_id="article-7", revision=3),
    ]


def test_counter_consumer_through_the_cli(counter: ConsumerSpec, tmp_path: Path) -> None:
    """init and replay work for the new consumer; redelivered events are not counted twice."""
    db = tmp_path / "counter.db"
    events = _counter_events()
    source = tmp_path / "events.ndjson"
    source.write_bytes(ndjson([*events, events[0], events[3], events[0]]))

    init = cli(["init", "--consumer", "counter", "--db", str(db)])
    first = cli(["replay", "--consumer", "counter", "--db", str(db), "--json", str(source)])
    again = cli(["replay", "--db", str(db), "--batch", "3", "--json", str(source)])

    assert 0 == init.exit_code, init.output
    assert (0, 0) == (first.exit_code, again.exit_code), first.output + again.output
    assert ["counted"] * 5 + ["duplicate:counted"] * 3 == [line["result"] for line in json_lines(first.stdout)]
    assert ["duplicate:counted"] * 8 == [line["result"] for line in json_lines(again.stdout)]
    assert [("article-42", 3), ("article-7", 2)] == read_rows(db, "counter", "article_id, events")
    assert 5 == len(read_rows(db, "inbox"))


def test_counter_consumer_loaded_from_delivery_plugins(tmp_path: Path) -> None:
    """In another process, DELIVERY_PLUGINS imports the test module, which registers the consumer."""
    db = tmp_path / "state" / "counter" / "inbox.db"
    events = _counter_events()
    (tmp_path / "events.ndjson").write_bytes(ndjson([*events, events[1]]))
    child_env = subprocess_env(DELIVERY_PLUGINS="counter_consumer", PYTHONPATH=str(TESTS))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [console_script(), *args], cwd=tmp_path, env=child_env, capture_output=True, text=True, timeout=60
        )

    init = run("init", "--consumer", "counter")
    replay = run("replay", "--consumer", "counter", "--batch", "2", "events.ndjson")

    assert 0 == init.returncode, init.stderr
    assert 0 == replay.returncode, replay.stderr
    assert "6 events: 5 counted, 1 duplicate:counted" == replay.stdout.splitlines()[-1]
    assert [("article-42", 3), ("article-7", 2)] == read_rows(db, "counter", "article_id, events")


def test_plugin_consumer_views_through_the_cli(counter: ConsumerSpec, tmp_path: Path) -> None:
    """A DELIVERY_PLUGINS consumer gets list, show and its article in trace from its spec's view,
    over one database and, the same, over a partition directory."""
    events = _counter_events()
    (tmp_path / "events.ndjson").write_bytes(ndjson(events))
    child_env = subprocess_env(DELIVERY_PLUGINS="counter_consumer", PYTHONPATH=str(TESTS))

    def run(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([console_script(), *args], cwd=tmp_path, env=child_env, capture_output=True,
                              text=True, timeout=60)
        assert code == done.returncode, done.stderr
        return done

    run("replay", "--consumer", "counter", "events.ndjson")
    for partitioned in (False, True):
        if partitioned:
            split_merge("counter", 2, tmp_path / "state")
        listed = run("counter", "list").stdout.splitlines()
        shown = orjson.loads(run("counter", "show", "article-7", "--json").stdout)
        traced = orjson.loads(run("trace", "--consumer", "counter", "--json", str(events[4]["eventId"])).stdout)
        older = run("trace", "--consumer", "counter", str(events[3]["eventId"]), "--article", "article-7").stdout
        missing = run("counter", "show", "article-0", code=1).stderr

        assert ["articleId", "events", "lastEventId"] == listed[0].split()
        assert [["article-42", "3"], ["article-7", "2"]] == [line.split()[:2] for line in listed[2:]]
        shown.pop("partition", None)
        assert {"articleId": "article-7", "events": 2, "lastEventId": events[4]["eventId"]} == shown
        assert (2, True) == (traced["key"]["row"]["events"], traced["key"]["row"]["currentEvent"])
        assert re.search(r"^articleId article-7:\n  articleId:\s+article-7\n  events:\s+2\n", older, re.M)
        assert "articleId article-0 not found" in missing and "Traceback" not in missing
    assert (tmp_path / "state" / "counter" / "p1" / "inbox.db").is_file()


def test_unimportable_plugin_is_one_clear_error(tmp_path: Path) -> None:
    """A DELIVERY_PLUGINS module that cannot be imported: exit 2, one line naming it, no traceback."""
    result = subprocess.run(
        [console_script(), "init", "--consumer", "counter", "--db", str(tmp_path / "c.db")],
        env=subprocess_env(DELIVERY_PLUGINS="no_such_plugin_module"),
        capture_output=True, text=True, timeout=60,
    )

    assert 2 == result.returncode
    assert "no_such_plugin_module" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "c.db").exists()


# -- the contract every consumer meets ---------------------------------------------


@pytest.fixture(params=["catalog", "audit", "counter"])
def any_db(request: pytest.FixtureRequest, open_db: OpenDB) -> Iterator[ConsumerDB]:
    """A fresh database of each consumer in turn (the test-only counter included)."""
    if request.param == "counter":
        request.getfixturevalue("counter")
    yield open_db(request.param)


def test_contract_redelivery_is_a_duplicate_of_the_first_result(any_db: ConsumerDB) -> None:
    """For every consumer: a redelivery answers duplicate:<first result> and changes no table."""
    first = apply_event(any_db, env())
    before = effect_and_inbox(any_db)

    assert f"duplicate:{first}" == apply_event(any_db, env())
    assert before == effect_and_inbox(any_db)


def test_contract_event_id_reuse_is_rejected_without_effect(any_db: ConsumerDB) -> None:
    """For every consumer: the same eventId with another body is rejected and changes no table."""
    apply_event(any_db, env())
    before = effect_and_inbox(any_db)

    with pytest.raises(Rejection) as info:
        apply_event(any_db, env(title="Другой заголовок"))

    assert EVENT_ID_REUSED == info.value.code
    assert before == effect_and_inbox(any_db)
    assert [(EVENT_ID_REUSED,)] == read_rows(any_db.path, "rejected", "code")


def test_contract_effect_and_receipt_commit_together(any_db: ConsumerDB) -> None:
    """For every consumer: after a commit both the effect and the receipt are visible to another reader."""
    result = apply_event(any_db, env())
    effect_table = any_db.spec.tables[0]

    assert [(make_envelope()["eventId"], result)] == read_rows(any_db.path, "inbox", "event_id, result")
    assert 1 == len(read_rows(any_db.path, effect_table))


def test_contract_database_belongs_to_one_consumer(any_db: ConsumerDB) -> None:
    """For every consumer: its database refuses to be opened as another consumer."""
    other = "audit" if any_db.consumer != "audit" else "catalog"

    with pytest.raises(DatabaseError, match=f"belongs to consumer '{any_db.consumer}'"):
        consumers.open_db(any_db.path, other)
