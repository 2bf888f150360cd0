"""A nack storm is one outage: the dispatcher probes, rows wait on it with no backoff of their own, and the
first confirm lets them all go, each key in order (scripted publisher; the real broker:
tests/broker/test_outbox_storm_broker.py)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outboxkit import Clock, FakePublisher, add, dispatcher, envelope, row, twin

from delivery_consumer import outbox
from delivery_consumer.amqp.retry import RECONNECT_CAP_S
from delivery_consumer.model.deliveries import OutMessage, PublishResult
from delivery_consumer.outbox.outage import PROBE_CAP_S as PROBE_CAP
from delivery_consumer.outbox.outage import destination, own_nacks


class Broker(FakePublisher):
    """A broker whose verdicts come from a script, one per message sent (then every message is confirmed), and
    which checks the dispatcher's order rule at every send: no row goes out while an earlier row of its key was
    nacked and is not yet confirmed."""

    def __init__(self, keys: dict[str, str], seqs: dict[str, int], script: Sequence[bool] = ()) -> None:
        super().__init__()
        self.keys, self.seqs = keys, seqs
        self.script = list(script)  # True: nack this message
        self.storm = False  # nack every message while set (after the script)
        self.calls = 0  # send() calls so far
        self.failed: set[str] = set()  # nacked, not confirmed since (as the dispatcher knows after collect)
        self.first_nack: dict[str, int] = {}  # eventId -> the send call of its first nack
        self.confirmed: list[tuple[str, int]] = []  # (eventId, send call), in the order confirmed

    def send(self, messages: Sequence[OutMessage]) -> Any:
        self.calls += 1
        ticket = []
        for m in messages:
            mid = m.message_id or ""
            earlier = [e for e in self.failed if self.keys[e] == self.keys[mid] and self.seqs[e] < self.seqs[mid]]
            assert not earlier, f"{mid} sent while {earlier} of its key waits after a nack"
            nack = self.script.pop(0) if self.script else self.storm
            ticket.append((mid, self.calls, PublishResult("nacked", "the broker could not store the message")
                           if nack else PublishResult("confirmed")))
        self.sent.extend(messages)
        self.log.append(("send", [m.message_id or "" for m in messages]))
        return ticket

    def collect(self, ticket: Any) -> list[PublishResult]:
        self.log.append(("collect", [mid for mid, _, _ in ticket]))
        for mid, call, result in ticket:
            if result.ok:
                self.failed.discard(mid)
                self.confirmed.append((mid, call))
            else:
                self.failed.add(mid)
                self.first_nack.setdefault(mid, call)
        return [result for _, _, result in ticket]


def fresh(tmp_path: Path, keys: Sequence[str]) -> tuple[Any, list[str], Broker]:
    conn = outbox.connect(tmp_path / f"{os.urandom(6).hex()}.db")
    ids = add(conn, *(envelope(key, i + 1) for i, key in enumerate(keys)))
    broker = Broker(dict(zip(ids, keys, strict=True)), {eid: i for i, eid in enumerate(ids)})
    return conn, ids, broker


def outage_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "delivery_consumer.dispatch"]
    return [x for x in lines if "one outage;" in x], [x for x in lines if "again after" in x]


def test_a_nack_storm_is_one_outage_and_every_waiting_row_goes_once_the_broker_confirms_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Every message nacked for a while: one outage logged (one start, one end line with its counts, no line per
    row), no row spends a failure; once the broker confirms again and one probe interval has passed, every
    row is published without the clock moving further, once each, each key in order."""
    caplog.set_level(logging.INFO, logger="delivery_consumer.dispatch")
    keys = [f"k{i % 5}" for i in range(40)]
    conn, ids, broker = fresh(tmp_path, keys)
    broker.storm = True
    clock = Clock()
    d = dispatcher(conn, broker, clock, batch=10, depth=2)
    for _ in range(20):
        d.step()
        clock.now += 1.0
    assert (1, True) == (d.stats.outages, d.stats.in_outage)
    assert 0 == outbox.stats(conn)["published"]
    assert {0} == {row(conn, e)["failures"] for e in ids}
    starts, ends = outage_lines(caplog)
    assert (1, 0) == (len(starts), len(ends)), starts + ends
    assert not [r for r in caplog.records if "not published" in r.getMessage()]
    broker.storm = False
    d.step()  # the probe sent during the storm comes back nacked
    clock.now += RECONNECT_CAP_S  # the next probe is due by then, whatever the backoff reached
    for _ in range(len(ids) + 5):  # the clock stands still: nothing waits on a timer of its own
        d.step()
    assert 0 == outbox.unpublished(conn)
    assert (1, False) == (d.stats.outages, d.stats.in_outage)
    starts, ends = outage_lines(caplog)
    assert (1, 1) == (len(starts), len(ends)), starts + ends
    assert "broker confirms again after" in ends[0] and "nacks of 10 rows" in ends[0], ends[0]  # the first batch
    assert "unconfirmed" not in ends[0] and "probes" in ends[0], ends[0]
    assert Counter(dict.fromkeys(ids, 1)) == Counter(mid for mid, _ in broker.confirmed)
    for key in set(keys):
        mine = [mid for mid, _ in broker.confirmed if broker.keys[mid] == key]
        assert mine == sorted(mine, key=broker.seqs.__getitem__)


def test_a_refusing_destination_holds_only_its_own_rows(tmp_path: Path) -> None:
    """Nacks on one destination (a's slot) leave the other destinations flowing; a's later rows wait behind the
    nacked one; while it refuses, only its probe is sent for it."""
    conn, ids, broker = fresh(tmp_path, ["a", "b", "a", "c", "b", "a"])
    a1, b1, a2, c1, b2, a3 = ids
    broker.script = [True]  # a1's first attempt
    clock = Clock()
    d = dispatcher(conn, broker, clock, batch=1, depth=1)
    for _ in range(6):
        d.step()
    assert {b1, c1, b2} == {e for e, _ in broker.confirmed}
    assert [a1] == [m.message_id for m in broker.sent if broker.keys[m.message_id or ""] == "a"]
    broker.storm = True  # still refusing at the first probe
    clock.now += RECONNECT_CAP_S
    d.step()
    assert [a1, a1] == [m.message_id for m in broker.sent if broker.keys[m.message_id or ""] == "a"]
    broker.storm = False
    clock.now += RECONNECT_CAP_S
    while d.step():
        pass
    assert [a1, a2, a3] == [e for e, _ in broker.confirmed if broker.keys[e] == "a"]
    assert (1, False) == (d.stats.outages, d.stats.in_outage)


def test_a_row_its_destination_never_takes_does_not_hold_the_destination(tmp_path: Path) -> None:
    """A row nacked every time (a body over a classic queue's byte limit) while its destination takes other
    rows: the probe's second row is confirmed, so the nacks are the row's own (failure, backoff, quarantine at
    max-attempts); the destination's other rows go, the outage ends."""
    big = "article-1"
    conn, ids, broker = fresh(tmp_path, [big])
    clock = Clock()

    class Picky(Broker):
        def send(self, messages: Sequence[OutMessage]) -> Any:
            self.script = [m.message_id == ids[0] for m in messages]
            return super().send(messages)

    picky = Picky(broker.keys, broker.seqs)
    d = dispatcher(conn, picky, clock, depth=1, max_attempts=3, retry_base_s=1, retry_cap_s=1)
    d.step()  # alone: the destination's nack, for all the dispatcher can tell
    assert (0, 1) == (row(conn, ids[0])["failures"], d.stats.outages)
    for n, event_id in enumerate(add(conn, envelope(twin(big), 1), envelope(twin(big), 2))):
        ids.append(event_id)
        picky.keys[event_id], picky.seqs[event_id] = twin(big), n + 1
    clock.now += RECONNECT_CAP_S
    d.step()  # the probe: its two oldest waiting rows, of different keys
    assert [ids[0], ids[1]] == [m.message_id for m in picky.sent[-2:]]
    assert (1, False) == (row(conn, ids[0])["failures"], d.stats.in_outage)
    for _ in range(10):
        clock.now += 1.01
        d.step()
    assert "quarantined" == row(conn, ids[0])["state"]
    assert [ids[1], ids[2]] == [e for e, _ in picky.confirmed]


def test_own_nacks_are_those_followed_by_a_confirm_of_their_destination() -> None:
    """own_nacks: a nack is the row's own only when a later message of its destination was confirmed."""
    a, b = destination("material.published", "a"), destination("material.published", twin("a"))
    c = destination("material.withdrawn", "a")
    assert a == b and a != c
    assert {0} == own_nacks([a, b], ["nacked", "confirmed"])
    assert set() == own_nacks([a, c], ["nacked", "confirmed"])
    assert set() == own_nacks([b, a], ["confirmed", "nacked"])
    assert {1} == own_nacks([a, a, a, a], ["nacked", "nacked", "confirmed", "nacked"]) - {0}
    assert set() == own_nacks([a, a], ["confirmed", "returned"])


KEYS = st.sampled_from(["a", "b", "c", twin("a"), twin("b")])


@given(st.lists(KEYS, min_size=1, max_size=16), st.lists(st.booleans(), max_size=60), st.integers(1, 4),
       st.integers(1, 2))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_order_per_key_under_any_interleaving_of_nacks(tmp_path: Path, keys: list[str], script: list[bool],
                                                       batch: int, depth: int) -> None:
    """Whatever the broker nacks and when (any message, any batch, storms or single nacks): no row is sent while
    an earlier row of its key waits after a nack; a row is confirmed before an earlier row of its key only when
    it went out in the very batch of that row's first nack (the documented gap: it was on the wire already);
    every row is confirmed exactly once in the end."""
    conn, ids, broker = fresh(tmp_path, keys)
    broker.script = script
    clock = Clock()
    try:
        d = dispatcher(conn, broker, clock, batch=batch, depth=depth, retry_base_s=1, retry_cap_s=1,
                       max_attempts=1000)
        for _ in range(400):
            d.step()
            if not outbox.unpublished(conn):
                break
            clock.now += 1.01
        assert 0 == outbox.unpublished(conn)
        assert Counter(dict.fromkeys(ids, 1)) == Counter(mid for mid, _ in broker.confirmed)
        when = {mid: (i, call) for i, (mid, call) in enumerate(broker.confirmed)}
        for later in ids:
            for earlier in ids[:ids.index(later)]:
                if broker.keys[earlier] == broker.keys[later] and when[later][0] < when[earlier][0]:
                    assert broker.first_nack.get(earlier) == when[later][1], (earlier, later, broker.log)
    finally:
        conn.close()


@given(st.lists(KEYS, min_size=1, max_size=30), st.integers(1, 40), st.integers(1, 10), st.integers(1, 2))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_after_a_storm_nothing_waits_on_a_timer_of_its_own(tmp_path: Path, keys: list[str], storm_steps: int,
                                                          batch: int, depth: int) -> None:
    """However long the storm and whatever the batches: it is one outage, no row spends a failure, and once the
    broker confirms again (and what was sent before has come back) one probe interval later every row is
    published with the clock standing still, each key in creation order."""
    conn, ids, broker = fresh(tmp_path, keys)
    broker.storm = True
    clock = Clock()
    try:
        d = dispatcher(conn, broker, clock, batch=batch, depth=depth)
        for _ in range(storm_steps):
            d.step()
            clock.now += 0.7
        broker.storm = False
        for _ in range(depth):  # what was sent during the storm comes back nacked (and schedules the next probe)
            d.step()
        clock.now += RECONNECT_CAP_S
        for _ in range(2 * len(ids) + 4):
            d.step()
        assert 0 == outbox.unpublished(conn)
        assert {0} == {row(conn, e)["failures"] for e in ids}
        assert (1, False) == (d.stats.outages, d.stats.in_outage)
        for key in set(keys):
            mine = [mid for mid, _ in broker.confirmed if broker.keys[mid] == key]
            assert mine == sorted(mine, key=broker.seqs.__getitem__)
    finally:
        conn.close()


def test_during_an_outage_a_claim_that_found_nothing_is_not_repeated_before_the_poll(tmp_path: Path) -> None:
    """Every claim scans the rows waiting on the outage (inside a write transaction): while nothing else can
    go, steps without the clock moving (a producer's wake-ups) claim nothing more; after --poll, or once a
    probe is due, the dispatcher looks again."""
    conn, ids, broker = fresh(tmp_path, ["a", "a", "a"])
    broker.storm = True
    clock = Clock()
    d = dispatcher(conn, broker, clock, poll_s=10.0)
    claims: list[int | None] = []
    claim = d.claim

    def counted(limit: int | None = None) -> list[outbox.Claimed]:
        claims.append(limit)
        return claim(limit)

    d.claim = counted  # type: ignore[method-assign]
    d.step()  # all three nacked: the outage begins
    assert d.stats.in_outage
    d.step()  # a look that finds nothing but rows waiting on it
    looked = len(claims)
    for _ in range(5):
        assert 0 == d.step()
    assert looked == len(claims)
    clock.now += RECONNECT_CAP_S  # a probe is due: it looks again, and probes
    d.step()
    assert len(claims) > looked and [ids[0]] == [m.message_id for m in broker.sent[-1:]]
    conn.close()


def test_a_probe_goes_on_a_new_channel_never_on_the_one_that_met_the_storm(tmp_path: Path) -> None:
    """A channel the broker nacked every message of a destination on stays refused (as after a failover race
    on RabbitMQ 3.10) while a new channel is confirmed at once: every probe after the storm is sent on a new
    channel with nothing else in flight, and the rows waiting go without a reconnect."""
    keys = [f"k{i % 4}" for i in range(30)]
    conn, ids, broker = fresh(tmp_path, keys)

    class Poisoned(Broker):
        def __init__(self) -> None:
            super().__init__(broker.keys, broker.seqs)
            self.poisoned = True  # the channel in use refuses every message
            self.inflight = 0
            self.renewed_with_inflight = 0

        def send(self, messages: Sequence[OutMessage]) -> Any:
            self.storm = self.poisoned
            self.inflight += 1
            return super().send(messages)

        def collect(self, ticket: Any) -> list[PublishResult]:
            self.inflight -= 1
            return super().collect(ticket)

        def renew_channel(self) -> None:
            super().renew_channel()
            self.renewed_with_inflight += self.inflight > 0
            self.poisoned = False

    pub = Poisoned()
    clock = Clock()
    d = dispatcher(conn, pub, clock, batch=8, depth=2)
    for _ in range(10):
        d.step()
        clock.now += PROBE_CAP
    assert 0 == outbox.unpublished(conn)
    assert (1, 1, 0) == (pub.connects, pub.renewals, pub.renewed_with_inflight)
    renewed = pub.log.index(("renew", []))
    assert all(kind == "collect" or not any(e in pub.failed for e in mids) for kind, mids in pub.log[renewed:])
    assert Counter(dict.fromkeys(ids, 1)) == Counter(mid for mid, _ in pub.confirmed)
    assert (1, False) == (d.stats.outages, d.stats.in_outage)


def test_a_connection_lost_while_renewing_the_channel_is_an_outage_like_any_other(tmp_path: Path) -> None:
    """The connection failing while a new channel is opened for a probe: the dispatcher reconnects (its
    channels are new) and the rows go, none spending a failure."""
    conn, ids, broker = fresh(tmp_path, ["a", "b", "a", "b"])

    class Dropping(Broker):
        def renew_channel(self) -> None:
            super().renew_channel()
            from delivery_consumer.model.errors import BrokerUnavailable
            self.storm = False
            raise BrokerUnavailable("connection lost while opening a channel")

    pub = Dropping(broker.keys, broker.seqs)
    pub.storm = True
    clock = Clock()
    d = dispatcher(conn, pub, clock, batch=8, depth=2)
    for _ in range(10):
        d.step()
        clock.now += PROBE_CAP
    assert 0 == outbox.unpublished(conn)
    assert (2, 1) == (pub.connects, pub.renewals)
    assert {0} == {row(conn, e)["failures"] for e in ids}
