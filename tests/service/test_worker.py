"""The worker of ``run`` in memory: a real SQLite file, its connection on
:class:`~delivery_consumer.service.memory_link.MemoryLink` instead of RabbitMQ
and the other process.

:class:`Recorder` keeps every request in order, with what an independent
reader of the database saw at that moment, so each test can say which
commit came before which ack or copy (tests/service/test_worker_scenarios.py runs
whole scenarios; these look at one step).
"""

from __future__ import annotations

import pickle
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import body, new_event, read_rows

from delivery_consumer.amqp.topology import H_ATTEMPTS, H_ERROR_CODE
from delivery_consumer.inbox import InFlight
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.deliveries import Delivery, OutMessage, delivery_key
from delivery_consumer.model.envelope import Envelope
from delivery_consumer.model.errors import (
    DELIVERY_LIMIT,
    MALFORMED_JSON,
    RETRIES_EXHAUSTED,
    TransientError,
)
from delivery_consumer.service.memory_link import MemoryLink, MemoryQueues
from delivery_consumer.service.messages import (
    Ack,
    Deliveries,
    Dispatch,
    ProtocolError,
    PublishCopies,
    Stop,
    ToConnection,
    pack,
)
from delivery_consumer.service.settings import RunConfig
from delivery_consumer.service.worker import Worker

#: A name of a process that no longer exists (another boot): its notes are a crash's.
GONE = "gone:1:1"


@dataclass
class Call:
    """One request of the worker, with the committed state at that moment."""

    kind: str  # "ack" | "publish" | "reconnect" | "shutdown"
    generation: int = 0
    tag: int = 0
    multiple: bool = False
    messages: list[OutMessage] = field(default_factory=list)
    #: eventIds with a receipt, and rejection codes in ``rejected``, as committed then.
    receipts: set[str] = field(default_factory=set)
    rejected: list[str] = field(default_factory=list)


class Recorder:
    """The requests of a worker on a MemoryLink, each with what an independent reader of the
    database saw when it was made."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.calls: list[Call] = []
        self.changed = threading.Condition()
        self.link: MemoryLink | None = None

    def __call__(self, request: ToConnection) -> None:
        if isinstance(request, Ack):
            call = Call("ack", request.generation, request.tag, request.multiple)
        elif isinstance(request, PublishCopies):
            call = Call("publish", request.generation, messages=list(request.messages))
        else:
            call = Call(type(request).__name__.lower())
        if self.db_path.exists():
            call.receipts = {r[0] for r in read_rows(self.db_path, "inbox", "event_id")}
            call.rejected = [r[0] for r in read_rows(self.db_path, "rejected", "code")]
        with self.changed:
            self.calls.append(call)
            self.changed.notify_all()

    def kinds(self) -> list[str]:
        return [c.kind for c in self.calls]

    def acks(self) -> list[Call]:
        return [c for c in self.calls if c.kind == "ack"]

    def wait_for(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(done, timeout), f"not reached; calls so far: {self.kinds()}"


def on_memory_link(worker: Worker) -> Recorder:
    """Give an opened *worker* a MemoryLink on channel generation 1, its requests kept by a Recorder."""
    io = Recorder(worker.config.database_path())
    io.link = MemoryLink(MemoryQueues(worker.topology), worker, on_request=io)
    worker.io = io.link
    io.link.pump(0)  # the first channel
    return io


@pytest.fixture
def make_worker(tmp_path: Path) -> Iterator[Callable[..., tuple[Worker, Recorder]]]:
    """An opened worker on channel generation 1 of a fresh database, on a MemoryLink."""
    made: list[Worker] = []

    def make(consumer: str = "catalog", **options: Any) -> tuple[Worker, Recorder]:
        config = RunConfig(consumer=consumer, url="memory:", db_path=tmp_path / f"{consumer}.db", **options)
        worker = Worker(config)
        assert worker.open(), worker.error
        io = on_memory_link(worker)
        made.append(worker)
        return worker, io

    yield make
    for worker in made:
        if worker.is_alive():
            worker.stop_requested.set()
            worker.join(10)
        elif worker.db is not None and not worker.stop_requested.is_set():
            worker.close()


def delivery(tag: int, payload: bytes | None = None, *, generation: int = 1, redelivered: bool = False,
             message_id: str | None = None, headers: dict[str, Any] | None = None) -> Delivery:
    if payload is None:
        event = new_event(article_id=f"article-{tag}")
        payload, message_id = body(event), message_id or event["eventId"]
    return Delivery(generation, tag, payload, "material.published", redelivered, message_id, headers or {},
                    "application/json", "events")


def event_id(d: Delivery) -> str:
    assert d.message_id is not None
    return d.message_id


def test_a_batch_is_acked_once_and_only_after_its_commit(make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """One batch gives one ``multiple`` ack of its last tag, and when it is
    sent every receipt of the batch is already committed."""
    worker, io = make_worker()
    batch = [delivery(tag) for tag in (1, 2, 3)]
    worker.process(batch)
    assert ["ack"] == io.kinds()
    ack = io.calls[0]
    assert (1, 3, True) == (ack.generation, ack.tag, ack.multiple)
    assert {event_id(d) for d in batch} == ack.receipts
    assert 3 == worker.stats.acked


def test_batches_settle_in_tag_order(make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """The worker's thread cuts deliveries into batches and acks them in tag
    order, each ack after the commit of every delivery it covers."""
    worker, io = make_worker(batch=2)
    deliveries = [delivery(tag) for tag in range(1, 6)]
    worker.deliver_all(deliveries)
    worker.start()
    io.wait_for(lambda: len(io.acks()) == 3)
    acks = io.acks()
    assert [2, 4, 5] == [a.tag for a in acks]
    for ack in acks:
        covered = {event_id(d) for d in deliveries if d.tag <= ack.tag}
        assert covered <= ack.receipts
    worker.stop_requested.set()
    worker.join(10)
    assert not worker.is_alive() and worker.error is None
    assert "shutdown" == io.kinds()[-1]


def test_deliveries_of_a_lost_channel_are_not_handled(make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """Deliveries of a channel that is gone are dropped (the broker redelivers
    them); those of the new channel are handled and acked on it."""
    worker, io = make_worker()
    old = delivery(1)
    worker.deliver(old)
    worker.channel_lost(1, "connection reset")
    worker.channel_opened(2)
    new = delivery(1, generation=2)
    worker.deliver(new)
    worker.start()
    io.wait_for(lambda: bool(io.acks()))
    assert [(2, 1)] == [(a.generation, a.tag) for a in io.acks()]
    assert {event_id(new)} == io.acks()[0].receipts


def test_a_rejection_is_dead_lettered_confirmed_and_recorded_before_the_ack(
        make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """A body that cannot be parsed goes to the dead queue with its code;
    the ack of its batch comes after the broker confirmed that copy and
    after the rejection was committed in ``rejected`` (not before the confirm)."""
    worker, io = make_worker()
    bad = delivery(2, b"{not json", message_id=str(uuid.uuid4()))
    batch = [delivery(1), bad, delivery(3)]
    worker.process(batch)
    assert ["publish", "ack"] == io.kinds()
    publish, ack = io.calls
    (copy,) = publish.messages
    assert worker.topology.dead_queue == copy.routing_key
    assert b"{not json" == copy.body
    assert copy.headers is not None and MALFORMED_JSON == copy.headers[H_ERROR_CODE]
    assert [] == publish.rejected  # recorded only once the copy is safe
    assert [MALFORMED_JSON] == ack.rejected
    assert 3 == ack.tag
    assert {event_id(batch[0]), event_id(batch[2])} == ack.receipts


def test_an_unaccepted_copy_holds_its_delivery_and_the_rest_goes_on(
        make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """When the broker does not accept a dead-letter copy (nacked, returned) its delivery is held
    unacked, the others are acked one by one (a cumulative ack would take the held one), nothing is
    recorded as dead-lettered; once the copy is accepted the held delivery is acked, its rejection
    recorded, and its attempt count is the one it had: the outage spent nothing."""
    worker, io = make_worker()
    assert io.link is not None
    io.link.refuse_copies(1)
    reused = str(uuid.uuid4())
    worker.process([delivery(1), delivery(2, b"[]", message_id=reused), delivery(3)])
    assert ["publish", "ack", "ack"] == io.kinds()
    assert [(1, False), (3, False)] == [(c.tag, c.multiple) for c in io.acks()]
    assert worker.db is not None and [] == read_rows(worker.db.path, "rejected")
    later = delivery(4)
    worker.process([later])  # the channel goes on; 2 is still held below it
    assert (4, False) == (io.calls[-1].tag, io.calls[-1].multiple)
    worker._holds[0].next_at = 0.0  # its backoff is over
    worker._retry_holds()
    assert ["publish", "ack"] == io.kinds()[-2:]
    retried, released = io.calls[-2:]
    assert (2, True) == (released.tag, released.multiple)
    assert 1 == retried.messages[0].headers[H_ATTEMPTS]
    assert [MALFORMED_JSON] == released.rejected
    assert not worker._holds


def test_a_held_delivery_of_a_channel_that_went_is_left_to_the_broker(
        make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """A delivery held for its copy on a channel that is gone is dropped: the broker redelivers it."""
    worker, io = make_worker()
    assert io.link is not None
    io.link.refuse_copies(1)
    worker.process([delivery(1, b"[]", message_id=str(uuid.uuid4()))])
    assert ["publish"] == io.kinds() and worker._holds
    worker.channel_lost(1, "connection reset")
    assert not worker._holds


def flaky_spec() -> ConsumerSpec:
    def apply(conn: sqlite3.Connection, env: Envelope) -> str:
        if env.data["title"] == "transient":
            raise TransientError("dependency down", code="dependency-down")
        return "recorded"

    return ConsumerSpec(name="wobbly", apply=apply, migrations=(), binding_keys=("material.*",))


def test_a_transient_failure_is_retried_by_a_copy_confirmed_before_the_ack(
        make_worker: Callable[..., tuple[Worker, Recorder]], register: Callable[[ConsumerSpec], ConsumerSpec]) -> None:
    """A transient failure sends a copy to the first retry tier with the
    attempt counted, confirmed before the ack; at the last attempt the copy
    goes to the dead queue as retries-exhausted instead."""
    register(flaky_spec())
    worker, io = make_worker("wobbly", max_attempts=2)
    first = delivery(1, body(new_event(title="transient")))
    worker.process([first])
    assert ["publish", "ack"] == io.kinds()
    (copy,) = io.calls[0].messages
    assert worker.topology.retry_queue(0) == copy.routing_key
    assert copy.headers is not None and 1 == copy.headers[H_ATTEMPTS]
    assert set() == io.calls[1].receipts
    again = delivery(2, first.body, message_id=first.message_id, headers=copy.headers)  # the copy, sealed
    worker.process([again])
    (dead,) = io.calls[2].messages
    assert worker.topology.dead_queue == dead.routing_key
    assert dead.headers is not None and RETRIES_EXHAUSTED == dead.headers[H_ERROR_CODE]
    assert [RETRIES_EXHAUSTED] == io.calls[3].rejected


def test_suspects_of_a_crashed_batch_are_handled_alone(make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """Keys that were in a batch when its process died are redelivered one by
    one, each acked alone, while their neighbours still go together, and
    acks stay in tag order."""
    worker, io = make_worker()
    assert worker.db is not None
    batch = [delivery(tag) for tag in range(1, 6)]
    suspects = [batch[1], batch[2]]
    InFlight(worker.db, owner=GONE).mark([delivery_key(d) for d in suspects])
    for d in suspects:
        d.redelivered = True
    worker.process(batch)
    assert [1, 2, 3, 5] == [a.tag for a in io.acks()]
    assert {event_id(d) for d in batch} == io.acks()[-1].receipts


def test_a_poison_message_is_dead_lettered_without_being_applied(
        make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """A message that killed the process max_crashes times, each time alone,
    is dead-lettered as delivery-limit and acked, never applied again; its
    neighbours are applied."""
    worker, io = make_worker(max_crashes=2)
    assert worker.db is not None
    poison, fine = delivery(1, redelivered=True), delivery(2)
    for n in range(2):
        InFlight(worker.db, owner=f"gone:{n}:1").mark([delivery_key(poison)])
    worker.process([poison, fine])
    assert ["publish", "ack", "ack"] == io.kinds()
    (copy,) = io.calls[0].messages
    assert copy.headers is not None and DELIVERY_LIMIT == copy.headers[H_ERROR_CODE]
    assert [DELIVERY_LIMIT] == io.calls[1].rejected and 1 == io.calls[1].tag
    assert {event_id(fine)} == io.calls[2].receipts


def test_a_poison_message_with_a_receipt_is_answered_by_it(make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """A message past its crash limit whose event is already applied is not
    dead-lettered: the receipt answers it (duplicate) and it is acked."""
    worker, io = make_worker(max_crashes=1)
    assert worker.db is not None
    applied = delivery(1)
    worker.process([applied])
    InFlight(worker.db, owner=GONE).mark([delivery_key(applied)])
    again = delivery(2, applied.body, message_id=applied.message_id, redelivered=True)
    worker.process([again])
    assert ["ack", "ack"] == io.kinds()
    assert [] == io.calls[1].rejected


def test_messages_cross_the_pipe_and_dispatch_by_type() -> None:
    """Deliveries survive pickling in their packed form; a message is
    dispatched by its type, and one without a handler is a ProtocolError."""
    d = delivery(7, headers={"x-attempts": 2})
    message = pickle.loads(pickle.dumps(Deliveries(1, [pack(d)])))
    assert [d] == message.unpack()
    seen: list[object] = []
    dispatch: Dispatch[object] = Dispatch().on(Ack, seen.append)
    dispatch(Ack(1, 7))
    assert [Ack(1, 7)] == seen
    with pytest.raises(ProtocolError):
        dispatch(Stop())


def test_the_exit_line_s_rate_leaves_idle_time_out(make_worker: Callable[..., tuple[Worker, Recorder]]) -> None:
    """Two batches with an idle pause between them: the busy time excludes the pause, the rate in the
    exit line is deliveries over busy time, and counts of one are singular."""
    worker, _io = make_worker()
    worker.deliver_all([delivery(1)])
    worker.process(worker._collect())
    assert "1 delivery acked in 1 batch:" in worker.stats.line()
    threading.Event().wait(0.2)  # the consumer idles (the scenario, not a synchronisation)
    worker.deliver_all([delivery(2), delivery(3), delivery(4)])
    worker.process(worker._collect())
    stats = worker.stats
    span = stats.last_ack - stats.first_delivery
    assert 0 < stats.busy_s <= span - 0.2
    assert "4 deliveries acked in 2 batches: 4 updated;" in stats.line()
    assert stats.line().endswith(f"{span:.3f}s, {stats.busy_s:.3f}s busy ({4 / stats.busy_s:.0f}/s)")
