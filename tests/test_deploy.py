"""deploy/: the Prometheus rules and the Grafana dashboard name only metrics that
a real ``run --metrics-port`` exports, and the systemd unit template verifies."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from brokerkit import Namespace
from partitionkit import Cluster
from support import REPO, new_event, wait_until
from webhook_server import free_port

from delivery_consumer.partitions import partition_of

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "delivery-consumer.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "delivery-consumer.json"
UNIT = DEPLOY / "systemd" / "delivery-consumer@.service"
METRIC = re.compile(r"\b((?:delivery|process)_[a-z_]+)\b")


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def named_metrics() -> set[str]:
    exprs = [rule["expr"] for rule in rules()] + dashboard_exprs()
    return {name for expr in exprs for name in METRIC.findall(expr)}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text: str = answer.read().decode()
        return text


def samples(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of *name*'s samples in an exposition text."""
    found = re.findall(rf"^{name}\{{([^}}]*)\}} ", text, re.M)
    return [dict(re.findall(r'(\w+)="([^"]*)"', labels)) for labels in found]


def exported(text: str) -> set[str]:
    """Sample names, and the families declared by # TYPE (a labelled counter not yet
    incremented has no sample), with the suffixes their samples would carry."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.add(family)
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(kind, [])
            names.update(family + suffix for suffix in suffixes)
    return names


@pytest.mark.broker
def test_every_metric_the_rules_and_dashboard_name_is_in_a_real_scrape(ns: Namespace) -> None:
    """run --metrics-port consumes a good and a bad event; its /metrics holds every name used in deploy/."""
    port = free_port()
    ns.publish([orjson.dumps(new_event()), b"{not json"], routing_key="material.published", declare=["catalog"])
    proc = ns.start_run("catalog", "--metrics-port", str(port))
    def both_counted() -> str | None:
        text = scrape(port)
        return text if 'outcome="updated"' in text and "delivery_dead_letters_total{" in text else None

    try:
        text = wait_until("the good and the bad event on /metrics", both_counted, procs=[proc], ignoring=(OSError,))
        assert re.search(r'delivery_queue_ready\{consumer="catalog",kind="dead",queue="[^"]+"\} 1\.0', text), text
        assert not any("partition" in labels for labels in samples(text, "delivery_queue_up")), text
        missing = named_metrics() - exported(text)
        assert not missing, f"named in deploy/ but not exported by run: {sorted(missing)}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    assert 0 == proc.returncode


@pytest.mark.broker
def test_a_partition_runs_queue_metrics_carry_its_partition_label(ns: Namespace) -> None:
    """run --partition K: the queue depths carry partition="K" as its commit time does, so that
    DeliveryNoCommit (on consumer, partition) pairs partition K's commits with K's queue only."""
    cluster = Cluster(ns, "catalog", 2)
    cluster.declare()
    port = free_port()
    try:
        event = new_event(article_id="metrics-a")
        k = partition_of(event["articleId"], 2)
        cluster.start(k, "--metrics-port", str(port))
        cluster.publish([event])
        def applied() -> str | None:
            text = scrape(port)
            return text if 'outcome="updated"' in text else None

        text = wait_until(f"partition {k}'s event on /metrics", applied, procs=cluster.procs, ignoring=(OSError,))
        queue = f"{ns.prefix}.catalog.p{k}"
        expected = {"consumer": "catalog", "partition": str(k)}
        assert [expected] == samples(text, "delivery_last_commit_timestamp_seconds"), text
        assert [expected] == samples(text, "delivery_queue_up"), text
        for name in ("delivery_queue_ready", "delivery_queue_consumers"):
            assert [{**expected, "kind": "main", "queue": queue}, {**expected, "kind": "dead", "queue": queue + ".dead"}
                    ] == sorted(samples(text, name), key=lambda labels: labels["queue"]), text
    finally:
        cluster.stop()
        cluster.delete()
    assert all(0 == proc.returncode for proc in cluster.procs)


def test_the_alert_rules_are_well_formed() -> None:
    """Every rule has an alert name, an expression, a duration, a severity and a summary;
    promtool agrees when it is installed."""
    found = rules()
    assert {"DeliveryDeadLetters", "DeliveryBacklogWithoutConsumer", "DeliveryNoCommit",
            "DeliveryStoreUnhealthy"} <= {rule["alert"] for rule in found}
    for rule in found:
        assert rule["expr"] and rule["for"] and rule["labels"]["severity"] and rule["annotations"]["summary"], rule
        # A join of two series pairs one partition's with the same partition's (a queue is one partition's).
        for on in re.findall(r"\bon \(([^)]*)\)", rule["expr"]):
            assert {"partition", "queue"} & {label.strip() for label in on.split(",")}, rule
    promtool = shutil.which("promtool")
    if promtool:
        done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
        assert 0 == done.returncode, done.stdout + done.stderr


#: The one way a rule or a panel may read a commit time: the newest over every run of a
#: (consumer, partition). A standby run (single active consumer) never commits and exports 0.
NEWEST_COMMIT = re.compile(r"(\bmax by \(consumer, partition\) \()?delivery_last_commit_timestamp_seconds\b")


def test_a_commit_time_is_the_newest_of_every_run_of_its_partition() -> None:
    """Every rule and panel that reads the last-commit time takes its max by (consumer, partition):
    the standby run of a partition, which exports 0, neither pages nor shows as the partition's."""
    exprs = [rule["expr"] for rule in rules()] + dashboard_exprs()
    reading = [expr for expr in exprs if NEWEST_COMMIT.search(expr)]
    assert any("DeliveryNoCommit" == rule["alert"] and rule["expr"] in reading for rule in rules())
    assert len(reading) >= 2  # the alert and the "Since last commit" panel
    for expr in reading:
        assert all(NEWEST_COMMIT.findall(expr)), expr


def test_the_dashboard_is_grafana_json_with_templated_queries() -> None:
    """Valid JSON, unique panel ids, every query filtered by the consumer variable or job."""
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for expr in dashboard_exprs():
        assert "$consumer" in expr or "$job" in expr, expr


def _exec_start(text: str, instance: str, program: str) -> list[str]:
    """The unit's ExecStart as systemd runs it for *instance*: specifiers and ``$$`` resolved,
    split as systemd splits it (its quoting is the shell's), *program* instead of the installed one."""
    [line] = re.findall(r"^ExecStart=(.*)$", text, re.M)
    line = line.replace("/opt/delivery-consumer/.venv/bin/delivery-consumer", program)
    line = re.sub(r"%(.)", lambda m: {"%": "%", "i": instance}[m.group(1)], line).replace("$$", "$")
    return shlex.split(line)


@pytest.mark.parametrize(("instance", "args"), [
    ("audit", "run --consumer audit --log-format json"),
    ("catalog.p12", "run --consumer catalog --partition 12 --log-format json"),
    ("my.plugin", "run --consumer my.plugin --log-format json"),
])
def test_the_systemd_instance_is_a_consumer_or_one_partition_of_one(instance: str, args: str) -> None:
    """The instance name becomes run's options: NAME, or NAME.pK for partition K."""
    done = subprocess.run(_exec_start(UNIT.read_text(), instance, "/bin/echo"), capture_output=True, text=True,
                          timeout=30)
    assert (0, args) == (done.returncode, done.stdout.strip()), done.stderr


def test_the_systemd_unit_template_kills_the_whole_group_and_verifies(tmp_path: Path) -> None:
    """KillMode=control-group, run is exec'd (the main process); systemd-analyze verify finds nothing
    wrong with an instance of a consumer or of a partition."""
    text = UNIT.read_text()
    assert re.search(r"^KillMode=control-group$", text, re.M)
    assert "exec /opt/delivery-consumer/.venv/bin/delivery-consumer run " in text
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        why = "systemd-analyze is not installed (apt-get install systemd; .ci/run does it)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why + ": the unit was only read, not verified")
    script = Path(sys.executable).parent / "delivery-consumer"
    unit = tmp_path / "delivery-consumer@.service"
    unit.write_text(text.replace("/opt/delivery-consumer/.venv/bin/delivery-consumer", str(script)))
    for instance in ("catalog", "catalog.p1"):
        (tmp_path / f"delivery-consumer@{instance}.service").symlink_to(unit.name)
        done = subprocess.run([analyze, "verify", str(tmp_path / f"delivery-consumer@{instance}.service")],
                              capture_output=True, text=True, timeout=60)
        ours = [line for line in done.stderr.splitlines() if "delivery-consumer@" in line]
        assert 0 == done.returncode and not ours, done.stderr
