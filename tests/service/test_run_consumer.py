"""delivery_consumer.run_consumer: a consumer run from a program of its own, as ``run`` runs it (two processes,
SIGTERM finishes and exits 0, the ledger exact; a fatal error is one line and 2)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import orders_consumer  # noqa: F401  (registers the orders consumer in this process)
import orjson
import pytest
from brokerkit import Namespace, RunProcess, wait_session_gone
from support import count_rows, read_rows, wait_until

import delivery_consumer
from delivery_consumer.model.cloudevents import event_id_for

PROGRAM = '''
"""A service of the user's own: it starts the orders consumer with run_consumer and exits with its code."""
import logging
import sys

import orders_consumer  # the user's consumer, registered on import

import delivery_consumer

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
url, db, exchange, prefix = sys.argv[1:]
sys.exit(delivery_consumer.run_consumer("orders", url, db, exchange=exchange, prefix=prefix, batch=20, prefetch=50))
'''


def order(order_id: str, revision: int, status: str) -> dict[str, Any]:
    return {"eventId": str(uuid.uuid4()), "type": "order.placed" if revision == 1 else "order.changed",
            "orderId": order_id, "revision": revision, "occurredAt": "2026-12-02T10:00:00Z",
            "data": {"status": status, "totalCents": 100 * revision}}


def test_a_program_runs_a_consumer_and_stops_it_with_sigterm(ns: Namespace, tmp_path: Path) -> None:
    """A Python program that calls run_consumer receives envelopes and a CloudEvent from the broker, each applied
    once (duplicates answered), and on SIGTERM finishes, exits 0 and leaves no process and no message behind."""
    program = tmp_path / "service.py"
    program.write_text(PROGRAM, "utf-8")
    db = ns.db("orders")
    proc = RunProcess([sys.executable, str(program), ns.url, str(db), ns.exchange, ns.prefix], cwd=ns.workdir,
                      env=ns.env())
    ns.started.append(proc)
    proc.wait_for_log(f"consuming {ns.topology('orders').queue}")

    events = [order(f"order-{i % 7}", i // 7 + 1, ["placed", "paid", "shipped"][i // 7 % 3]) for i in range(40)]
    bodies = [orjson.dumps(e) for e in events]
    cloud = {"specversion": "1.0", "id": "shop-1", "source": "/shop", "type": "order.placed", "subject": "order-99",
             "revision": 1, "time": "2026-12-02T10:00:00Z", "data": {"status": "placed", "totalCents": 5}}
    ns.publish([*bodies, *bodies[:10]])
    ns.publish([orjson.dumps(cloud)], routing_key="order.placed")  # content-type application/json: by its body
    expected = {e["eventId"] for e in events} | {event_id_for("/shop", "shop-1")}
    wait_until("every event received", lambda: count_rows(db, "inbox") == len(expected), 60, [proc])
    wait_until("the duplicates answered", lambda: count_rows(db, "deliveries", "last_outcome LIKE 'duplicate:%'")
               == 10, 60, [proc])

    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert 0 == proc.returncode, err[-3000:]
    assert "SIGTERM received" in err
    assert not wait_session_gone(proc.pid, 10)
    assert {row[0] for row in read_rows(db, "inbox", "event_id")} == expected
    last = {e["orderId"]: (e["revision"], e["data"]["status"]) for e in events}
    last["order-99"] = (1, "placed")
    assert read_rows(db, "orders", "order_id, revision, status") == sorted((k, *v) for k, v in last.items())
    assert count_rows(db, "rejected") == 0
    assert ns.count(ns.topology("orders").queue) == 0  # everything acked


def test_a_fatal_error_is_one_line_and_exit_code_2(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """An unknown consumer or options that cannot work: run_consumer returns 2 and logs one line saying why."""
    with caplog.at_level(logging.ERROR, logger="delivery_consumer.run"):
        assert 2 == delivery_consumer.run_consumer("no-such-consumer", db=tmp_path / "x.db")
        assert 2 == delivery_consumer.run_consumer("orders", db=tmp_path / "x.db", batch=100, prefetch=10)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "no-such-consumer" in lines[0] and "batch 100 cannot fill" in lines[1]
    assert not (tmp_path / "x.db").exists()


def test_run_consumer_refuses_to_run_outside_the_main_thread(tmp_path: Path) -> None:
    """Signals can only be handled in the main thread: another thread gets a RuntimeError, nothing is started."""
    errors: list[BaseException] = []

    def call() -> None:
        try:
            delivery_consumer.run_consumer("orders", db=tmp_path / "x.db")
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)
    assert len(errors) == 1 and "main thread" in str(errors[0])
    assert not (tmp_path / "x.db").exists()


IDLE_PROGRAM = '''
"""A service of the user's own with the usual logging.basicConfig(INFO): it runs until idle."""
import logging
import sys

import orders_consumer

import delivery_consumer

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
url, db, exchange, prefix = sys.argv[1:]
sys.exit(delivery_consumer.run_consumer("orders", url, db, exchange=exchange, prefix=prefix, exit_when_idle_s=0.5))
'''


@pytest.mark.parametrize("broker", ["up", "refusing"])
def test_an_embedded_consumer_logs_its_own_lines_not_pikas(ns: Namespace, tmp_path: Path, broker: str) -> None:
    """A program that configures logging at INFO and embeds run_consumer sees the toolkit's lines only: none of
    pika's connection steps, no 404 warning of the partitions queue it asks about, no traceback; a broker that
    refuses the connection is one line of the toolkit's own and exit 2."""
    program = tmp_path / "service.py"
    program.write_text(IDLE_PROGRAM, "utf-8")
    url = ns.url if broker == "up" else "amqp://guest:guest@127.0.0.1:1/%2F"
    proc = RunProcess([sys.executable, str(program), url, str(ns.db("orders")), ns.exchange, ns.prefix],
                      cwd=ns.workdir, env=ns.env())
    ns.started.append(proc)
    _out, err = proc.communicate(timeout=120)
    assert (0 if broker == "up" else 2) == proc.returncode, err[-3000:]
    lines = err.splitlines()
    assert [] == [line for line in lines if line.split(" ")[1:2] and line.split(" ")[1].startswith("pika")]
    assert "Traceback" not in err and "404" not in err and "NOT_FOUND" not in err
    assert all(line.split(" ")[1].startswith("delivery_consumer") for line in lines if line), lines
    if broker == "up":
        assert any(f"consuming {ns.topology('orders').queue}" in line for line in lines)
    else:
        assert 1 == len([line for line in lines if line.startswith("ERROR")])
