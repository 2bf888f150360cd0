"""A dead queue that does not answer holds a rejected delivery, never the run: on the real broker,
with the dead queue deleted under a running ``run`` (its copies come back 312 NO_ROUTE)."""

from __future__ import annotations

import signal

import orjson
from brokerkit import Namespace
from support import count_rows, new_event, read_rows, wait_until


def test_a_rejected_delivery_waits_unacked_for_its_dead_queue_while_the_rest_is_applied(ns: Namespace) -> None:
    """The dead queue is gone while a malformed event and 20 healthy ones arrive: the healthy ones
    are applied and acked, the malformed one is held (nothing in rejected, the run goes on, exit
    nowhere); once the dead queue is back it lands there exactly once with its reason, recorded
    in rejected with one attempt, and the main queue is empty."""
    topo = ns.topology("catalog")
    ns.publish([orjson.dumps(new_event(article_id="first"))], declare=["catalog"])
    proc = ns.start_run("catalog", "--batch", "5")
    db = ns.db("catalog")
    wait_until("the first event applied", lambda: count_rows(db, "inbox") == 1, procs=[proc])

    conn, ch = ns.channel()
    ch.queue_delete(topo.dead_queue)
    conn.close()
    healthy = [new_event(article_id=f"a-{i}") for i in range(20)]
    ns.publish([orjson.dumps(healthy[0]), b"{not json", *(orjson.dumps(e) for e in healthy[1:])])
    wait_until("the healthy events applied", lambda: count_rows(db, "inbox") == 21, procs=[proc])
    proc.wait_for_log("held unacked")
    assert "malformed-json" not in {r[0] for r in read_rows(db, "rejected", "code")}
    assert 0 == ns.count(topo.queue)  # nothing ready: the held one is unacked, the rest acked
    assert proc.poll() is None

    conn, ch = ns.channel()
    ch.queue_declare(topo.dead_queue, durable=True, arguments=topo.dead_arguments())
    conn.close()
    proc.wait_for_log("held deliveries released")
    wait_until("the rejection recorded", lambda: count_rows(db, "rejected") == 1, procs=[proc])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert 0 == proc.returncode, err
    assert "channel closed" not in err and "giving up channel" not in err

    letters = ns.drain(topo.dead_queue)
    assert [b"{not json"] == [body for _props, body in letters]
    (props, _body), = letters
    assert props.headers["x-error-code"] == "malformed-json" and props.headers["x-attempts"] == 1
    assert [("malformed-json", 1)] == read_rows(db, "rejected", "code, attempts")
    assert 0 == ns.count(topo.queue)
