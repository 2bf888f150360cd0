"""One judgement of whether a recorded process still runs (``liveness``): shared by the inbox's
in-flight notes and the outbox's lease owners, pid namespace included."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import OpenDB, wait_until

from delivery_consumer.inbox import InFlight, owner_alive, process_owner
from delivery_consumer.store import liveness

SLEEPER = [sys.executable, "-c", "import sys; sys.stdin.read()"]


@contextmanager
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child that runs until its stdin closes; reaped on the way out."""
    child = subprocess.Popen(SLEEPER, stdin=subprocess.PIPE)
    try:
        yield child
    finally:
        os.kill(child.pid, signal.SIGCONT)
        assert child.stdin is not None
        child.stdin.close()
        child.wait()


def gone_pid() -> int:
    """The pid of a child that ran and was reaped."""
    with sleeper() as child:
        return child.pid


def test_a_process_is_running_stopped_or_gone_as_its_proc_entry_says() -> None:
    """process_state: this process runs; a SIGSTOPped child is stopped, running again after SIGCONT; a recorded
    start time the pid no longer has means another process; a reaped child, pid 0 or a negative pid are gone."""
    assert (liveness.RUNNING, "") == liveness.process_state(os.getpid(), liveness.proc_start(os.getpid()))
    with sleeper() as child:
        started = liveness.proc_start(child.pid)
        assert started is not None
        os.kill(child.pid, signal.SIGSTOP)
        wait_until("the child stopped", lambda: liveness.process_state(child.pid, started)[0] == liveness.STOPPED)
        os.kill(child.pid, signal.SIGCONT)
        wait_until("the child runs again", lambda: liveness.process_state(child.pid, started)[0] == liveness.RUNNING)
        state, why = liveness.process_state(child.pid, str(int(started) + 1))
        assert (liveness.GONE, "is gone (the pid now belongs to another process)") == (state, why)
    assert liveness.GONE == liveness.process_state(gone_pid(), None)[0]
    assert liveness.GONE == liveness.process_state(0, None)[0]
    assert liveness.GONE == liveness.process_state(-1, None)[0]


def test_an_owner_name_carries_the_pid_namespace_and_only_this_namespace_is_judged() -> None:
    """An owner name is <boot>/<namespace>:<pid>:<start>. A gone pid named in this namespace, or in a name of
    older releases (no namespace), is dead; the same pid named in another namespace is not judged dead."""
    boot_part, _, start = process_owner().split(":")
    boot, _, namespace = boot_part.partition("/")
    assert namespace.isdigit()
    assert f"pid:[{namespace}]" == os.readlink("/proc/self/ns/pid")
    dead = gone_pid()
    assert not owner_alive(f"{boot}/{namespace}:{dead}:{start}")
    assert not owner_alive(f"{boot}:{dead}:{start}")
    assert owner_alive(f"{boot}/{int(namespace) + 1}:{dead}:{start}")
    assert not owner_alive(f"another/{int(namespace) + 1}:{dead}:{start}")  # another boot: dead whatever the pid


def _in_new_pid_namespace() -> list[str] | None:
    """The command prefix that runs a program in a fresh pid namespace (with its own /proc), None if not here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run([*prefix, "true"], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_a_running_process_of_another_pid_namespace_is_not_taken_for_dead(open_db: OpenDB, tmp_path: Path) -> None:
    """A process in another container on this host (another pid namespace, same kernel and boot) names
    itself with a pid of its own namespace: seen from here that pid is another process or none. While it
    runs, and after, its note is not reaped as a crash (it cannot be judged from here)."""
    prefix = _in_new_pid_namespace()
    if prefix is None:
        pytest.skip("unshare cannot make a pid namespace here")
    code = "import sys; from delivery_consumer.inbox import process_owner; print(process_owner(), flush=True); " \
           "sys.stdin.read()"
    child = subprocess.Popen([*prefix, sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().decode().strip()
        boot_part, pid, _ = name.split(":")
        assert boot_part != process_owner().split(":")[0]  # same boot, another namespace
        assert boot_part.split("/")[0] == process_owner().split("/")[0]
        assert pid == "1"  # the first process of its namespace: here, pid 1 is another process
        assert owner_alive(name)
        db = open_db("audit")
        InFlight(db, name).mark(["busy"])
        assert 0 == InFlight(db).reap()
        assert {} == InFlight(db).open_keys(["busy"])
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert 0 == child.returncode
