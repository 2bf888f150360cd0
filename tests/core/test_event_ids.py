"""The eventIds a producer makes: valid for the contract, time-ordered, unique.

Laws, for any sequence of clock readings (forwards, repeated, backwards) and
any random bytes:

* every id is a lowercase 8-4-4-4-12 UUID the contract accepts, of version 7
  and RFC variant;
* ids strictly increase, as text (the order of the consumer's index) and as
  integers; so one generator never repeats an id;
* an id carries the clock's millisecond, or a later one when the clock went
  back or one millisecond's counter ran out, never an earlier one;
* a forked child does not count on from its parent's sequence.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from delivery_consumer.model.envelope import is_event_id
from delivery_consumer.model.event_ids import EventIds, new_event_id
from delivery_consumer.outbox import demo_producer as producer

MS = 1_000_000
# Around now, with steps that repeat a millisecond, move on, or go back.
_START = st.integers(min_value=1_700_000_000_000, max_value=2_000_000_000_000)
_STEPS = st.lists(st.integers(min_value=-5_000, max_value=5_000), min_size=1, max_size=200)


def _clock(start_ms: int, steps: list[int]) -> Iterator[int]:
    now = start_ms
    for step in steps:
        now += step
        yield now * MS + 123


@given(start=_START, steps=_STEPS, rnd=st.randoms(use_true_random=False))
def test_ids_are_valid_and_strictly_increase_for_any_clock(start: int, steps: list[int], rnd: random.Random) -> None:
    """Whatever the clock does, each id is a valid version 7 eventId, later than the one before."""
    readings = list(_clock(start, steps))
    ticks = iter(readings)
    ids = EventIds(clock=lambda: next(ticks), entropy=rnd.randbytes)
    made = [ids() for _ in readings]
    for event_id in made:
        assert is_event_id(event_id)
        parsed = uuid.UUID(event_id)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert made == sorted(made) and len(set(made)) == len(made)
    assert [uuid.UUID(i).int for i in made] == sorted(uuid.UUID(i).int for i in made)
    latest = 0
    for event_id, reading in zip(made, readings, strict=True):
        stamped = uuid.UUID(event_id).int >> 80
        latest = max(latest, reading // MS)
        assert stamped >= latest
        assert stamped <= latest + 1  # ahead of the clock only by a counter's overflow


@given(count=st.integers(min_value=1, max_value=3000))
def test_a_frozen_clock_still_gives_increasing_ids(count: int) -> None:
    """A clock that never moves (a coarse or stuck one): ids still strictly increase and stay unique."""
    ids = EventIds(clock=lambda: 1_750_000_000_000 * MS)
    made = [ids() for _ in range(count)]
    assert made == sorted(set(made))


def test_the_counter_overflowing_moves_to_the_next_millisecond() -> None:
    """A millisecond's last counter value is still used; past it the id moves to the next millisecond."""
    now = 1_750_000_000_000
    ids = EventIds(clock=lambda: now * MS)
    before = ids()
    ids._counter = (1 << 42) - 2  # as if this millisecond had used all but one counter value
    last = ids()
    after = ids()
    assert uuid.UUID(before).int >> 80 == uuid.UUID(last).int >> 80 == now
    assert uuid.UUID(after).int >> 80 == now + 1
    assert before < last < after < ids()


def test_a_fresh_counter_leaves_room_to_count() -> None:
    """A new millisecond's counter starts with its top bit clear, however the random bytes fall."""
    ids = EventIds(clock=lambda: 1_750_000_000_000 * MS, entropy=lambda n: b"\xff" * n)
    first = uuid.UUID(ids()).int
    assert (first >> 64) & 0xFFF == 0x7FF  # the counter's top 12 bits, the highest clear
    assert uuid.UUID(ids()).int >> 80 == first >> 80  # the next one fits in the same millisecond


def test_threads_sharing_a_generator_never_get_the_same_counter() -> None:
    """Threads taking ids at once from one generator, in one frozen millisecond with no random tail,
    still get distinct ids (only the counter tells them apart), each thread's increasing."""
    ids = EventIds(clock=lambda: 1_750_000_000_000 * MS,
                   entropy=lambda n: os.urandom(n) if n == 10 else bytes(n))
    per_thread: list[list[str]] = [[] for _ in range(4)]
    start = threading.Barrier(len(per_thread))

    def take(out: list[str]) -> None:
        start.wait()
        out.extend(ids() for _ in range(20000))

    threads = [threading.Thread(target=take, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for out in per_thread for i in out]
    assert len(set(everything)) == len(everything) == 80000
    assert all(out == sorted(out) for out in per_thread)


def test_a_forked_child_starts_its_own_sequence() -> None:
    """After a fork, the child's next id is not the parent's next one (which counting on would give)."""
    def entropy(n: int) -> bytes:
        return os.urandom(n) if n == 10 else bytes(n)  # fresh counters random, tails all zero

    ids = EventIds(clock=lambda: 1_750_000_000_000 * MS, entropy=entropy)
    ids()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its id to the parent, then out at once
        code = 1
        try:
            signal.alarm(10)  # never left behind, whatever happens
            os.write(write, ids().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert is_event_id(child)
    assert child != ids()


def test_the_producer_names_its_events_with_time_ordered_ids(tmp_path: Path) -> None:
    """The demo producer's events get version 7 ids, in the order they were written."""
    conn = producer.open_db(tmp_path / "producer.db")
    made = [producer.produce(conn, f"article-{i}", title="t", url="https://example.org/").envelope.event_id
            for i in range(50)]
    assert all(uuid.UUID(i).version == 7 for i in made)
    assert made == sorted(made)
    assert uuid.UUID(new_event_id()).version == 7
