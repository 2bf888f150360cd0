"""Calls into a pika IOLoop's thread from a signal handler or another thread, without a lock.

pika's ``IOLoop.add_callback_threadsafe`` takes a non-reentrant lock, and pika
calls it from the loop's own thread while it connects; a signal handler that
interrupts the thread there and calls it again waits for itself forever (a
SIGTERM that never stops the process). :class:`Wakeup` keeps a pipe of its own
instead: a request is a ``deque.append`` and an ``os.write``, both safe in a
signal handler, and the loop runs the requests when the pipe is readable.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from contextlib import suppress

from pika.adapters.select_connection import IOLoop, PollEvents


class Wakeup:
    """Callbacks requested from anywhere, run in *ioloop*'s thread (registered now, in it)."""

    def __init__(self, ioloop: IOLoop) -> None:
        self._ioloop = ioloop
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._pending: deque[Callable[[], None]] = deque()
        ioloop.add_handler(self._read, self._on_readable, PollEvents.READ)

    def request(self, callback: Callable[[], None]) -> None:
        """Run *callback* in the loop's thread soon; safe in a signal handler and from any thread."""
        self._pending.append(callback)
        with suppress(OSError):  # full (a wake-up is already due) or closed (the loop is gone)
            os.write(self._write, b"\0")

    def _on_readable(self, _fd: int, _events: int) -> None:
        with suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass
        while self._pending:
            self._pending.popleft()()

    def close(self) -> None:
        """Unregister and close the pipe (before the loop is closed)."""
        if self._read < 0:
            return
        self._ioloop.remove_handler(self._read)
        os.close(self._read)
        os.close(self._write)
        self._read = self._write = -1
