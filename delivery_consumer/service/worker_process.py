"""The worker process of ``run``: the worker, its end of the pipe, and what it
does when the connection process dies (finish what is in hand, ack nothing)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from multiprocessing.connection import Connection
from types import FrameType

from ..inbox.database import IntegrityCheck
from ..model import faults
from ..model.deliveries import ObserverFactory, OutMessage
from ..model.errors import BrokerUnavailable, DeliveryError, StoreOutage
from ..observability import tracing
from ..store import liveness
from ..store.dbfile import LOCK_POLL_S, Holder, WriterLock, frozen_inside, holder_states, read_note
from .messages import (
    Ack,
    ChannelLost,
    ChannelOpened,
    CopiesSettled,
    Deliveries,
    Dispatch,
    Failed,
    PublishCopies,
    Ready,
    Reconnect,
    Shutdown,
    Stop,
    ToConnection,
    ToWorker,
    Vitals,
)
from .settings import RunConfig
from .worker import Worker

log = logging.getLogger("delivery_consumer.run")

#: How long the worker may take to finish what is in hand once the connection
#: process is gone (it can ack nothing more) before it exits regardless.
ORPHAN_GRACE_S = 2.0
#: How often the worker process looks at its parent (besides PR_SET_PDEATHSIG).
_PARENT_CHECK_S = 0.2
_PR_SET_PDEATHSIG = 1
#: How often the worker sends its metrics to the connection process, which serves them.
VITALS_EVERY_S = 1.0


class ConnectionProxy:
    """The worker's :class:`~.worker.WorkerIO` in the worker process: every
    call is a message, and the worker's own thread reads the answers
    (:meth:`pump`), so no other thread competes with it for the GIL."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._requests: dict[int, Future[None]] = {}
        self._next = 0
        self.gone = False
        #: What to do with each message from the connection process (set by worker_main).
        self.dispatch: Dispatch[ToWorker] = Dispatch()
        #: Called once the pipe says the connection process is gone.
        self.on_gone: Callable[[], None] = lambda: None
        #: The worker's metrics as exposition text (None: metrics are off).
        self.vitals: Callable[[], bytes] | None = None
        self._vitals_due = 0.0

    def pump(self, timeout: float) -> None:
        if self.vitals is not None and time.monotonic() >= self._vitals_due:
            # Sent from the worker's own thread between batches: a worker stuck
            # inside one leaves its heartbeat behind (docs/run.md, "Metrics").
            self._vitals_due = time.monotonic() + VITALS_EVERY_S
            self.send(Vitals(time.time(), self.vitals()))
        if self.gone:
            time.sleep(min(timeout, _PARENT_CHECK_S))  # nothing can come any more
            return
        conn = self._conn
        try:
            if conn.poll(timeout):
                self.dispatch(conn.recv())
                while conn.poll(0):
                    self.dispatch(conn.recv())
        except (EOFError, OSError):
            self.on_gone()

    def send(self, message: ToConnection) -> None:
        with self._lock:
            if self.gone:
                return
            try:
                self._conn.send(message)
            except OSError:  # the parent died: nothing can be acked any more
                self.gone = True

    def ack(self, generation: int, tag: int, *, multiple: bool = True) -> None:
        self.send(Ack(generation, tag, multiple))

    def publish_copies(self, generation: int, messages: Sequence[OutMessage]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            self._next += 1
            request = self._next
            self._requests[request] = future
        self.send(PublishCopies(request, generation, list(messages)))
        if self.gone:
            self.settle(CopiesSettled(request, "the connection process is gone"))
        return future

    def settle(self, answer: CopiesSettled) -> None:
        with self._lock:
            future = self._requests.pop(answer.request, None)
        if future is None or future.done():
            return
        if answer.error:
            future.set_exception(BrokerUnavailable(answer.error))
        else:
            future.set_result(None)

    def fail_all(self, why: str) -> None:
        with self._lock:
            requests = list(self._requests)
        for request in requests:
            self.settle(CopiesSettled(request, why))

    def reconnect(self, why: str) -> None:
        self.send(Reconnect(why))

    def shutdown(self) -> None:
        self.send(Shutdown())


def parent_stopped(parent: int) -> bool:
    """Whether the connection process is stopped (SIGSTOP): the run is frozen, its heartbeat stops."""
    return liveness.process_state(parent, None)[0] == liveness.STOPPED


def die_with_parent(parent: int) -> Callable[[], bool]:
    """Make the kernel tell this process when *parent* dies (Linux
    ``PR_SET_PDEATHSIG``, as SIGUSR1); returns a check that is True once it
    is gone (the signal arrived, or the parent pid changed: the portable
    fallback). The pipe's end of file says so too, but only to a reader; a
    worker blocked elsewhere must learn it as well."""
    told = [False]

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        told[0] = True

    signal.signal(signal.SIGUSR1, on_signal)
    with suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    return lambda: told[0] or os.getppid() != parent


def _take_the_lock(config: RunConfig, lock: WriterLock, parent: int) -> bool:
    """Take the database's writer lock (on the file itself) for this run: True when taken,
    False for a partition's standby that must wait for it; DatabaseInUse otherwise.
    A holder whose run is gone (an orphaned worker finishing its batch) is waited for."""
    if lock.db_path.is_dir():
        return True  # not a database: opening it says so
    with suppress(OSError):  # run creates a missing database, its directory first; opening says what fails
        lock.db_path.parent.mkdir(parents=True, exist_ok=True)
    if lock.try_acquire(parent, "run"):
        return True
    if _holder_gone(lock):
        deadline = time.monotonic() + ORPHAN_GRACE_S + 3.0
        while time.monotonic() < deadline:
            time.sleep(LOCK_POLL_S)
            if lock.try_acquire(parent, "run"):
                return True
    if config.partition is not None:
        return False
    lock.acquire(parent, "run")  # refused in one line, naming the holder
    return True


def _holder_gone(lock: WriterLock) -> bool:
    """Whether the process the note names has exited (its worker may still hold the lock)."""
    pid = read_note(lock.db_path)[0]
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _frozen(config: RunConfig, lock: WriterLock, holder: Holder, told: list[str]) -> bool:
    """Whether a waiting standby may take over from *holder*: it is proven frozen -- a
    process of this host and pid namespace, stopped (SIGSTOP, a debugger), silent for
    ``take_over_after_s`` -- and it holds neither SQLite's write lock nor the fence's
    serial lock (a transaction or a call it would finish when continued). Why that
    is safe: docs/failures.md, "A frozen active"."""
    limit = config.take_over_after_s
    if limit is None or holder.pid is None or holder.silent_s is None or holder.silent_s < limit:
        return False
    if not any(state == liveness.STOPPED for state in holder_states(lock, holder)):
        return False
    why = frozen_inside(lock)
    if why:
        if why not in told:
            told.append(why)
            log.error("standby: %s is frozen but %s: cannot take over safely; kill it (kill -9 %d) to fail over",
                      holder, why, holder.pid)
        return False
    return True


def worker_main(config: RunConfig, conn: Connection, parent_end: Connection,
                observer_factory: ObserverFactory | None) -> None:
    """The worker process: the database, batches, commits; asks the parent to ack."""
    # The parent's end of the pipe came with the fork: held here, it would keep
    # the pipe open after the parent's death and recv() would never end.
    parent_end.close()
    tracing.configure()  # OTEL_TRACES_EXPORTER set and opentelemetry-sdk installed: trace this process
    # The parent coordinates stopping (it gets SIGTERM/SIGINT and tells us);
    # a Ctrl-C to the whole process group must not kill a transaction.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    parent_gone = die_with_parent(parent)
    faults.also_kill(parent)  # a crash point kills the whole of run
    proxy = ConnectionProxy(conn)
    lock: WriterLock | None = None
    watched: IntegrityCheck | None = None
    # A file has one writer (its lock); a PostgreSQL inbox is shared by its runs safely (eventId locks).
    if config.db_url is None:
        lock = WriterLock(config.database_path())
        try:
            active = _take_the_lock(config, lock, parent)
        except DeliveryError as exc:
            conn.send(Failed(str(exc)))
            return
        if not active:
            with suppress(DeliveryError, OSError):  # checked whole while waiting: a takeover does not wait for it
                watched = IntegrityCheck(config.database_path(), on_done=lambda check: log.info(
                    "standby: %s checked whole in %.1fs: %s", check.path, check.seconds,
                    "damaged" if check.problem else "sound" if check.unavailable is None else check.unavailable))
            told: list[str] = []
            frozen: list[Holder] = []

            def take_over(holder: Holder) -> bool:
                if _frozen(config, lock, holder, told):
                    frozen.append(holder)
                    return True
                return False

            if not lock.wait(parent, "run", give_up=parent_gone, on_wait=lambda holder: log.info(
                    "standby: waiting for %s held by %s", config.database_path(), holder), take_over=take_over):
                return  # stopped (the connection process is gone) before taking over
            if frozen:
                log.warning("taking over: %s is ours now; its holder %s is frozen (it cannot write: "
                            "docs/failures.md, \"A frozen active\")", config.database_path(), frozen[-1])
            else:
                log.warning("taking over: %s is ours now", config.database_path())
            faults.pausepoint("standby-took-over")  # the lock is ours, the database not open yet
        lock.beat(alive=lambda: not parent_stopped(parent))
    try:
        observer = observer_factory() if observer_factory is not None else None
    except DeliveryError as exc:
        conn.send(Failed(str(exc)))
        return
    worker = Worker(config, observer)
    worker.io = proxy
    worker.lock = lock
    worker.watched = watched

    def orphaned() -> None:
        # Nothing can be acked any more: finish what is in hand, start nothing
        # new; the broker redelivers the rest to the next run.
        proxy.gone = True
        proxy.fail_all("the connection process is gone")
        worker.abandon()

    proxy.on_gone = orphaned
    proxy.dispatch = (
        Dispatch()
        .on(Deliveries, lambda m: worker.deliver_all(m.unpack()))
        .on(ChannelOpened, lambda m: worker.channel_opened(m.generation))
        .on(ChannelLost, lambda m: worker.channel_lost(m.generation, m.why))
        .on(CopiesSettled, proxy.settle)
        .on(Stop, lambda _m: worker.stop_requested.set())
    )
    worker.start()
    worker.ready.wait()
    if worker.error is not None:
        conn.send(Failed(str(worker.error), outage=isinstance(worker.error, StoreOutage)))
        return
    faults.pausepoint("worker-ready")  # the database is open, the connection process not told yet
    conn.send(Ready())
    text = getattr(observer, "text", None)
    if callable(text):  # only after Ready: the connection process reads Ready first
        proxy.vitals = lambda: str(text()).encode("utf-8")
    deadline: float | None = None
    while worker.is_alive():
        worker.join(_PARENT_CHECK_S)
        if deadline is None and (worker.abandoned.is_set() or parent_gone()):
            log.error("the connection process is gone; finishing what is in hand, acking nothing")
            orphaned()
            deadline = time.monotonic() + ORPHAN_GRACE_S
        elif deadline is not None and time.monotonic() > deadline and worker.is_alive():
            log.error("the worker did not stop within %.0fs of the connection process; exiting now", ORPHAN_GRACE_S)
            if worker.in_flight is not None:  # leaving on purpose: not a crash of what is under way
                worker.in_flight.forget()
            os._exit(1)  # like a crash: SQLite rolls back what was not committed
    if worker.live_generation or worker.stats.acked:  # never connected: the error alone says it
        log.info("exiting: %s", worker.stats.line())
    tracing.flush()  # this process ends with os._exit: no atexit
    if worker.error is not None:
        error = worker.error
        text = str(error) if isinstance(error, DeliveryError) else f"worker failed: {type(error).__name__}: {error}"
        proxy.send(Failed(text, outage=isinstance(error, StoreOutage)))
