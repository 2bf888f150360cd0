"""A partitioned consumer on the real broker: four partitions, a standby each, kills.

Events go through ``publish`` (which adds the slot header) to the shared
exchange; every partition queue has a single active consumer, so a second
``run`` of a partition waits and takes over, in order, when the first dies.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from partitionkit import Cluster, make_events, wait_until
from support import count_rows

pytestmark = pytest.mark.broker

PARTITIONS = 4
#: 20,000 events over 2,000 articles (about 20 s for both tests here).
EVENTS = int(os.environ.get("DELIVERY_PARTITION_TEST_EVENTS", "20000"))
ARTICLES = EVENTS // 10


def test_without_kills_every_result_is_updated(cluster: Cluster) -> None:
    """One run per partition: each event applied once, in its article's order (every receipt `updated`)."""
    events = make_events(EVENTS // 2, ARTICLES)
    for k in range(PARTITIONS):
        cluster.start(k)
    cluster.publish(events)
    wait_until("every receipt", lambda: cluster.receipts() >= len(events), 300, cluster.procs)
    cluster.stop()
    assert all(p.returncode == 0 for p in cluster.procs), [p.output()[1][-2000:] for p in cluster.procs]
    assert cluster.check_exactly_once(events) == {"updated": len(events)}
    counts = [count_rows(cluster.db(k), "inbox") for k in range(PARTITIONS)]
    assert min(counts) > 0, counts  # 256 slots spread articles over every partition


def test_standbys_take_over_when_two_active_runs_are_killed(cluster: Cluster) -> None:
    """Two partitions' active runs SIGKILLed (main PID alone) mid-stream: their standbys take over
    and still every event has exactly one receipt in exactly one partition, the merged catalog
    equals the model, and order per article holds (no `stale`)."""
    events = make_events(EVENTS, ARTICLES)
    active = [cluster.start(k) for k in range(PARTITIONS)]
    standby = [cluster.start(k) for k in range(PARTITIONS)]
    cluster.publish(events[: len(events) // 10])  # the stream is flowing before the kills...
    victims = (1, 3)
    wait_until("partitions 1 and 3 to commit", lambda: all(count_rows(cluster.db(k), "inbox") > 0 for k in victims),
               120, cluster.procs)
    killed_at: dict[int, float] = {}
    for k in victims:
        os.kill(active[k].pid, signal.SIGKILL)  # the main PID alone, as an operator would
        killed_at[k] = time.monotonic()
    publishing = cluster.publish_async(events[len(events) // 10:])  # ...and goes on while the standbys take over
    took_over: dict[int, float] = {}

    def standbys_working() -> bool:
        for k in victims:
            if k not in took_over and " acked: " in standby[k].output()[1]:
                took_over[k] = time.monotonic() - killed_at[k]
        return len(took_over) == len(victims)

    try:
        wait_until("the standbys to ack a batch", standbys_working, 120)
    finally:
        _out, err = publishing.communicate(timeout=300)
    assert publishing.returncode == 0, err
    wait_until("every receipt", lambda: cluster.receipts() >= len(events), 300,
               [p for i, p in enumerate(active) if i not in victims] + standby)
    cluster.stop()
    assert all(active[k].returncode == -signal.SIGKILL for k in victims)
    for k in range(PARTITIONS):
        assert " acked: " not in standby[k].output()[1] or k in victims, f"standby p{k} consumed while active lived"
    results = cluster.check_exactly_once(events)
    assert set(results) == {"updated"}, results
    print(f"standby takeover (kill -> first batch acked by the standby): "
          f"{', '.join(f'p{k} {s:.2f}s' for k, s in sorted(took_over.items()))}")
    for k in victims:
        stale = count_rows(cluster.db(k), "inbox", "result != 'updated'")
        assert stale == 0
