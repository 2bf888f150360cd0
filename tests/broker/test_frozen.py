"""A frozen active (SIGSTOP of its whole run): its standby names it and how long it has been
silent (log, metrics, status), the alert fires on what the standby exports, and the standby takes
over once the holder is proven frozen; continued, the old active stops by itself (exit 75) and acks
nothing. Ledger: every event of the partition applied exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

import pytest
import yaml
from brokerkit import freeze_session
from deploykit import dc, write_deployment
from partitionkit import Cluster, make_events, model
from support import REPO, count_rows, read_rows, wait_until
from webhook_server import free_port

from delivery_consumer.amqp.partitions import partition_of

pytestmark = pytest.mark.broker

PARTITIONS = 2
RULES = REPO / "deploy" / "prometheus" / "delivery-consumer.rules.yml"


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def _writer_lines(text: str) -> dict[str, str]:
    return {line.split("{")[0]: line for line in text.splitlines() if line.startswith("delivery_writer_")}


def test_a_frozen_active_is_named_and_its_standby_takes_over_safely(cluster: Cluster, tmp_path: object) -> None:
    """Partition 0's active run is SIGSTOPped whole. Its standby (--take-over-after 3s) reports the
    holder stopped with a growing silence on /metrics, status names it, the DeliveryWriterFrozen
    rule fires on those series; the standby takes over ("frozen"), and applies the partition's
    events once the broker gives it the queue. SIGCONT: the old active stops by itself (exit 75,
    "took this database over"), acking nothing; every event of partition 0 has exactly one
    receipt and the catalog equals the model."""
    port = free_port()
    active = cluster.start(0)
    first = make_events(300, 60)
    cluster.publish(first)
    mine = [e for e in first if partition_of(str(e["articleId"]), PARTITIONS) == 0]
    wait_until("the active to apply its partition", lambda: count_rows(cluster.db(0), "inbox") == len(mine), 120,
               [active])
    standby = cluster.start(0, "--metrics-port", str(port), "--take-over-after", "3s")
    freeze_session(active.pid)
    try:
        lines = wait_until("the standby to report the frozen holder", lambda: (
            found if "delivery_writer_stopped" in (found := _writer_lines(_scrape(port)))
            and found["delivery_writer_stopped"].endswith(" 1.0") else None), 60, [standby], ignoring=(OSError,))
        assert f'holder="{active.pid}"' in lines["delivery_writer_heartbeat_age_seconds"]
        config = write_deployment(cluster.ns.workdir, ns=cluster.ns, consumers=("catalog",), partitions={"catalog": 2})
        status = dc(config, "status", "--json")
        assert status.returncode in (0, 1) and f"writer pid {active.pid}" in status.stdout \
            and "is stopped" in status.stdout, status.stdout + status.stderr
        err = standby.wait_for_log("taking over")
        assert "is frozen" in err and f"pid {active.pid}" in err, err
        second = make_events(300, 60, seed=5)
        for e in second:
            e["revision"] = int(e["revision"]) + 1000
        cluster.publish(second)
        mine += [e for e in second if partition_of(str(e["articleId"]), PARTITIONS) == 0]
        wait_until("the standby to apply the partition", lambda: count_rows(cluster.db(0), "inbox") == len(mine),
                   300, [standby])
    finally:
        os.killpg(active.pid, signal.SIGCONT)
    try:
        active.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the old active did not stop:\n{active.output()[1][-3000:]}") from None
    err = active.output()[1]
    assert active.returncode == 75, err[-3000:]
    assert "took this database over" in err.strip().splitlines()[-1], err[-3000:]
    assert len(read_rows(cluster.db(0), "inbox", "DISTINCT event_id")) == len(mine) == count_rows(cluster.db(0),
                                                                                                  "inbox")
    catalog = {a: (r, t, p) for a, r, t, p in read_rows(cluster.db(0), "catalog",
                                                         "article_id, revision, title, published")}
    assert catalog == model(mine)
    _alert_fires_on(lines["delivery_writer_heartbeat_age_seconds"], tmp_path)


def _alert_fires_on(series_line: str, tmp_path: object) -> None:
    """DeliveryWriterFrozen fires (promtool) on the standby's series, its silence growing as
    scraped, with the holder's label; not for a holder that is silent but not stopped (a hung
    worker is DeliveryWorkerStuck's)."""
    from pathlib import Path

    labels = series_line.split("{", 1)[1].split("}", 1)[0]
    pairs = dict(part.split("=", 1) for part in labels.split(","))
    exp = {k: v.strip('"') for k, v in pairs.items()} | {"severity": "page"}
    series = f"delivery_writer_heartbeat_age_seconds{{{labels}}}"
    stopped = f"delivery_writer_stopped{{{labels}}}"
    (rule,) = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
               if r.get("alert") == "DeliveryWriterFrozen"]
    annotations = {"summary": f"{exp['consumer']}: pid {exp['holder']} holds the database, stopped, and has not "
                              "heartbeated for 5m 5s", "description": rule["annotations"]["description"]}
    test = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": [{"series": series, "values": "5+60x5"},
                                            {"series": stopped, "values": "1x5"}],
         "alert_rule_test": [{"eval_time": "5m", "alertname": "DeliveryWriterFrozen", "exp_alerts": [
             {"exp_labels": exp, "exp_annotations": annotations}]}]},
        {"interval": "1m", "input_series": [{"series": series, "values": "5+60x5"},
                                            {"series": stopped, "values": "0x5"}],
         "alert_rule_test": [{"eval_time": "5m", "alertname": "DeliveryWriterFrozen", "exp_alerts": []}]},
    ]}
    path = Path(str(tmp_path)) / "frozen.test.yml"
    path.write_text(yaml.safe_dump(test))
    done = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
