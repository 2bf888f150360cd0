"""Crash points: kill the process with SIGKILL at a named boundary.

A test harness shipped with the library, so that anyone can check what a
crash at each step of the delivery protocol does to *their* consumer::

    DELIVERY_CRASH_AT=after-commit delivery-consumer run --consumer catalog
    DELIVERY_CRASH_AT=after-commit:3   # on the third time the point is reached

The points, by the process that reaches them:

* ``run`` (service/worker.py): ``before-commit``, ``after-commit``
  (committed, not acked), ``after-retry-confirm`` and ``after-dead-confirm``
  (the copy is confirmed by the broker, the original not acked yet), and
  ``connection-awaiting-confirm`` (service/link.py: the connection
  process alone, a copy published and its confirm awaited: what a
  ``kill -9`` of the main PID does);
* the fence (inbox/fence.py, the webhook consumer): ``webhook-after-claim``
  (the keys are claimed, nothing called) and ``webhook-after-call`` (the
  endpoint answered, nothing recorded yet);
* ``dispatch`` (outbox/dispatcher.py): ``dispatch-before-publish`` (rows
  claimed, nothing sent), ``dispatch-after-confirm`` (the broker confirmed
  a batch, its rows not marked) and ``dispatch-mid-batch`` (half of a
  confirmed batch marked, in the marking transaction);
* ``dead requeue`` and ``dead purge`` (deadletters.py):
  ``requeue-after-confirm`` (the copy confirmed, the dead message not
  acked), ``requeue-after-ack`` and ``purge-after-ack`` (acked, its
  rejection row not marked resolved yet);
* ``repartition`` (partition_queues.py): ``repartition-copied`` (a window's
  copies confirmed in their new queues, the originals not acked yet).

With the variable unset, :func:`crashpoint` is a dictionary lookup.
``DELIVERY_PAUSE_AT`` names points where the process stops itself instead
(:func:`pausepoint`): ``repartition-before-switch`` (the databases are moved,
the broker still routes by the old count); in ``run``'s worker process,
``standby-took-over`` (a standby took the writer lock, the database is not
open yet) and ``worker-ready`` (the worker opened the database, and is about to tell the
connection process so; nothing is consumed yet).
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "DELIVERY_CRASH_AT"


def _parse(text: str) -> dict[str, int]:
    points: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, nth = part.partition(":")
        points[name] = int(nth) if nth else 1
    return points


_POINTS = _parse(os.environ.get(ENV, ""))
_SEEN: dict[str, int] = {}
#: Other processes that are part of the same service (run's connection process).
_ALSO: list[int] = []


def also_kill(pid: int) -> None:
    """Make a crash point kill *pid* too (the worker process of ``run`` takes
    its parent along, so that the whole service dies at the boundary)."""
    _ALSO.append(pid)


def crashpoint(name: str) -> None:
    """SIGKILL this process if DELIVERY_CRASH_AT names *name* (and its count is reached)."""
    if name not in _POINTS:
        return
    _SEEN[name] = _SEEN.get(name, 0) + 1
    if _SEEN[name] >= _POINTS[name]:
        sys.stderr.write(f"delivery-consumer: crash point {name} reached, SIGKILL\n")
        sys.stderr.flush()
        for pid in _ALSO:
            os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


PAUSE_ENV = "DELIVERY_PAUSE_AT"


def pausepoint(name: str) -> None:
    """Stop this process (SIGSTOP) if DELIVERY_PAUSE_AT names *name*.

    A test sees the line on stderr, acts while the process stands still at the
    boundary (publishes into ``repartition``'s window, say), then sends SIGCONT.
    Not on a hot path: the variable is read at each call.
    """
    if name not in _parse(os.environ.get(PAUSE_ENV, "")):
        return
    sys.stderr.write(f"delivery-consumer: pause point {name} reached, SIGSTOP\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP)
