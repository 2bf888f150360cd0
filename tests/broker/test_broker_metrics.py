"""Metrics and structured logs of ``run``, checked on a known run."""

from __future__ import annotations

import socket
import time
import urllib.request

import orjson
from brokerkit import Namespace
from support import new_event, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_metrics_scrape_shows_the_counts_of_a_known_run(ns: Namespace) -> None:
    """After 20 valid events (5 of them twice) and 2 bad bodies, /metrics shows
    exactly those outcomes, the dead letters, batch sizes and a recent commit."""
    events = [new_event(article_id=f"a-{i}") for i in range(20)]
    bodies = [orjson.dumps(e) for e in events] + [orjson.dumps(e) for e in events[:5]] + [b"{bad", b"[]"]
    ns.publish(bodies, declare=["audit"])
    port = free_port()
    proc = ns.start_run("audit", "--metrics-port", str(port), "--exit-when-idle", "30")
    def settled() -> dict[str, float] | None:
        m = scrape(port)
        # Dead copies are confirmed after their batch commits: wait for both.
        done = sum(v for k, v in m.items() if k.startswith("delivery_events_total")) >= 27 and sum(
            v for k, v in m.items() if k.startswith("delivery_dead_letters_total")) >= 2
        return m if done else None

    try:
        m = wait_until("27 outcomes and 2 dead letters on /metrics", settled, procs=[proc], ignoring=(OSError,))
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert 0 == proc.returncode, err
    assert 20 == m['delivery_events_total{consumer="audit",outcome="recorded"}']
    assert 5 == m['delivery_events_total{consumer="audit",outcome="duplicate:recorded"}']
    assert 2 == m['delivery_events_total{consumer="audit",outcome="malformed-json"}']
    assert 2 == m['delivery_rejections_total{code="malformed-json",consumer="audit"}']
    assert 2 == m['delivery_dead_letters_total{code="malformed-json",consumer="audit"}']
    assert 27 == m['delivery_batch_size_sum{consumer="audit"}']
    assert 1 == m['delivery_connected{consumer="audit"}']
    assert abs(time.time() - m['delivery_last_commit_timestamp_seconds{consumer="audit"}']) < 60
    assert m['delivery_apply_seconds_count{consumer="audit"}'] >= 1


def test_json_logs_one_object_per_event_without_payloads(ns: Namespace) -> None:
    """--log-format json: each line is a JSON object with time, level, consumer,
    eventId, outcome and delivery tag; no title or other payload value appears."""
    secret = "Секретный заголовок 12345"
    events = [new_event(article_id=f"a-{i}", title=secret) for i in range(5)]
    ns.publish([orjson.dumps(e) for e in events] + [b"{oops " + secret.encode()], declare=["audit"])
    done = ns.run_until_idle("audit", "--log-format", "json")
    assert 0 == done.returncode, done.stderr
    lines = [orjson.loads(line) for line in done.stderr.splitlines()]
    assert all({"time", "level", "consumer", "message"} <= set(x) for x in lines)
    per_event = {x["eventId"]: x for x in lines if x.get("outcome") == "recorded"}
    assert {e["eventId"] for e in events} == set(per_event)
    assert all(isinstance(x["deliveryTag"], int) and x["consumer"] == "audit" for x in per_event.values())
    assert any(x.get("code") == "malformed-json" for x in lines)
    assert secret not in done.stderr
