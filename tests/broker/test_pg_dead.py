"""The dead queue's commands and ``inbox prune`` against a consumer whose inbox is in PostgreSQL
(``--db postgresql://...``): the receipts they read, the rejections they resolve, the receipts prune
keeps for events still in the dead queue -- real broker, the test's own PostgreSQL database."""

from __future__ import annotations

import orjson
import pytest
from brokerkit import Namespace
from support import new_event

from delivery_consumer.amqp.admin import declare
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.consumers import catalog
from delivery_consumer.inbox import apply_batch
from delivery_consumer.inbox.pg import PgInboxDB
from delivery_consumer.model.deliveries import OutMessage
from delivery_consumer.model.envelope import body_digest, from_mapping

pytestmark = pytest.mark.postgres


def test_dead_letters_and_prune_on_a_postgresql_inbox(ns: Namespace, pg_url: str) -> None:
    """Two dead letters: one whose event was applied anyway (another copy), one never applied with its
    rejection row. ``dead list`` tells the applied one by its receipt; ``inbox prune`` keeps the receipt
    of the event in the dead queue and deletes the other old one; ``dead requeue --all`` requeues the
    other, leaves the applied one, and resolves the requeued one's rejection."""
    applied_body, other_body = (new_event(article_id="a-1"), new_event(article_id="a-2"))
    old = new_event(article_id="a-3")
    with PgInboxDB.open(pg_url, catalog.SPEC, create=True) as db:
        apply_batch(db, [from_mapping(applied_body), from_mapping(old)])
        db.conn.execute("UPDATE inbox SET received_at = '2020-01-01T00:00:00.000Z'")
        topo = ns.topology("catalog")
        db.conn.execute("INSERT INTO rejected (code, reason, event_id, body_sha256, dead_letter, rejected_at)"
                        " VALUES ('handler-error', 'x', ?, ?, ?, '2026-01-01T00:00:00.000Z')",
                        (other_body["eventId"], body_digest(orjson.dumps(other_body)), topo.dead_queue))
    declare(ns.url, [topo])
    with Publisher(ns.url) as pub:
        assert all(r.ok for r in pub.publish([
            OutMessage(topo.dead_queue, orjson.dumps(body), message_id=body["eventId"])
            for body in (applied_body, other_body)]))
    where = ["--consumer", "catalog", "--db", pg_url]
    listed = ns.cli("dead", "list", *where, "--json")
    assert 0 == listed.returncode, listed.stderr
    receipts = {m["eventId"]: m.get("receipt") for m in orjson.loads(listed.stdout)["messages"]}
    assert ({"result": "updated", "sameBody": True}, None) == (receipts[applied_body["eventId"]],
                                                                receipts[other_body["eventId"]])
    pruned = ns.cli("inbox", "prune", *where, "--older-than", "30d", "--json")
    assert 0 == pruned.returncode, pruned.stderr
    report = orjson.loads(pruned.stdout)
    assert (1, 1) == (report["receipts"], report["keptInDeadQueue"])
    requeued = ns.cli("dead", "requeue", *where, "--all", "--json")
    assert 1 == requeued.returncode, requeued.stderr + requeued.stdout  # one left behind: exit 1
    outcomes = {i["eventId"]: i["outcome"] for i in orjson.loads(requeued.stdout)["items"]}
    assert {applied_body["eventId"]: "left", other_body["eventId"]: "requeued"} == outcomes
    assert 1 == ns.count(topo.queue) and 1 == ns.count(topo.dead_queue)
    with PgInboxDB.open(pg_url, catalog.SPEC) as db:
        assert [(applied_body["eventId"],)] == db.conn.execute("SELECT event_id FROM inbox").fetchall()
        assert [(1,)] == db.conn.execute("SELECT count(*) FROM rejected WHERE resolved_at IS NOT NULL").fetchall()
