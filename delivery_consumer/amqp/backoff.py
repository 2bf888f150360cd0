"""Waiting out an outage (a broker or a database that does not answer): when to try
again, and what to log of it.

:class:`Backoff` is the one bookkeeping of the loops that wait one out (``run``'s
connection to the broker, ``run``'s database, the outbox dispatcher): each attempt
waits longer (:func:`.retry.reconnect_delay_s`: exponential, jittered, capped), and
the outage is logged when it begins, when its reason changes and when it ends (with
how long it lasted) -- never once per attempt. The lines themselves are the caller's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from .retry import RECONNECT_CAP_S, reconnect_delay_s

#: What a failure is to the log: the outage's first, another reason than the last one, or the same again.
Said = Literal["began", "changed", "same"]


class Backoff:
    """One outage at a time: when it began, its last reason, the attempts made."""

    __slots__ = ("base_s", "cap_s", "clock", "since", "tries", "why")

    def __init__(self, *, base_s: float = 0.5, cap_s: float = RECONNECT_CAP_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s, self.cap_s, self.clock = base_s, cap_s, clock
        #: When the outage began (the clock's time; None: none is open).
        self.since: float | None = None
        #: The delays taken in this outage (the backoff's exponent).
        self.tries = 0
        #: The reason last noted.
        self.why = ""

    @property
    def open(self) -> bool:
        return self.since is not None

    def fail(self, why: str) -> Said:
        """Note a failure for *why*: ``began`` (log the outage), ``changed`` (log the new
        reason) or ``same`` (debug level at most)."""
        if self.since is None:
            self.since, self.why, self.tries = self.clock(), why, 0
            return "began"
        if why != self.why:
            self.why = why
            return "changed"
        return "same"

    def lasted(self) -> float:
        """Seconds since the outage began (0 when none is open)."""
        return 0.0 if self.since is None else self.clock() - self.since

    def delay(self, spent: float = 0.0) -> float:
        """The wait before the next attempt (one more try); *spent*: what the failed
        attempt took (a handshake that timed out), which counts towards it."""
        self.tries += 1
        return max(0.0, reconnect_delay_s(self.tries, base_s=self.base_s, cap_s=self.cap_s) - spent)

    def end(self) -> float | None:
        """The outage is over: how long it lasted (None: none was open). The next
        one starts from the shortest delay again."""
        lasted = None if self.since is None else self.clock() - self.since
        self.since, self.why, self.tries = None, "", 0
        return lasted


__all__ = ["Backoff", "Said"]
