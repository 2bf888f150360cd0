"""A stop requested from a signal handler reaches pika's loop without taking pika's lock.

pika's ``add_callback_threadsafe`` takes a non-reentrant lock that pika itself
takes in the loop's thread while it connects: a SIGTERM handled there, calling
it again, waited for itself forever (dispatch hung on SIGTERM while it retried
an unreachable broker). The tests hold that lock in the requesting thread, as
the interrupted thread does, and give each request 10 s to return.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pika.adapters.select_connection import IOLoop

from delivery_consumer.amqp.publisher import StreamPublisher
from delivery_consumer.amqp.wakeup import Wakeup


def returns_while_pikas_lock_is_held(ioloop: IOLoop, request: Callable[[], None]) -> bool:
    """Whether *request*, made by a thread that holds *ioloop*'s waking lock, returns."""
    lock = ioloop._poller._waking_mutex

    def body() -> None:
        with lock:
            request()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(10)
    return not thread.is_alive()


def test_a_request_returns_while_the_thread_holds_pikas_lock_and_runs_on_the_loops_next_turn() -> None:
    """Wakeup.request never waits for pika's lock; the callback runs in the loop, in order, once each."""
    ioloop = IOLoop()
    wakeup = Wakeup(ioloop)
    ran: list[int] = []
    assert returns_while_pikas_lock_is_held(ioloop, lambda: wakeup.request(lambda: ran.append(1)))
    assert returns_while_pikas_lock_is_held(ioloop, lambda: wakeup.request(lambda: (ran.append(2), ioloop.stop())))
    guard = ioloop.call_later(10, ioloop.stop)
    ioloop.start()
    ioloop.remove_timeout(guard)
    assert ran == [1, 2]
    wakeup.close()
    wakeup.close()  # twice is harmless
    ioloop.close()


def test_a_publishers_interrupt_returns_while_the_thread_holds_pikas_lock() -> None:
    """StreamPublisher.interrupt (dispatch's SIGTERM handler) returns while its thread holds pika's lock."""
    publisher = StreamPublisher("amqp://guest:guest@127.0.0.1:1/%2F", timeout_s=1)
    # Not closed when it hung: closing takes the lock the hung thread holds.
    assert returns_while_pikas_lock_is_held(publisher._ioloop, publisher.interrupt), "interrupt waited for pika's lock"
    publisher.close()
