"""An event is found by what its producer knows: a CloudEvent by its own id and source (kept with the receipt and
the rejection, shown by trace and inbox show), a rejected event by its key; the replay and inbox show lines say
what happened without repeating or contradicting themselves."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orders_consumer  # registers the orders consumer in this process too
import orjson
import pytest
from support import cli, json_lines, read_rows

from delivery_consumer.model.cloudevents import event_id_for
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.envelope import Envelope
from delivery_consumer.model.errors import TransientError

SOURCE = "/shop/orders"


def cloudevent(ce_id: str, order: str, revision: int, status: str, total: int = 10) -> dict[str, Any]:
    return {"specversion": "1.0", "id": ce_id, "source": SOURCE, "type": "order.placed" if revision == 1 else
            "order.changed", "subject": order, "revision": revision, "time": "2026-12-02T10:00:00Z",
            "data": {"status": status, "totalCents": total}}


@pytest.fixture
def replayed(tmp_path: Path) -> Path:
    """An orders database that replayed CloudEvents: two applied, one whose id was reused for another body,
    one that conflicts with a stored revision."""
    events = [cloudevent("order-1-r1", "order-1", 1, "placed"), cloudevent("order-1-r2", "order-1", 2, "paid"),
              cloudevent("order-1-r1", "order-1", 1, "placed", total=99),  # the same id, another body
              cloudevent("order-1-r2b", "order-1", 2, "shipped")]  # revision 2 again, another state
    source = tmp_path / "events.ndjson"
    source.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    db = tmp_path / "orders.db"
    done = cli(["replay", "--consumer", "orders", "--db", str(db), "--json", str(source)])
    assert 1 == done.exit_code, done.output
    assert ["updated", "updated", "event-id-reused", "revision-conflict"] == [
        line.get("result") or line.get("rejected") for line in json_lines(done.stdout)]
    return db


def test_receipts_and_rejections_keep_the_cloudevents_source_and_id(replayed: Path) -> None:
    """The receipt of a CloudEvent and the rejection of one keep its source and id as its producer sent them,
    and a rejection the key of its event."""
    origins = dict(read_rows(replayed, "inbox", "event_id, origin"))
    assert {"id": "order-1-r2", "source": SOURCE} == orjson.loads(origins[event_id_for(SOURCE, "order-1-r2")])
    rejected = read_rows(replayed, "rejected", "code, origin, partition_key")
    assert [("event-id-reused", {"id": "order-1-r1", "source": SOURCE}, "order-1"),
            ("revision-conflict", {"id": "order-1-r2b", "source": SOURCE}, "order-1")] == [
        (code, orjson.loads(origin), key) for code, origin, key in rejected]


def test_trace_finds_a_cloudevent_by_the_id_its_producer_knows_and_shows_it(replayed: Path) -> None:
    """trace ID, ID a CloudEvent's id (not a UUID), finds its event without --ce-source, says which eventId it
    maps to, and shows the source and id in its text and JSON; an id nobody sent exits 1 naming --ce-source."""
    done = cli(["trace", "--consumer", "orders", "--db", str(replayed), "order-1-r2"])
    assert 0 == done.exit_code, done.output
    assert f"eventId:    {event_id_for(SOURCE, 'order-1-r2')}" in done.stdout
    assert f"cloudEvent: order-1-r2 from {SOURCE}" in done.stdout
    shown = orjson.loads(cli(["trace", "--consumer", "orders", "--db", str(replayed), "--json", "order-1-r1"]).stdout)
    assert {"id": "order-1-r1", "source": SOURCE} == shown["cloudEvent"] == shown["receipt"]["cloudEvent"]
    assert [{"id": "order-1-r1", "source": SOURCE}] == [r["cloudEvent"] for r in shown["rejections"]]
    missing = cli(["trace", "--consumer", "orders", "--db", str(replayed), "order-7-r1"])
    assert 1 == missing.exit_code and "--ce-source" in missing.stderr


def test_trace_of_a_revision_conflict_names_its_key_and_shows_the_keys_row(replayed: Path) -> None:
    """A revision-conflict has no receipt; its rejection keeps the key, so trace shows the key's row instead of
    'orderId: unknown'."""
    done = cli(["trace", "--consumer", "orders", "--db", str(replayed), "--json", "order-1-r2b"])
    assert 0 == done.exit_code, done.output
    shown = orjson.loads(done.stdout)
    assert ("rejected", "order-1") == (shown["status"], shown["rejections"][0]["key"])
    keyed = shown["key"]
    assert ("orderId", "order-1", "paid") == (keyed["field"], keyed["value"], keyed["row"]["status"])
    text = cli(["trace", "--consumer", "orders", "--db", str(replayed), "order-1-r2b"]).stdout
    assert "orderId order-1:" in text and "unknown" not in text


def test_inbox_show_counts_deliveries_as_trace_does_and_names_the_cloudevent(replayed: Path) -> None:
    """inbox show of an event applied at its first delivery says 1 delivery (its receipt stands for it), as
    trace does, and names the CloudEvent it came as."""
    event_id = event_id_for(SOURCE, "order-1-r2")
    shown = cli(["inbox", "show", "--consumer", "orders", "--db", str(replayed), event_id])
    assert 0 == shown.exit_code, shown.output
    fields = dict(line.split(":", 1) for line in shown.stdout.splitlines() if ":" in line and not line[0].isspace())
    assert "1 (the applying one known from the receipt)" == fields["deliveries"].strip()
    assert f"order-1-r2 from {SOURCE}" == fields["cloudEvent"].strip()
    traced = orjson.loads(cli(["trace", "--consumer", "orders", "--db", str(replayed), "--json", event_id]).stdout)
    assert 1 == traced["deliveries"]["deliveries"]


def _busy(conn: sqlite3.Connection, env: Envelope) -> str:
    raise TransientError("the ledger is being closed")  # the default code: "transient"


def _named(conn: sqlite3.Connection, env: Envelope) -> str:
    raise TransientError("rate limited", code="rate-limited")


@pytest.mark.parametrize(("effect", "line", "summary"), [
    (_busy, "not applied, transient: the ledger is being closed", "1 not applied, transient"),
    (_named, "not applied, transient rate-limited: rate limited", "1 not applied, transient (1 rate-limited)"),
])
def test_replay_says_transient_once(tmp_path: Path, register: Callable[[ConsumerSpec], ConsumerSpec],
                                    effect: Callable[[sqlite3.Connection, Envelope], str], line: str,
                                    summary: str) -> None:
    """A TransientError with its default code reads 'transient: reason', not 'transient transient'; a named
    code is given once, in the line and the summary."""
    register(ConsumerSpec("ledger", effect, ("CREATE TABLE ledger (x TEXT) STRICT;",),
                          event_types=orders_consumer.TYPES))
    source = tmp_path / "one.ndjson"
    source.write_bytes(orjson.dumps(cloudevent("order-1-r1", "order-1", 1, "placed")) + b"\n")
    done = cli(["replay", "--consumer", "ledger", "--db", str(tmp_path / "ledger.db"), str(source)])
    assert 1 == done.exit_code
    first, *_ = done.output.splitlines()
    assert f"{event_id_for(SOURCE, 'order-1-r1')} {line} ({source}:1)" == first
    assert done.output.strip().endswith(f"1 event: {summary}")
    assert "transient transient" not in done.output


def test_the_system_trace_finds_a_cloudevent_by_its_id_across_the_deployment(replayed: Path, tmp_path: Path) -> None:
    """trace ID without --consumer, ID a CloudEvent's id, looks in every consumer of the deployment file, names
    the eventId it maps to and traces it there; an id two sources used is listed, not guessed."""
    config = tmp_path / "delivery.toml"
    config.write_text(f'[consumers.orders]\ndb = "{replayed}"\n', "utf-8")
    done = cli(["--config", str(config), "trace", "--offline", "--json", "order-1-r2"],
               env={"DELIVERY_PLUGINS": "orders_consumer"})
    assert 0 == done.exit_code, done.output
    shown = json_lines(done.stdout)[0]
    assert event_id_for(SOURCE, "order-1-r2") == shown["eventId"]
    assert "applied updated" == shown["consumers"][0]["verdict"]
    other = tmp_path / "other.ndjson"
    other.write_bytes(orjson.dumps({**cloudevent("order-1-r2", "order-9", 1, "placed"), "source": "/legacy"}) + b"\n")
    assert 0 == cli(["replay", "--consumer", "orders", "--db", str(replayed), str(other)]).exit_code
    twice = cli(["--config", str(config), "trace", "--offline", "order-1-r2"],
                env={"DELIVERY_PLUGINS": "orders_consumer"})
    assert 2 == twice.exit_code and "names several events" in twice.output and "--ce-source" in twice.output
