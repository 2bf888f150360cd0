"""The connection process's end of the pipe to the worker, driven by the
connection's I/O loop: deliveries out, acks and copies in."""

from __future__ import annotations

import logging
import os
import signal
from collections import deque
from concurrent.futures import Future
from contextlib import suppress
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from ..amqp.consumer import ConsumerIO
from ..model.deliveries import Delivery
from ..model.faults import crashpoint
from .messages import (
    Ack,
    ChannelLost,
    ChannelOpened,
    CopiesSettled,
    Deliveries,
    Dispatch,
    Failed,
    Packed,
    PublishCopies,
    Reconnect,
    Shutdown,
    Stop,
    ToConnection,
    ToWorker,
    Vitals,
    pack,
)

if TYPE_CHECKING:
    from ..observability.metrics import RunExposition

log = logging.getLogger("delivery_consumer.run")


class WorkerLink:
    """Sends the worker its deliveries and channel news; carries out what it asks."""

    def __init__(self, conn: Connection, process: BaseProcess, exposition: RunExposition | None = None) -> None:
        self.conn = conn
        self.process = process
        #: ``/metrics``, served here: the connection state, the worker's vitals.
        self.exposition = exposition
        self.io: ConsumerIO | None = None
        self.failed: Failed | None = None
        self.closed = False
        #: A send is under way; what a signal handler sends meanwhile waits in _deferred.
        self._sending = False
        self._deferred: deque[ToWorker] = deque()
        self._pending: list[Packed] = []
        self._pending_generation = 0
        self._dispatch: Dispatch[ToConnection] = (
            Dispatch()
            .on(Ack, self._ack)
            .on(PublishCopies, self._publish)
            .on(Reconnect, lambda m: self._io().reconnect_now(m.why))
            .on(Shutdown, lambda _m: self._io().shutdown_now())
            .on(Failed, self.failure)
            .on(Vitals, self.vitals)
        )

    def _io(self) -> ConsumerIO:
        assert self.io is not None
        return self.io

    # deliveries: buffered and sent once per turn of the loop
    def deliver(self, d: Delivery) -> None:
        if self._pending and d.generation != self._pending_generation:
            self._flush()
        if not self._pending:
            self._io().soon(self._flush)
            self._pending_generation = d.generation
        self._pending.append(pack(d))

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._send(Deliveries(self._pending_generation, pending))

    def _send(self, message: ToWorker) -> None:
        """Send *message*; one that a signal handler's :meth:`stop` sends while another is half
        written goes right after it (the pipe's bytes would interleave, and the worker read garbage)."""
        if self._sending:
            self._deferred.append(message)
            return
        while not self.closed:
            self._sending = True
            try:
                self.conn.send(message)
            except OSError:
                self._worker_gone()
            finally:
                self._sending = False
            if not self._deferred:
                return
            message = self._deferred.popleft()

    def channel(self, generation: int) -> None:
        if self.exposition is not None:
            self.exposition.connection_state(True, self.io.node if self.io is not None else None)
        self._send(ChannelOpened(generation))

    def lost(self, generation: int, why: str) -> None:
        if self.exposition is not None:
            self.exposition.connection_state(False)
        self._flush()
        self._send(ChannelLost(generation, why))

    def vitals(self, message: Vitals) -> None:
        if self.exposition is not None:
            self.exposition.worker_vitals(message.at, message.metrics)

    def stop(self) -> None:
        self._send(Stop())

    # messages from the worker
    def readable(self) -> None:
        try:
            while not self.closed and self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            self._worker_gone()

    def failure(self, message: Failed) -> None:
        self.failed = message

    def _ack(self, message: Ack) -> None:
        self._io().ack_now(message.generation, message.tag, multiple=message.multiple)

    def _publish(self, message: PublishCopies) -> None:
        future = self._io().publish_now(message.generation, message.messages)
        future.add_done_callback(partial(self._published, message.request))
        crashpoint("connection-awaiting-confirm")  # kills this process alone

    def _published(self, request: int, future: Future[None]) -> None:
        error = future.exception()
        self._send(CopiesSettled(request, str(error) if error else None))

    def _worker_gone(self) -> None:
        if self.closed:
            return
        self.closed = True
        io = self._io()
        with suppress(Exception):  # the loop may be closing already
            io.unwatch(self.conn.fileno())
        self.process.join(5)
        code = self.process.exitcode
        if code is not None and code < 0:
            # The worker was killed by a signal (a crash, the OOM killer): so is
            # run, at once and without acking anything more. The broker
            # redelivers every unacked message; the inbox absorbs them.
            log.error("worker process killed by %s; stopping without acking", signal.Signals(-code).name)
            os.kill(os.getpid(), -code)
        io.shutdown_now()
