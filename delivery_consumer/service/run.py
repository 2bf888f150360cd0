"""``run()``: start the worker process, run the connection in this one, stop both."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..amqp.consumer import ConsumerIO
from ..model.deliveries import ObserverFactory
from ..model.errors import BrokerError, BrokerUnavailable, ConfigError, DatabaseError, DeliveryError, StoreOutage
from .link import WorkerLink
from .messages import Dispatch, Failed, Ready, Stop, ToConnection
from .settings import RunConfig
from .worker_process import worker_main

if TYPE_CHECKING:
    from ..amqp.topology import Topology
    from ..observability.metrics import RunExposition

log = logging.getLogger("delivery_consumer.run")

#: What either process may write to the pipe before a write waits for the
#: other to read (the kernel caps it at net.core.wmem_max).
PIPE_BUFFER_BYTES = 4 << 20
#: How long a run that took over its database waits for the previous holder's
#: metrics port (freed when that run's process ends).
PORT_WAIT_S = 5.0


def _roomy(end: Connection) -> None:
    """Let *end* hold a whole prefetch window unread: the worker reads
    between batches, and the connection process must not stop receiving
    (and acking) while it waits for that."""
    with suppress(OSError), socket.socket(fileno=os.dup(end.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIPE_BUFFER_BYTES)


class _Stopped(Exception):
    """SIGTERM/SIGINT before the run started."""


class _StopSignal:
    """SIGTERM/SIGINT over the whole of ``run``, from its first step to its last: a signal is
    never lost between two steps (a standby that takes over as it is told to stop must stop).
    It is recorded (:attr:`signum`); while :attr:`interrupting`, it interrupts what is under
    way (:class:`_Stopped`); once consuming, :attr:`then` stops the run."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.interrupting = False
        self.then: Callable[[int], None] | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        if self.interrupting:
            self.interrupting = False
            raise _Stopped
        if self.then is not None:
            self.then(signum)

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a stop"


def _started(parent_end: Connection, process: BaseProcess, stop: _StopSignal) -> bool:
    """Wait for the worker's first word (it may wait long: a partition's standby
    waits for the database's lock). False when SIGTERM/SIGINT came before it: the
    worker, which holds nothing acked, is killed and run ends (exit 0). A word that
    came with the signal is the caller's to read (:func:`_stop_worker`)."""
    while stop.signum is None and not parent_end.poll(0.2):
        if not process.is_alive():
            break
    if stop.signum is not None and not parent_end.poll(0):
        log.info("%s received before consuming: stopping", stop.name())
        process.kill()  # it ignores SIGTERM; it has acked nothing and holds only the lock
        process.join()
        return False
    return True


def _stop_worker(parent_end: Connection, process: BaseProcess, stop: _StopSignal) -> None:
    """The worker said it is ready, and a stop came before the connection: tell it to stop
    (it closes its database; nothing was received, nothing is acked) and wait for it;
    DatabaseError when it failed."""
    log.info("%s received before consuming: stopping", stop.name())
    failed: list[Failed] = []
    with suppress(OSError):
        parent_end.send(Stop())
    deadline = time.monotonic() + 30
    _read_to_the_end(parent_end, process, lambda: time.monotonic() < deadline,
                     Dispatch[ToConnection](default=lambda _m: None).on(Failed, failed.append))
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    if failed:
        raise (StoreOutage if failed[-1].outage else DatabaseError)(failed[-1].message)


def _read_to_the_end(parent_end: Connection, process: BaseProcess, reading: Callable[[], bool],
                     handle: Callable[[Any], None]) -> None:
    """Hand *handle* each message the worker still sends while *reading()* holds, until the pipe
    breaks or the worker is gone and its pipe empty: what it sent before it ended is in the pipe
    by then (a Failed may come between a poll and the look at the process, so look once more)."""
    while reading():
        try:
            if not parent_end.poll(0.1):
                if not process.is_alive() and not parent_end.poll(0):
                    return
                continue
            message = parent_end.recv()
        except (EOFError, OSError):
            return
        handle(message)


def _refuse_a_second_layout(config: RunConfig, topology: Topology, stop: _StopSignal) -> bool:
    """An unpartitioned run of a consumer the broker holds partitioned would bind its own queue
    beside the partitions and apply every event twice: refuse it (ConfigError, exit 2). A broker
    that does not answer now is not a reason to stop: the run reconnects as it always does.
    False when SIGTERM/SIGINT came while asking (the run ends, exit 0)."""
    if config.partition is not None:
        return True
    from ..amqp.partition_queues import layout_conflict

    conflict: str | None = None
    try:
        try:
            stop.interrupting = stop.signum is None
            conflict = layout_conflict(config.url, topology, None)
        finally:
            stop.interrupting = False
    except BrokerUnavailable as exc:
        log.debug("layout not checked, the broker does not answer: %s", exc)
    except _Stopped:
        pass
    if stop.signum is not None:
        log.info("%s received before consuming: stopping", stop.name())
        return False
    if conflict is not None:
        raise ConfigError(conflict)
    return True


def _serve_as_holder(serve: Callable[[], RunExposition], stop: _StopSignal) -> RunExposition | None:
    """*serve* once this run holds its database: the port may still be the previous
    holder's for a moment (its process is ending); DeliveryError when it stays taken,
    None when a stop came meanwhile."""
    deadline = time.monotonic() + PORT_WAIT_S
    while stop.signum is None:
        try:
            return serve()
        except DeliveryError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    return None


def run(config: RunConfig, observer_factory: ObserverFactory | None = None,
        serve: Callable[[], RunExposition] | None = None) -> int:
    """Run the consumer until SIGTERM/SIGINT or idle; returns the exit code.

    Starts the worker process (database) and runs the connection in this
    one. Raises DatabaseError or BrokerError (fatal) for the CLI to report,
    StoreOutage when the database stayed unusable past the outage limit.
    *observer_factory* is called in the worker process (metrics are kept
    there); *serve* in this one at once: it starts ``/metrics`` (raising
    DeliveryError when it cannot), which this process answers, a partition's
    standby included while it waits (``delivery_active`` 0). A port taken
    (the active run of the partition on this host) is tried again once this
    run holds its database; then a failure is fatal. ``/metrics`` is closed
    when run returns.
    """
    served: list[RunExposition] = []
    stop = _StopSignal()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(config, observer_factory, serve, served, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for exposition in served:
            exposition.close()


def _run(config: RunConfig, observer_factory: ObserverFactory | None,
         serve: Callable[[], RunExposition] | None, served: list[RunExposition], stop: _StopSignal) -> int:
    topology = config.topology()
    if not _refuse_a_second_layout(config, topology, stop):
        return 0
    context = multiprocessing.get_context("fork")  # before any connection or thread exists
    parent_end, child_end = context.Pipe(duplex=True)
    _roomy(parent_end)
    _roomy(child_end)
    process = context.Process(target=worker_main, args=(config, child_end, parent_end, observer_factory),
                              name=f"delivery-worker-{config.consumer}")
    process.start()
    child_end.close()
    link = WorkerLink(parent_end, process)
    busy: DeliveryError | None = None
    if serve is not None:
        try:
            link.exposition = serve()
            served.append(link.exposition)
        except DeliveryError as exc:
            busy = exc
            if config.partition is not None:
                log.info("metrics port busy: serving metrics once this run takes over (%s)", exc)
    if not _started(parent_end, process, stop):
        return 0
    try:
        first = parent_end.recv()
    except EOFError:
        process.join()
        raise DatabaseError(f"the worker process exited at start-up (exit code {process.exitcode})") from None
    if isinstance(first, Failed):
        process.join()
        raise (StoreOutage if first.outage else DatabaseError)(first.message)
    if serve is not None and busy is not None and stop.signum is None:
        try:
            if config.partition is None:
                raise busy  # no standby waited for it: taken by something else
            link.exposition = _serve_as_holder(serve, stop)
            if link.exposition is not None:
                served.append(link.exposition)
        except DeliveryError:
            parent_end.send(Stop())
            process.join(30)
            raise
    if stop.signum is not None:  # it came as the worker took over: it must not start consuming
        _stop_worker(parent_end, process, stop)
        return 0
    if link.exposition is not None and isinstance(first, Ready):
        link.exposition.active(True)
    io = ConsumerIO(
        config.url,
        topology,
        prefetch=config.prefetch,
        on_delivery=link.deliver,
        on_channel=link.channel,
        on_lost=link.lost,
        name=f"delivery-consumer run {config.consumer}",
        # a one-shot run (--exit-when-idle) must not wait forever for a broker it never reached
        first_connect_s=config.exit_when_idle_s,
    )
    link.io = io
    io.watch(parent_end.fileno(), link.readable)

    def on_signal(signum: int) -> None:
        log.info("%s received: finishing the current batch", signal.Signals(signum).name)
        link.stop()
        io.cancel()

    stop.then = on_signal
    if stop.signum is not None:  # it came between the last look and now
        on_signal(stop.signum)
    try:
        io.run()
    except BrokerError:
        link.stop()
        process.join(10)
        if process.is_alive():
            process.terminate()
        raise
    finally:
        stop.then = None
    # The loop ended because the worker asked for it (idle, stop, fatal) or is
    # gone. Read what it still has to say: only a failure matters now (its last
    # acks are moot: the connection is closed and the broker will redeliver
    # those messages).
    last_words: Dispatch[ToConnection] = Dispatch(default=lambda _m: None).on(Failed, link.failure)
    _read_to_the_end(parent_end, process, lambda: not link.closed, last_words)
    process.join(30)
    if process.is_alive():
        process.terminate()
        process.join()
    if link.failed is not None:
        raise (StoreOutage if link.failed.outage else DatabaseError)(link.failed.message)
    if process.exitcode:
        raise DatabaseError(f"the worker process exited with code {process.exitcode}")
    return 0
