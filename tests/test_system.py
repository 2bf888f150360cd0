"""The system view end to end, with real processes and the real broker: a
deployment file with the demo producer and three consumers (catalog, audit,
webhook), events produced, dispatched and consumed, one rejected on purpose;
then ``trace`` and ``status`` tell the whole story, and ``status`` turns
healthy once the dead letter is requeued and applied."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from brokerkit import Namespace
from deploykit import dc, run_until_idle, write_deployment
from webhook_server import WebhookServer

pytestmark = pytest.mark.broker

CONSUMERS = ("catalog", "audit", "webhook")


def produce(config: Path, article: str, title: str) -> str:
    done = dc(config, "produce", "--article", article, "--title", title, "--url", f"https://example.org/{article}",
              "--json")
    assert 0 == done.returncode, done.stderr
    event_id: str = orjson.loads(done.stdout)["eventId"]
    return event_id


def consume_all(config: Path) -> None:
    for consumer in CONSUMERS:
        done = run_until_idle(config, consumer)
        assert 0 == done.returncode, done.stderr[-2000:]


def verdicts(shown: dict[str, object]) -> dict[str, str]:
    return {c["consumer"]: c["verdict"] for c in shown["consumers"]}  # type: ignore[attr-defined]


def test_one_id_tells_the_whole_story_and_status_follows_the_dead_letter(ns: Namespace, tmp_path: Path) -> None:
    """trace of an applied event shows its publication and every consumer's result; trace of
    the rejected one shows its dead letter; status exits 1 until that letter is requeued and applied."""
    with WebhookServer() as server:
        config = write_deployment(tmp_path, ns=ns, webhook_url=server.url)
        fine = produce(config, "a-1", "A fine title")
        refused = produce(config, "a-2", "reject")  # the endpoint answers 400: endpoint-rejected
        sent = dc(config, "dispatch", "--exit-when-idle", "1s", *(f"--consumer={c}" for c in CONSUMERS))
        assert 0 == sent.returncode, sent.stderr[-2000:]
        consume_all(config)

        shown = orjson.loads(dc(config, "trace", fine, "--json").stdout)
        assert shown["outbox"][0]["publishedAt"] is not None and shown["outbox"][0]["attempts"] >= 1
        assert {"catalog": "applied updated", "audit": "applied recorded", "webhook": "applied notified"} == verdicts(
            shown)
        text = dc(config, "trace", fine)
        assert 0 == text.returncode and "published at" in text.stdout and "applied notified" in text.stdout

        shown = orjson.loads(dc(config, "trace", refused, "--json").stdout)
        assert "dead-lettered endpoint-rejected" == verdicts(shown)["webhook"]
        hook = next(c for c in shown["consumers"] if c["consumer"] == "webhook")
        assert f"{ns.prefix}.webhook.dead" == hook["deadQueue"]["queue"]
        assert [refused] == [letter["eventId"] for letter in hook["deadQueue"]["letters"]]
        assert f"{ns.prefix}.webhook.dead" == hook["trace"]["rejections"][0]["deadLetter"]
        text = dc(config, "trace", refused)
        assert f"dead letter NOW in {ns.prefix}.webhook.dead" in text.stdout, text.stdout

        status = dc(config, "status")
        assert 1 == status.returncode, status.stdout + status.stderr
        assert "NEEDS A PERSON: webhook: 1 dead letters" in status.stdout
        shown = orjson.loads(dc(config, "status", "--json").stdout)
        hook_status = next(c for c in shown["consumers"] if c["consumer"] == "webhook")
        assert {"endpoint-rejected": 1} == hook_status["deadByCode"]
        assert 1 == hook_status["databases"][0]["unresolvedRejections"]["endpoint-rejected"]

        server.healed = True
        requeued = dc(config, "dead", "requeue", "--consumer", "webhook", "--event-id", refused)
        assert 0 == requeued.returncode, requeued.stderr
        done = run_until_idle(config, "webhook")
        assert 0 == done.returncode, done.stderr[-2000:]

        status = dc(config, "status")
        assert 0 == status.returncode, status.stdout + status.stderr
        assert "healthy" in status.stdout
        shown = orjson.loads(dc(config, "trace", refused, "--json").stdout)
        assert "applied notified" == verdicts(shown)["webhook"]

        article = orjson.loads(dc(config, "trace", "--article", "a-2", "--json").stdout)
        assert [(1, refused)] == [(e["revision"], e["eventId"]) for e in article["events"]]
        assert {"catalog": "updated", "audit": "recorded", "webhook": "notified"} == {
            label: receipt["result"] for label, receipt in article["events"][0]["consumers"].items()}

        unknown = dc(config, "trace", "0000-nobody")
        assert 1 == unknown.returncode and "known to no producer" in unknown.stderr


def test_status_needs_a_person_for_an_old_outbox_row_and_a_backlog_nobody_consumes(ns: Namespace,
                                                                                     tmp_path: Path) -> None:
    """An unpublished row older than outbox_max_age, and messages waiting with no consumer: exit 1, both named."""
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",), extra='[status]\noutbox_max_age = "0s"')
    produce(config, "a-1", "T")
    assert 0 == dc(config, "topology", "declare", "--consumer", "catalog").returncode
    ns.publish([orjson.dumps({"eventId": "e-1", "type": "material.published", "articleId": "x", "revision": 1,
                              "occurredAt": "2026-11-29T10:00:00Z", "data": {"title": "t", "url": "https://u"}})])
    status = dc(config, "status", "--json")
    assert 1 == status.returncode
    problems = orjson.loads(status.stdout)["problems"]
    assert any("producer material: 1 unpublished rows" in p for p in problems), problems
    assert any(f"1 messages wait in {ns.prefix}.catalog and no consumer is connected" in p for p in problems)
