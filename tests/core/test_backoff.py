"""Waiting out an outage: one line when it begins, one per change of reason, none per attempt; the delay grows."""

from __future__ import annotations

from delivery_consumer.amqp.backoff import Backoff


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_said_when_it_begins_and_when_its_reason_changes() -> None:
    """The first failure begins the outage, another reason changes it, the same reason again is not news."""
    outage = Backoff(clock=Clock())
    assert [outage.fail(why) for why in ("refused", "refused", "timed out", "timed out")] == \
        ["began", "same", "changed", "same"]


def test_the_delay_grows_to_its_cap_and_starts_again_after_the_outage() -> None:
    """Each attempt waits longer (jittered, capped); an outage that ended starts the next from the base."""
    clock = Clock()
    outage = Backoff(base_s=0.2, cap_s=10.0, clock=clock)
    outage.fail("busy")
    delays = [outage.delay() for _ in range(12)]
    assert delays[0] <= 0.2 and max(delays) <= 10.0 and delays[-1] >= 5.0
    assert outage.tries == 12
    assert outage.delay(spent=60.0) == 0.0  # the failed attempt took longer than the wait
    clock.now += 7.5
    assert outage.lasted() == 7.5
    assert outage.end() == 7.5
    assert (outage.open, outage.tries, outage.end()) == (False, 0, None)
    assert outage.fail("busy") == "began"
    assert outage.delay() <= 0.2
