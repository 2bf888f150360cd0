"""The system view end to end, with real processes and the real broker: a
deployment file with the demo producer and three consumers (catalog, audit,
webhook), events produced, dispatched and consumed, one rejected on purpose;
then ``trace`` and ``status`` tell the whole story, and ``status`` turns
healthy once the dead letter is requeued and applied."""

from __future__ import annotations

import html
import re
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from urllib.request import Request, urlopen

import orjson
import pytest
from brokerkit import Namespace, RunProcess
from deploykit import dc, deploy_env, run_until_idle, write_deployment
from partitionkit import Cluster
from support import wait_until
from test_console import ConsoleProcess
from webhook_server import WebhookServer

from delivery_consumer.amqp.partitions import partition_of
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.model.deliveries import OutMessage

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
        assert "NEEDS A PERSON: webhook: 1 dead letter in" in status.stdout
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

        unknown = dc(config, "trace", "00000000-0000-4000-8000-000000000000")
        assert 1 == unknown.returncode and "known to no producer" in unknown.stderr


def test_an_applied_event_whose_other_copy_was_dead_lettered_is_applied_in_the_verdict(ns: Namespace,
                                                                                      tmp_path: Path) -> None:
    """An event applied by a consumer whose eventId came again with another body (that copy dead-lettered
    event-id-reused, still in the dead queue) is 'applied ...' in the system trace's verdict, the other copy
    named beside it, as the consumer's own trace says: never 'dead-lettered event-id-reused'."""
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog",))
    first = {"eventId": str(uuid.uuid4()), "type": "material.published", "articleId": "a-1", "revision": 1,
             "occurredAt": "2026-11-29T10:00:00Z", "data": {"title": "T", "url": "https://example.org/a-1"}}
    again = {**first, "data": {"title": "Another title", "url": "https://example.org/a-1"}}
    ns.publish([orjson.dumps(first), orjson.dumps(again)], declare=["catalog"])
    done = run_until_idle(config, "catalog")
    assert 0 == done.returncode, done.stderr[-2000:]
    shown = orjson.loads(dc(config, "trace", first["eventId"], "--json").stdout)
    (catalog,) = shown["consumers"]
    assert ["event-id-reused"] == [letter["code"] for letter in catalog["deadQueue"]["letters"]]
    assert "applied updated; another copy dead-lettered event-id-reused (still in the dead queue)" == catalog[
        "verdict"]
    offline = orjson.loads(dc(config, "trace", first["eventId"], "--json", "--offline").stdout)
    assert "applied updated; another copy was rejected (event-id-reused)" == offline["consumers"][0]["verdict"]


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
    assert any("producer material: 1 pending row, the oldest" in p for p in problems), problems
    assert any(f"1 message waits in {ns.prefix}.catalog and no consumer is connected" in p for p in problems)


def _partitioned_status(shown: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in shown["consumers"] if c["consumer"] == "catalog")


def test_a_partitioned_consumer_is_declared_from_the_file_and_shown_partition_by_partition(
        ns: Namespace, tmp_path: Path) -> None:
    """topology declare without flags declares what the file says (catalog in 2 partitions, audit); status
    gives each partition its own queue, consumers, dead letters and receipts, and the unrouted queue when a
    message waits there; trace points at the article's partition; the console purges the partition's dead
    letter; healthy again once the unrouted message is rerouted and applied."""
    config = write_deployment(tmp_path, ns=ns, consumers=("catalog", "audit"), partitions={"catalog": 2})
    cluster = Cluster(ns, "catalog", 2)
    try:
        declared = dc(config, "topology", "declare")
        assert 0 == declared.returncode, declared.stderr
        assert f"-> {ns.prefix}.catalog.p0 .. {ns.prefix}.catalog.p1" in declared.stdout, declared.stdout
        assert f"-> {ns.prefix}.audit; also declared, not bound: {ns.prefix}.audit.dead," in declared.stdout, (
            declared.stdout)
        declared = dc(config, "topology", "declare", "--consumer", "audit")  # the flag chooses
        assert ["audit"] == [line.split(":")[0] for line in declared.stdout.splitlines()], declared.stdout
        article = {partition_of(f"a-{i}", 2): f"a-{i}" for i in range(20)}  # one article per partition
        first = [produce(config, article[k], f"T{k}") for k in (0, 1)]
        sent = dc(config, "dispatch", "--exit-when-idle", "1s")
        assert 0 == sent.returncode, sent.stderr[-2000:]
        conflict = {"eventId": str(uuid.uuid4()), "type": "material.published", "articleId": article[1],
                    "revision": 1, "occurredAt": "2026-12-01T10:00:00Z",
                    "data": {"title": "another state", "url": "https://example.org/x"}}
        ns.publish([orjson.dumps(conflict)])  # with its slot headers: to p1, where revision 1 differs
        stray = {**conflict, "eventId": str(uuid.uuid4())}
        stray["articleId"] = next(f"s-{i}" for i in range(99) if partition_of(f"s-{i}", 2) == 0)  # p0 runs below
        with Publisher(ns.url, exchanges=[ns.exchange]) as publisher:  # no slot headers: no partition
            assert all(r.ok for r in publisher.publish([OutMessage(
                "material.published", orjson.dumps(stray), ns.exchange, stray["eventId"])]))
        for k in (0, 1):
            done = run_until_idle(config, "catalog", "--partition", str(k))
            assert 0 == done.returncode, done.stderr[-2000:]
        assert 0 == run_until_idle(config, "audit").returncode

        serving = RunProcess([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "catalog",
                              "--partition", "0"], cwd=tmp_path, env=deploy_env(config))
        cluster.procs.append(serving)
        wait_until("p0 consuming", lambda: "consuming " in serving.output()[1], 60, [serving])
        status = dc(config, "status", "--json")
        assert 1 == status.returncode, status.stderr
        shown = orjson.loads(status.stdout)
        catalog = _partitioned_status(shown)
        assert 2 == catalog["partitions"]
        rows = {row["partition"]: row for row in catalog["databases"]}
        assert {"p0": f"{ns.prefix}.catalog.p0", "p1": f"{ns.prefix}.catalog.p1"} == {
            k: row["queue"] for k, row in rows.items()}
        assert (1, 0) == (rows["p0"]["consumersConnected"], rows["p1"]["consumersConnected"])
        assert (0, 1) == (rows["p0"]["deadLetters"], rows["p1"]["deadLetters"])
        assert {"revision-conflict": 1} == rows["p1"]["deadByCode"] and {} == rows["p0"]["deadByCode"]
        assert (1, 1) == (rows["p0"]["receiptsLastHour"], rows["p1"]["receiptsLastHour"])
        assert {"queue": f"{ns.prefix}.catalog.unrouted", "ready": 1} == catalog["unrouted"]
        assert any(p.startswith(f"catalog/p1: 1 dead letter in {ns.prefix}.catalog.p1.dead") for p in
                   shown["problems"]), shown["problems"]
        assert any(p.startswith(f"catalog: 1 message in {ns.prefix}.catalog.unrouted") for p in shown["problems"])
        text = dc(config, "status").stdout
        assert re.search(r"^catalog/p1 +0 +- +0 +1 \(1 revision-conflict\)", text, re.M), text
        assert re.search(r"^catalog/unrouted +1 ", text, re.M), text

        traced = orjson.loads(dc(config, "trace", conflict["eventId"], "--json").stdout)
        verdict = {c["consumer"] + (f"/{c['partition']}" if c["partition"] else ""): c["verdict"]
                   for c in traced["consumers"]}
        assert "dead-lettered revision-conflict" == verdict["catalog/p1"]
        assert verdict["catalog/p0"].startswith("not this partition's event") and "applied recorded" == verdict["audit"]
        text = dc(config, "trace", first[0]).stdout
        assert f"consumer catalog/p1: not this partition's key (articleId {article[0]} lives in p0)" in text, text
        assert re.search(r"^  catalog/p0 +applied updated$", text, re.M), text

        console = ConsoleProcess(config, "--allow-actions")  # the partition's dead letter, purged from the page
        try:
            with urlopen(console.url, timeout=60) as answer:
                page = answer.read().decode()
            assert f"<h3>catalog/p1 <small>{ns.prefix}.catalog.p1.dead</small></h3>" in page, page
            link = re.search(r'href="/(dead/confirm\?[^"]*action=purge[^"]*)"', page)
            assert link is not None and "partition=p1" in link.group(1), page
            with urlopen(console.url + html.unescape(link.group(1)), timeout=60) as answer:
                confirm = answer.read().decode()
            assert "1 dead letter of <b>catalog/p1</b>" in confirm, confirm
            form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm))
            with urlopen(Request(console.url + "dead/purge", data=urlencode(form).encode()), timeout=60) as answer:
                assert '<p id="result">1 purged</p>' in answer.read().decode()
        finally:
            console.stop()
        assert 0 == ns.count(f"{ns.prefix}.catalog.p1.dead")
        assert 0 == dc(config, "reroute", "--consumer", "catalog").returncode
        wait_until("the stray applied in its partition", lambda: "healthy" in dc(config, "status").stdout, 60,
                   [serving])
        assert 0 == dc(config, "status").returncode
    finally:
        cluster.stop()
        cluster.delete()
