"""``status`` and the cross-system ``trace`` of a deployment file whose consumer keeps its inbox in
PostgreSQL (``db = "postgresql://..."``): the inbox is read from its schema, named without the URL's
password, beside a consumer whose inbox is a file."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from deploykit import dc
from support import new_event

from delivery_consumer.consumers import catalog
from delivery_consumer.inbox import apply_batch
from delivery_consumer.inbox.pg import PgInboxDB
from delivery_consumer.model.envelope import from_mapping

pytestmark = pytest.mark.postgres


def deployment(tmp_path: Path, url: str) -> Path:
    """catalog in PostgreSQL (its URL with a password, which the server ignores: trust), audit in a file."""
    config = tmp_path / "delivery.toml"
    config.write_text(f'[consumers.catalog]\ndb = "{url}"\n[consumers.audit]\ndb = "state/audit/inbox.db"\n'
                      '[producers.material]\ndb = "producer.db"\n', "utf-8")
    return config


def with_password(url: str) -> str:
    return url.replace("postgres@", "postgres:s3cret@", 1)


def test_status_reads_a_postgresql_inbox_and_never_shows_its_password(pg_url: str, tmp_path: Path) -> None:
    """``status --offline``: the PostgreSQL consumer's receipts of the last hour and its unresolved
    rejection (a problem, as for a file), its database named by the URL without the password and its
    schema; the file consumer not created yet is "no database yet"."""
    events = [from_mapping(new_event(article_id=f"a{i}", revision=2)) for i in range(3)]
    clash = from_mapping(new_event(article_id="a1", revision=2, title="clash"))
    with PgInboxDB.open(pg_url, catalog.SPEC, create=True) as db:
        apply_batch(db, [*events, clash])
    config = deployment(tmp_path, with_password(pg_url))
    done = dc(config, "status", "--offline", "--json")
    assert "s3cret" not in done.stdout + done.stderr
    shown = orjson.loads(done.stdout)
    assert 1 == done.returncode, done.stderr
    by_name = {item["consumer"]: item["databases"][0] for item in shown["consumers"]}
    pg = by_name["catalog"]
    assert (3, {"revision-conflict": 1}) == (pg["receiptsLastHour"], pg["unresolvedRejections"])
    assert pg["database"].endswith("(schema dc_catalog)") and "postgres@" in pg["database"]
    assert "no database yet" == by_name["audit"]["note"]
    assert any(p.startswith("catalog: 1 unresolved rejection") for p in shown["problems"]), shown["problems"]
    text = dc(config, "status", "--offline")
    assert "s3cret" not in text.stdout + text.stderr and "catalog" in text.stdout


def test_an_inbox_not_created_yet_is_no_database_yet(pg_url: str, tmp_path: Path) -> None:
    """A URL whose schema holds no inbox yet (no run started) is "no database yet", not a problem."""
    done = dc(deployment(tmp_path, pg_url), "status", "--offline", "--json")
    shown = orjson.loads(done.stdout)
    assert 0 == done.returncode, done.stdout + done.stderr
    assert ["no database yet"] * 2 == [item["databases"][0]["note"] for item in shown["consumers"]]


def test_trace_across_the_deployment_reads_both_backends(pg_url: str, tmp_path: Path) -> None:
    """``trace EVENT_ID --offline`` follows one event into the PostgreSQL consumer and the file consumer;
    ``trace --key`` finds the key's events in both, with each one's receipt."""
    event = from_mapping(new_event(article_id="a7", revision=3))
    with PgInboxDB.open(pg_url, catalog.SPEC, create=True) as db:
        apply_batch(db, [event])
    config = deployment(tmp_path, with_password(pg_url))
    audit_db = tmp_path / "state" / "audit" / "inbox.db"
    audit_db.parent.mkdir(parents=True)
    from delivery_consumer import consumers

    with consumers.open_db(audit_db, "audit", create=True) as db:
        apply_batch(db, [event])
    done = dc(config, "trace", event.event_id, "--offline", "--json")
    assert 0 == done.returncode, done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    verdicts = {item["consumer"]: item["verdict"] for item in orjson.loads(done.stdout)["consumers"]}
    assert verdicts["catalog"].startswith("applied updated") and verdicts["audit"].startswith("applied recorded")
    keyed = dc(config, "trace", "--key", "a7", "--offline", "--json")
    assert 0 == keyed.returncode, keyed.stderr
    (found,) = orjson.loads(keyed.stdout)["events"]
    assert (event.event_id, {"catalog": "updated", "audit": "recorded"}) == (
        found["eventId"], {k: v["result"] for k, v in found["consumers"].items()})
