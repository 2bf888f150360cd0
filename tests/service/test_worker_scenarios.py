"""``run``'s scenarios, written once and run twice: on the worker in memory (MemoryLink,
milliseconds) and against RabbitMQ with real processes (the broker suite). What must hold
is the same in both; the in-memory runs also check every ack and every rejection as it is
made (scenariokit.MemoryBackend).
"""

from __future__ import annotations

import orjson
import pytest
from scenariokit import Backend, Control, memory_backend, rabbit_backend, threads_left
from support import new_event, read_rows

from delivery_consumer.amqp.topology import H_ATTEMPTS, H_ERROR_CODE
from delivery_consumer.model.errors import DELIVERY_LIMIT, MALFORMED_JSON, RETRIES_EXHAUSTED

__all__ = ["memory_backend", "rabbit_backend"]  # fixtures, used through `backend`

FAST_RETRY = (100, 200, 300)


@pytest.fixture(params=["memory", pytest.param("rabbitmq", marks=pytest.mark.broker)])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each scenario in memory, then against RabbitMQ."""
    made: Backend = request.getfixturevalue(f"{'memory' if request.param == 'memory' else 'rabbit'}_backend")
    return made


@pytest.fixture(autouse=True)
def no_worker_left() -> object:
    """No worker thread outlives its scenario."""
    yield
    assert [] == threads_left()


def events(*titles: str) -> list[bytes]:
    return [orjson.dumps(new_event(article_id=f"a-{i}", title=title)) for i, title in enumerate(titles)]


def applied(backend: Backend) -> list[str]:
    """Titles applied by the flaky consumer, one per application."""
    return sorted(r[0] for r in read_rows(backend.db, "flaky", "title"))


def test_a_transient_failure_retries_through_the_tiers_then_applies_once(backend: Backend) -> None:
    """An effect that fails twice transiently goes through two retry tiers and is applied once, at
    its third attempt, counted durably; nothing is dead-lettered."""
    backend.publish(events("transient:2", "fine"))
    assert not backend.run(retry_delays_ms=FAST_RETRY).crashed
    assert ["fine", "transient:2"] == applied(backend)
    assert [(3, "recorded")] == read_rows(backend.db, "deliveries", "attempts, last_outcome")
    assert [] == backend.dead()
    assert 0 == backend.left()


def test_transient_failures_past_max_attempts_are_dead_lettered_retries_exhausted(backend: Backend) -> None:
    """After max_attempts transient failures the event's copy goes to the dead queue as
    retries-exhausted with its attempt count, and the rejection is recorded with it."""
    body, fine = events("transient:99", "fine")
    backend.publish([body, fine])
    assert not backend.run(retry_delays_ms=FAST_RETRY, max_attempts=3).crashed
    ((headers, dead),) = backend.dead()
    assert body == dead
    assert (RETRIES_EXHAUSTED, 3) == (headers[H_ERROR_CODE], headers[H_ATTEMPTS])
    assert [(RETRIES_EXHAUSTED, 3)] == read_rows(backend.db, "rejected", "code, attempts")
    assert ["fine"] == applied(backend)
    assert 0 == backend.left()


def test_a_poison_message_is_dead_lettered_delivery_limit_and_its_neighbours_applied_once(
        backend: Backend) -> None:
    """A message that kills its process every time is dead-lettered delivery-limit after exactly
    max_crashes deaths while handled alone (a death in a batch only makes suspects), never
    applied; every other message is applied once."""
    bodies = events("a", "b", "poison", "c", "d")
    backend.publish(bodies)
    deaths = 0
    while backend.run(max_crashes=2).crashed:
        deaths += 1
        assert deaths <= 3
    assert deaths in (2, 3)  # 3 when the first death was in a batch
    assert ["a", "b", "c", "d"] == applied(backend)
    ((headers, dead),) = backend.dead()
    assert (bodies[2], DELIVERY_LIMIT) == (dead, headers[H_ERROR_CODE])
    poison = orjson.loads(bodies[2])["eventId"]
    assert [(poison, 2)] == read_rows(backend.db, "deliveries", "key, crashes", "crashes > 0")
    assert [(DELIVERY_LIMIT,)] == read_rows(backend.db, "rejected", "code")
    assert 0 == backend.left()


def test_a_dead_copy_is_recorded_only_after_the_broker_confirms_it(backend: Backend) -> None:
    """A dead copy the broker does not confirm gives up the channel: nothing is recorded or
    acked for it, the message comes back, and its next copy, confirmed, is recorded once."""
    fine = events("fine")

    def refuse_then_publish(control: Control) -> None:
        control.refuse_next_copy()
        control.publish([b"{not json", *fine])

    assert not backend.run(during=refuse_then_publish).crashed
    ((headers, dead),) = backend.dead()
    assert (b"{not json", MALFORMED_JSON) == (dead, headers[H_ERROR_CODE])
    assert [(MALFORMED_JSON,)] == read_rows(backend.db, "rejected", "code")
    assert ["fine"] == applied(backend)
    assert 0 == backend.left()


def test_a_crash_between_commit_and_ack_applies_each_event_once(backend: Backend) -> None:
    """The ack comes only after the commit: a process that dies between the two leaves its batch
    unacked, and the next run answers it from the receipts (duplicates), applying nothing twice."""
    backend.publish(events("a", "b", "c"))
    assert backend.run(crash_at="after-commit").crashed
    assert ["a", "b", "c"] == applied(backend)
    assert 0 < backend.left()
    assert not backend.run().crashed
    assert ["a", "b", "c"] == applied(backend)
    outcomes = {r[0] for r in read_rows(backend.db, "deliveries", "last_outcome")}
    assert {"duplicate:recorded"} == outcomes
    assert 0 == backend.left()
    assert [] == backend.dead()


def test_a_store_outage_holds_the_deliveries_spends_no_attempt_and_applies_once(backend: Backend) -> None:
    """The database failing as a whole (disk full) is nobody's fault: the deliveries are held,
    no attempt is spent, nothing is retried or dead-lettered, and once it works each event is
    applied once."""
    backend.publish(events("outage:2", "fine"))
    assert not backend.run(retry_delays_ms=FAST_RETRY).crashed
    assert ["fine", "outage:2"] == applied(backend)
    assert [] == read_rows(backend.db, "deliveries", "key", "attempts > 1")
    assert [] == read_rows(backend.db, "rejected")
    assert [] == backend.dead()
    assert 0 == backend.left()


def test_a_lost_channel_redelivers_what_was_in_hand_and_applies_it_once(backend: Backend) -> None:
    """The connection dies while a batch is inside its transaction: its commit stands, its ack
    (of a channel that is gone) is dropped, and the redelivery is answered from the receipt."""

    def lose_the_channel_mid_batch(control: Control) -> None:
        control.publish(events("stall"))
        control.stalled()
        control.lose_channel()
        control.release()

    assert not backend.run(batch=1, during=lose_the_channel_mid_batch).crashed
    assert ["stall"] == applied(backend)
    assert [("duplicate:recorded",)] == read_rows(backend.db, "deliveries", "last_outcome")
    assert 0 == backend.left()
    assert [] == backend.dead()
