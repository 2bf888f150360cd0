"""The operator's tools for a declared non-material type, with real processes and the real broker:
a deployment file with the orders plugin consumer (keyed by ``orderId``) and its producer; events
enqueued, dispatched and consumed, one bad body dead-lettered; then ``trace`` (one database and
across the deployment, with meta and the key), ``dead list``, ``status``, ``orders list|show``
and the console's trace page speak of ``orderId``, never of an ``articleId``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import orders_consumer
import orjson
import pytest
from brokerkit import Namespace, RunProcess
from deploykit import deploy_env
from support import wait_until

from delivery_consumer import outbox

pytestmark = pytest.mark.broker

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PLUGIN = {"DELIVERY_PLUGINS": "orders_consumer"}


def order(order_id: str, revision: int, status: str, **extra: Any) -> dict[str, Any]:
    return {"eventId": str(uuid.uuid4()), "type": "order.placed" if revision == 1 else "order.changed",
            "orderId": order_id, "revision": revision, "occurredAt": "2026-11-29T10:00:00Z",
            "data": {"status": status, "totalCents": 1250}, **extra}


def write_config(directory: Path, ns: Namespace) -> Path:
    path = directory / "delivery.toml"
    path.write_text("\n".join([
        f'amqp_url = "{ns.url}"', f'exchange = "{ns.exchange}"', f'queue_prefix = "{ns.prefix}"',
        "[consumers.orders]", 'db = "state/orders/inbox.db"',
        "[producers.orders]", 'db = "producer.db"']) + "\n", encoding="utf-8")
    return path


def dc(config: Path, *args: str, code: int | None = 0) -> subprocess.CompletedProcess[str]:
    """``delivery-consumer ARGS`` with the deployment file and the orders plugin; exit *code* checked."""
    done = subprocess.run([sys.executable, "-m", "delivery_consumer", *args], cwd=config.parent,
                          env=deploy_env(config, **PLUGIN), capture_output=True, text=True, timeout=120)
    if code is not None:
        assert code == done.returncode, (args, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_trace_dead_status_and_views_of_an_orders_deployment_name_the_order_key(ns: Namespace,
                                                                                tmp_path: Path) -> None:
    """Every operator tool shows orderId and its value for order events (never articleId): trace by
    eventId (with meta, an older event's row found from its receipt's key) and by --key, the dead letter
    in dead list, status and trace; orders list|show; the console's trace page by key."""
    config = write_config(tmp_path, ns)
    first = order("order-7", 1, "placed", meta={"correlationId": "checkout-31", "traceparent": TRACEPARENT})
    paid, other = order("order-7", 2, "paid"), order("order-9", 1, "placed")
    conn = outbox.connect(tmp_path / "producer.db")
    try:
        for event in (first, paid, other):
            with outbox.transaction(conn):
                assert outbox.enqueue(conn, event, types=orders_consumer.TYPES)
    finally:
        conn.close()
    sent = dc(config, "dispatch", "--consumer", "orders", "--exit-when-idle", "500ms", "--poll", "50ms")
    assert "3 published" in sent.stderr, sent.stderr
    bad = order("order-5", 1, "lost")  # not a status the type declares: invalid-envelope, dead-lettered
    ns.publish([orjson.dumps(bad)])
    proc = RunProcess([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "orders",
                       "--exit-when-idle", "1.5"], cwd=tmp_path, env=deploy_env(config, **PLUGIN))
    ns.started.append(proc)
    done = proc.until_idle(120)
    assert 0 == done.returncode, done.stderr[-2000:]

    # one database: the first event's order row (now revision 2), found from the key its receipt holds
    text = dc(config, "trace", "--consumer", "orders", first["eventId"]).stdout
    assert re.search(r"^  meta.correlationId: +checkout-31$", text, re.M), text
    assert re.search(rf"^  meta.traceparent: +{TRACEPARENT}$", text, re.M), text
    assert re.search(r"^orderId order-7:\n  orderId: +order-7\n  revision: +2\n", text, re.M), text
    shown = orjson.loads(dc(config, "trace", "--consumer", "orders", "--json", first["eventId"]).stdout)
    assert ("orderId", "order-7", paid["eventId"], False) == (
        shown["key"]["field"], shown["key"]["value"], shown["key"]["row"]["eventId"],
        shown["key"]["row"]["currentEvent"])
    # the bad body: no receipt holds its key, the note names orderId, --key shows another order's row
    shown = orjson.loads(dc(config, "trace", "--consumer", "orders", "--json", bad["eventId"]).stdout)
    assert ("rejected", None) == (shown["status"], shown["key"]["row"])
    assert "orderId" in shown["key"]["note"] and "--key" in shown["key"]["note"]
    shown = orjson.loads(dc(config, "trace", "--consumer", "orders", "--json", bad["eventId"],
                            "--key", "order-9").stdout)
    assert ("order-9", other["eventId"]) == (shown["key"]["value"], shown["key"]["row"]["eventId"])

    # across the deployment: the outbox row by its key field, the dead letter, by --key (and --article)
    text = dc(config, "trace", first["eventId"]).stdout
    assert re.search(r"^  orderId: +order-7$", text, re.M) and "articleId" not in text, text
    shown = orjson.loads(dc(config, "trace", "--json", first["eventId"]).stdout)
    assert ("orderId", "order-7") == (shown["outbox"][0]["keyField"], shown["outbox"][0]["orderId"])
    text = dc(config, "trace", bad["eventId"]).stdout
    assert f"dead letter NOW in {ns.prefix}.orders.dead" in text and "invalid-envelope" in text, text
    for option in ("--key", "--article"):
        keyed = dc(config, "trace", option, "order-7").stdout
        assert keyed.startswith("orderId order-7 in "), keyed
        assert [first["eventId"], paid["eventId"]] == re.findall(r"[0-9a-f]{8}-[0-9a-f-]{27}", keyed)
    shown = orjson.loads(dc(config, "trace", "--key", "order-7", "--json").stdout)
    assert ("orderId", [1, 2]) == (shown["keyField"], [e["revision"] for e in shown["events"]])
    assert ["updated", "updated"] == [e["consumers"]["orders"]["result"] for e in shown["events"]]

    # dead list and status: the letter with the field its reason names, and no articleId anywhere
    dead = dc(config, "dead", "list", "--consumer", "orders")
    assert bad["eventId"] in dead.stdout and "invalid-envelope" in dead.stdout and "data.status" in dead.stdout
    assert "articleId" not in dead.stdout + dead.stderr
    status = dc(config, "status", code=1)
    assert "orders: 1 dead letter in" in status.stdout and "articleId" not in status.stdout, status.stdout

    # the consumer's own view
    listed = dc(config, "orders", "list").stdout.splitlines()
    assert ["orderId", "revision", "status", "totalCents", "eventId"] == listed[0].split()
    shown = orjson.loads(dc(config, "orders", "show", "--json", "order-7").stdout)
    assert ("order-7", 2, "paid") == (shown["orderId"], shown["revision"], shown["status"])

    # the console's trace page, by key
    console = RunProcess([sys.executable, "-m", "delivery_consumer", "console", "--port", "0"], cwd=tmp_path,
                         env=deploy_env(config, **PLUGIN))
    try:
        url = wait_until("the console's URL on stderr",
                         lambda: re.search(r"console on (http://\S+/)", console.output()[1]), procs=[console]).group(1)
        with urlopen(f"{url}trace?q=order-7", timeout=30) as answer:
            page = answer.read().decode()
    finally:
        os.kill(console.pid, signal.SIGTERM)
        console.communicate(timeout=30)
    assert "<h1>orderId order-7</h1>" in page and paid["eventId"] in page, page[:2000]


def test_a_partitioned_orders_deployment_traces_and_shows_each_order_in_its_partition(ns: Namespace,
                                                                                      tmp_path: Path) -> None:
    """Orders dispatched to two partitions: trace's other partition says where the orderId lives, the
    one-database trace finds the partition and the order's row, and orders show reads the order's partition."""
    from delivery_consumer.amqp.partitions import partition_of

    config = write_config(tmp_path, ns)
    config.write_text(config.read_text("utf-8").replace('db = "state/orders/inbox.db"',
                                                        'db = "state/orders"\npartitions = 2'), "utf-8")
    dc(config, "topology", "declare", "--consumer", "orders")
    names = {partition_of(f"order-{i}", 2): f"order-{i}" for i in range(20)}  # one order per partition
    events = [order(names[k], 1, "placed") for k in (0, 1)]
    conn = outbox.connect(tmp_path / "producer.db")
    try:
        with outbox.transaction(conn):
            for event in events:
                assert outbox.enqueue(conn, event, types=orders_consumer.TYPES)
    finally:
        conn.close()
    dc(config, "dispatch", "--exit-when-idle", "500ms", "--poll", "50ms")
    for k in (0, 1):
        proc = RunProcess([sys.executable, "-m", "delivery_consumer", "run", "--consumer", "orders",
                           "--partition", str(k), "--exit-when-idle", "1.5"], cwd=tmp_path,
                          env=deploy_env(config, **PLUGIN))
        ns.started.append(proc)
        done = proc.until_idle(120)
        assert 0 == done.returncode, done.stderr[-2000:]

    text = dc(config, "trace", events[0]["eventId"]).stdout
    assert f"consumer orders/p1: not this partition's key (orderId {names[0]} lives in p0)" in text, text
    assert re.search(r"^  orders/p0 +applied updated$", text, re.M), text
    shown = orjson.loads(dc(config, "trace", "--consumer", "orders", "--json", events[1]["eventId"]).stdout)
    assert (1, "orderId", names[1], True) == (shown["partition"], shown["key"]["field"], shown["key"]["value"],
                                               shown["key"]["row"]["currentEvent"])
    shown = orjson.loads(dc(config, "orders", "show", "--json", names[1]).stdout)
    assert (1, events[1]["eventId"]) == (shown["partition"], shown["eventId"])
