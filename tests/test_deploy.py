"""deploy/: the Prometheus rules and the Grafana dashboard name only metrics that
a real ``run --metrics-port`` exports, and the systemd unit template verifies."""

from __future__ import annotations

import json
import os
import re
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
from support import REPO, new_event, wait_until
from webhook_server import free_port

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
        missing = named_metrics() - exported(text)
        assert not missing, f"named in deploy/ but not exported by run: {sorted(missing)}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
    assert 0 == proc.returncode


def test_the_alert_rules_are_well_formed() -> None:
    """Every rule has an alert name, an expression, a duration, a severity and a summary;
    promtool agrees when it is installed."""
    found = rules()
    assert {"DeliveryDeadLetters", "DeliveryBacklogWithoutConsumer", "DeliveryNoCommit",
            "DeliveryStoreUnhealthy"} <= {rule["alert"] for rule in found}
    for rule in found:
        assert rule["expr"] and rule["for"] and rule["labels"]["severity"] and rule["annotations"]["summary"], rule
    promtool = shutil.which("promtool")
    if promtool:
        done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
        assert 0 == done.returncode, done.stdout + done.stderr


def test_the_dashboard_is_grafana_json_with_templated_queries() -> None:
    """Valid JSON, unique panel ids, every query filtered by the consumer variable or job."""
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for expr in dashboard_exprs():
        assert "$consumer" in expr or "$job" in expr, expr


def test_the_systemd_unit_template_kills_the_whole_group_and_verifies(tmp_path: Path) -> None:
    """KillMode=control-group, one instance per consumer; systemd-analyze verify finds nothing wrong."""
    text = UNIT.read_text()
    assert re.search(r"^KillMode=control-group$", text, re.M)
    assert re.search(r"^ExecStart=\S+ run --consumer %i\b", text, re.M)
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the unit was only read, not verified")
    script = Path(sys.executable).parent / "delivery-consumer"
    unit = tmp_path / "delivery-consumer@.service"
    unit.write_text(text.replace("/opt/delivery-consumer/.venv/bin/delivery-consumer", str(script)))
    (tmp_path / "delivery-consumer@catalog.service").symlink_to(unit.name)
    done = subprocess.run([analyze, "verify", str(tmp_path / "delivery-consumer@catalog.service")],
                          capture_output=True, text=True, timeout=60)
    ours = [line for line in done.stderr.splitlines() if "delivery-consumer@" in line]
    assert 0 == done.returncode and not ours, done.stderr
