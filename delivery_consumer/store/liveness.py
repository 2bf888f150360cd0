"""Whether a process another process recorded is still running (Linux ``/proc``).

A pid names a process only on its host, since its boot and inside its pid
namespace (two containers may share a host name and a kernel, not their
pids), and only together with its start time (a pid is reused).
:func:`boot_id` names boot and namespace, :func:`proc_start` the start time;
:func:`process_state` judges a process recorded under this boot and
namespace. Who recorded a process in another namespace cannot be judged
from here: the callers treat it as not known dead. Used by the inbox's
in-flight notes and the outbox's lease owners.
"""

from __future__ import annotations

import os
from typing import Final, Literal

#: The process runs (or waits); it is alive whatever else is said of it.
RUNNING: Final = "running"
#: Stopped (SIGSTOP, a debugger): alive, but it may never go on.
STOPPED: Final = "stopped"
#: Exited, a zombie, or its pid now belongs to another process.
GONE: Final = "gone"
#: No ``/proc``, and the pid exists (or is not ours to signal): cannot tell.
UNKNOWN: Final = "unknown"

State = Literal["running", "stopped", "gone", "unknown"]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``), None when unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def boot_id() -> str | None:
    """The kernel's boot id and this process's pid namespace (Linux), as
    ``"<boot id> <namespace>"`` (``?`` for an unknown namespace): a reboot
    makes every old pid meaningless, and a pid means something only inside
    its namespace. None without ``/proc``."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    if boot is None:
        return None
    return f"{boot} {pid_namespace() or '?'}"


def proc_stat(pid: int) -> tuple[str, str] | None:
    """State and start time of *pid* (``/proc/<pid>/stat`` fields 3 and 22:
    ``R``/``S``/``D`` running or waiting, ``T``/``t`` stopped, ``Z``/``X``
    exited; clock ticks since boot), or None when unknown."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    if len(fields) < 20:
        return None
    return fields[0], fields[19]


def proc_start(pid: int) -> str | None:
    """Start time of *pid* in clock ticks since boot, or None when unknown."""
    stat = proc_stat(pid)
    return None if stat is None else stat[1]


def process_state(pid: int, started: str | None) -> tuple[State, str]:
    """The state of process *pid*, started at *started* (None: not known),
    as recorded under this boot and pid namespace; with GONE, why (``"is
    gone"``, ``"has exited"``, ...), else ``""``."""
    if pid <= 0:  # never a process: os.kill would signal a whole group
        return GONE, "is gone"
    current = proc_stat(pid)
    if current is None:
        try:  # no /proc entry: only the pid can be checked
            os.kill(pid, 0)
        except ProcessLookupError:
            return GONE, "is gone"
        except PermissionError:
            return UNKNOWN, ""
        return UNKNOWN, ""
    state, start = current
    if state in ("Z", "X"):
        return GONE, "has exited"
    if started is not None and start != started:
        return GONE, "is gone (the pid now belongs to another process)"
    if state in ("T", "t"):
        return STOPPED, ""
    return RUNNING, ""


__all__ = ["GONE", "RUNNING", "STOPPED", "UNKNOWN", "State", "boot_id", "pid_namespace", "proc_start",
           "proc_stat", "process_state"]
