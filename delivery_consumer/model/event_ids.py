"""New eventIds: time-ordered UUIDs (version 7, RFC 9562).

The producer names each event it writes. A consumer keeps every eventId in
its inbox's primary key, a b-tree ordered by the id's text. Random ids
(version 4) put each new receipt on a random leaf page of that index, so a
commit writes and syncs a page per event and a large inbox falls out of the
cache. A version 7 id begins with its creation time in milliseconds, so a
producer's ids sort in the order they were made and a consumer's index
grows at its right edge, as the inbox table does (docs/hot-path.md).

Layout (RFC 9562 section 5.7, with the counter of section 6.2, method 1, the
layout of CPython 3.14's ``uuid.uuid7``): 48 bits of Unix time in
milliseconds, the version, a 42-bit counter seeded at random in each new
millisecond, the variant, 32 random bits. Within one generator ids strictly
increase: in the same millisecond, or when the clock goes back, the last
millisecond is kept and the counter advanced. A forked child starts its own
sequence: it would otherwise count on from its parent's last id, and the two
would differ in the 32 random bits alone.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable

_COUNTER_MAX = (1 << 42) - 1
_VERSION_7 = 0x7 << 76
_VARIANT_RFC = 0b10 << 62


class EventIds:
    """A source of strictly increasing version 7 UUIDs, as eventId strings.

    *clock* returns Unix time in nanoseconds (``time.time_ns``); *entropy*
    returns that many random bytes (``os.urandom``). Both are parameters so
    that the laws can be tested against any clock. Thread-safe.
    """

    def __init__(self, clock: Callable[[], int] = time.time_ns,
                 entropy: Callable[[int], bytes] = os.urandom) -> None:
        self._clock = clock
        self._entropy = entropy
        self._forget()
        _LIVE.add(self)

    def _forget(self) -> None:
        """Start a new sequence (and a new lock: one held by another thread
        at a fork stays held in the child)."""
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0

    def __call__(self) -> str:
        with self._lock:
            ms = self._clock() // 1_000_000
            if ms > self._last_ms:
                counter, tail = self._fresh()
            else:
                ms = self._last_ms
                counter = self._counter + 1
                tail = int.from_bytes(self._entropy(4), "big")
                if counter > _COUNTER_MAX:
                    ms += 1
                    counter, tail = self._fresh()
            self._last_ms, self._counter = ms, counter
        value = ((ms & 0xFFFF_FFFF_FFFF) << 80 | _VERSION_7 | (counter >> 30) << 64 | _VARIANT_RFC
                 | (counter & 0x3FFF_FFFF) << 32 | tail)
        h = f"{value:032x}"
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def _fresh(self) -> tuple[int, int]:
        """A counter for a new millisecond (its top bit clear, leaving room to
        count up) and a random tail."""
        rand = int.from_bytes(self._entropy(10), "big")
        return (rand >> 32) & (_COUNTER_MAX >> 1), rand & 0xFFFF_FFFF


_LIVE: weakref.WeakSet[EventIds] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ids in list(_LIVE):
        ids._forget()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: The process's generator: ``new_event_id()`` returns the next eventId.
new_event_id = EventIds()
