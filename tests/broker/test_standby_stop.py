"""A partition's standby told to stop (SIGTERM) at any point of its wait or takeover stops: exit 0,
nothing of it left running, and it consumes nothing it did not finish and ack.

Real runs of one partition (an active one and a standby) on the shared broker, real signals,
real SQLite. Each test publishes events, stops the runs at the moment it is about, then drains
the partition with a fresh run and checks the ledger: every event applied exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

import pytest
from brokerkit import RunProcess, session_processes
from partitionkit import Cluster, make_events, wait_until

pytestmark = pytest.mark.broker

PARTITIONS = 1
#: How long a run may take to exit once told to stop (a bound on failure, not a measurement).
EXIT_S = 30.0
TAKING_OVER = "taking over: "


def start(cluster: Cluster, *args: str, pause_at: str | None = None) -> RunProcess:
    """``run --partition 0`` (its own session), waited until it consumes or stands by."""
    env = cluster.ns.env(**({"DELIVERY_PAUSE_AT": pause_at} if pause_at else {}))
    cmd = [sys.executable, "-m", "delivery_consumer", "run", "--consumer", cluster.consumer, "--partition", "0",
           "--partitions", str(PARTITIONS), *args]
    proc = RunProcess(cmd, cwd=cluster.ns.workdir, env=env)
    cluster.procs.append(proc)
    wait_until("run to consume or stand by",
               lambda: any(text in proc.output()[1] for text in ("consuming ", "standby: waiting")), 60, [proc])
    return proc


def exited(proc: RunProcess) -> str:
    """Wait for *proc* to exit 0 with its whole session (worker included); its log."""
    try:
        proc.wait(EXIT_S)
    except Exception:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"run did not exit within {EXIT_S}s of SIGTERM:\n{proc.output()[1][-3000:]}")
    err = proc.communicate()[1]
    assert proc.returncode == 0, err[-3000:]
    wait_until("the run's worker process to end", lambda: not session_processes(proc.pid), 10)
    return err


def worker_of(proc: RunProcess) -> int:
    """The worker process of a run (the other live process of its session)."""
    return wait_until("the worker process", lambda: next((p for p in session_processes(proc.pid) if p != proc.pid),
                                                          None), 10, [proc])


def drain_and_check(cluster: Cluster, events: list[dict[str, object]]) -> None:
    """A fresh run applies whatever is left; then every event has exactly one receipt."""
    last = start(cluster, "--exit-when-idle", "2s")
    assert exited(last) is not None
    cluster.check_exactly_once(events)


@pytest.fixture
def events(cluster: Cluster) -> Iterator[list[dict[str, object]]]:
    """Events published to the partition before the runs start."""
    batch = make_events(300, 30)
    cluster.publish(batch)
    yield batch


def test_a_waiting_standby_stops_at_once(cluster: Cluster, events: list[dict[str, object]]) -> None:
    """SIGTERM to a standby waiting for the database: it exits 0 without taking over, the active
    run goes on and applies every event once."""
    active = start(cluster)
    standby = start(cluster)
    wait_until("the active run to apply every event", lambda: cluster.receipts() >= len(events), 120, [active])
    standby.send_signal(signal.SIGTERM)
    err = exited(standby)
    assert TAKING_OVER not in err and " acked: " not in err, err
    assert active.poll() is None
    active.send_signal(signal.SIGTERM)
    exited(active)
    drain_and_check(cluster, events)


@pytest.mark.parametrize("after_exit", [False, True], ids=["both-at-once", "as-the-active-exits"])
def test_a_standby_stopped_as_its_active_stops(cluster: Cluster, events: list[dict[str, object]],
                                                after_exit: bool) -> None:
    """SIGTERM to the active run and at once to its standby (or to the standby the moment the
    active exited, while it takes over), five times: the standby exits 0 -- having taken over or
    not, it never goes on consuming -- nothing is left running, every event is applied once."""
    for _ in range(5):
        active = start(cluster)
        standby = start(cluster)
        active.send_signal(signal.SIGTERM)
        if after_exit:
            exited(active)
        standby.send_signal(signal.SIGTERM)
        exited(standby)
        if not after_exit:
            exited(active)
    drain_and_check(cluster, events)


def test_sigterm_after_the_lock_is_taken_before_the_database_opens(
        cluster: Cluster, events: list[dict[str, object]]) -> None:
    """A standby holds the writer lock of the active run that exited, its database not open yet
    (its worker stands still there), when SIGTERM comes: it exits 0 without consuming."""
    active = start(cluster)
    standby = start(cluster, pause_at="standby-took-over")
    active.send_signal(signal.SIGTERM)
    exited(active)
    standby.wait_for_log("pause point standby-took-over reached")
    worker = worker_of(standby)
    standby.send_signal(signal.SIGTERM)
    wait_until("the standby to stop", lambda: "received before consuming: stopping" in standby.output()[1], 30,
               [standby])
    with contextlib.suppress(ProcessLookupError):
        os.kill(worker, signal.SIGCONT)
    err = exited(standby)
    assert "consuming " not in err and " acked: " not in err, err
    drain_and_check(cluster, events)


def test_sigterm_as_the_worker_says_it_is_ready(cluster: Cluster, events: list[dict[str, object]]) -> None:
    """SIGTERM reaches a standby that took over, and its worker's word that it is ready comes
    right behind it, before the run started consuming: the run tells its worker to stop (or
    kills it, had the word not come yet), consumes nothing and exits 0."""
    active = start(cluster)
    standby = start(cluster, pause_at="worker-ready")
    active.send_signal(signal.SIGTERM)
    exited(active)
    standby.wait_for_log("pause point worker-ready reached")
    worker = worker_of(standby)
    standby.send_signal(signal.SIGTERM)
    os.kill(worker, signal.SIGCONT)  # its word follows the signal at once
    err = exited(standby)
    assert "received before consuming: stopping" in err, err
    assert "consuming " not in err and " acked: " not in err, err
    drain_and_check(cluster, events)
