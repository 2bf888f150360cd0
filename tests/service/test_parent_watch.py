"""The worker learns of its parent's death even when no pipe tells it: the
kernel's PR_SET_PDEATHSIG signal alone, or the parent pid changing alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import wait_until

WATCHER = """
import os, sys, time
from delivery_consumer.service import worker_process
parent = os.getppid()
if sys.argv[1] == "signal":
    os.getppid = lambda: parent  # only the kernel's signal can tell it now
gone = worker_process.die_with_parent(parent)
if sys.argv[1] == "pid":
    import signal
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # only the parent pid can tell it now
print("watching", flush=True)
deadline = time.monotonic() + 10
while not gone() and time.monotonic() < deadline:
    time.sleep(0.01)
print("parent gone" if gone() else "never told", flush=True)
"""

#: Starts the watcher, waits until it watches, then dies without a word.
PARENT = """
import os, subprocess, sys, time
out = open(sys.argv[1], "w")
subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]], stdout=out)
while "watching" not in open(sys.argv[1]).read():
    time.sleep(0.01)
os._exit(0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", ["signal", "pid"])
def test_the_worker_learns_that_its_parent_died(tmp_path: Path, how: str) -> None:
    """Its parent killed, the watcher learns it (before its own 10 s deadline), by the signal alone
    or by the pid alone."""
    out = tmp_path / "watcher.out"
    parent = subprocess.run([sys.executable, "-c", PARENT, str(out), WATCHER, how], timeout=30)
    assert 0 == parent.returncode
    verdict = wait_until("the watcher's verdict", lambda: out.read_text().splitlines()[1:])
    assert ["parent gone"] == verdict
