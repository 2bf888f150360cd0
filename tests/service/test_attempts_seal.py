"""Attempt counts are trusted only on copies the consumer made: ``x-attempts`` is
sealed with a key of the consumer's database, and any other count -- a
producer's header, a copy of the previous release, another database's copy --
counts as 0, so a foreign header can never spend an event's retry budget."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import flaky_consumer  # noqa: F401  (registers the "flaky" consumer in this process too)
import orjson
import test_worker
from brokerkit import Namespace
from hypothesis import given
from hypothesis import strategies as st
from support import body, new_event, read_rows
from test_worker import Recorder, delivery, flaky_spec

from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.amqp.retry import seal_attempts, sealed_attempts
from delivery_consumer.amqp.topology import H_ATTEMPTS, H_ATTEMPTS_SEAL, H_ERROR_CODE, H_ERROR_REASON
from delivery_consumer.inbox.database import SEAL_KEY
from delivery_consumer.model.contract import ConsumerSpec
from delivery_consumer.model.deliveries import OutMessage
from delivery_consumer.model.errors import RETRIES_EXHAUSTED
from delivery_consumer.service.worker import Worker

MakeWorker = Callable[..., tuple[Worker, Recorder]]
make_worker = test_worker.make_worker  # the fixture: an opened worker on a fresh database
KEY = bytes(range(32))

# -- the seal ----------------------------------------------------------------------------------


@given(st.binary(max_size=64), st.integers(1, 1000), st.binary(min_size=1, max_size=64), st.integers(1, 1000),
       st.binary(min_size=16, max_size=32))
def test_a_count_is_trusted_only_with_its_own_seal(payload: bytes, attempts: int, other_payload: bytes,
                                                    other_attempts: int, other_key: bytes) -> None:
    """A sealed count reads back as written; the same seal over another count, another
    body or under another key reads as 0, and so does a count without a seal."""
    seal = seal_attempts(KEY, payload, attempts)
    assert attempts == sealed_attempts({H_ATTEMPTS: attempts, H_ATTEMPTS_SEAL: seal}, payload, KEY)
    assert attempts == sealed_attempts({H_ATTEMPTS: attempts, H_ATTEMPTS_SEAL: seal.encode()}, payload, KEY)
    assert 0 == sealed_attempts({H_ATTEMPTS: attempts}, payload, KEY)
    assert 0 == sealed_attempts({H_ATTEMPTS: attempts, H_ATTEMPTS_SEAL: seal}, payload, None)
    if other_attempts != attempts:
        assert 0 == sealed_attempts({H_ATTEMPTS: other_attempts, H_ATTEMPTS_SEAL: seal}, payload, KEY)
    if other_payload != payload:
        assert 0 == sealed_attempts({H_ATTEMPTS: attempts, H_ATTEMPTS_SEAL: seal}, other_payload, KEY)
    if other_key != KEY:
        assert 0 == sealed_attempts({H_ATTEMPTS: attempts, H_ATTEMPTS_SEAL: seal}, payload, other_key)


def test_garbled_seals_count_as_zero() -> None:
    """A seal of the wrong type, in non-ASCII text or of an unknown version is no seal."""
    seal = seal_attempts(KEY, b"x", 2)
    for garbled in (None, 2, "", "é" * 35, "v9." + seal[3:], seal.upper(), [seal]):
        assert 0 == sealed_attempts({H_ATTEMPTS: 2, H_ATTEMPTS_SEAL: garbled}, b"x", KEY)


def test_every_database_gets_its_own_key_once(tmp_path: Path, make_worker: MakeWorker) -> None:
    """The first writable open gives the database a random key, kept by every later open."""
    first, _io = make_worker()
    assert first.db is not None and first.copies.key is not None
    first.close()
    again, _io = make_worker()
    other, _io = make_worker("audit")
    assert again.copies.key == first.copies.key != other.copies.key
    assert [(first.copies.key.hex(),)] == read_rows(tmp_path / "catalog.db", "meta", "value",
                                                    where="key = ?", params=(SEAL_KEY,))


def test_an_older_database_gets_a_key_at_its_next_open(tmp_path: Path, make_worker: MakeWorker) -> None:
    """A database of the previous release (no key) gets one when run opens it."""
    worker, _io = make_worker()
    worker.close()
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        conn.execute("DELETE FROM meta WHERE key = ?", (SEAL_KEY,))
    conn.close()
    worker, _io = make_worker()
    assert worker.copies.key is not None and 32 == len(worker.copies.key)


# -- the worker ----------------------------------------------------------------------------------


def test_a_foreign_count_on_a_fresh_message_spends_nothing(
        make_worker: MakeWorker, register: Callable[[ConsumerSpec], ConsumerSpec]) -> None:
    """x-attempts 99 from a producer does not make the first failure retries-exhausted:
    the copy goes to the first retry tier carrying 1, sealed."""
    register(flaky_spec())
    worker, io = make_worker("wobbly", max_attempts=2)
    forged = delivery(1, body(new_event(title="transient")), headers={H_ATTEMPTS: 99, "x-other": "kept"})
    forged.message_id = str(uuid.uuid4())
    worker.process([forged])
    (copy,) = io.calls[0].messages
    assert worker.topology.retry_queue(0) == copy.routing_key
    assert copy.headers is not None and (1, "kept") == (copy.headers[H_ATTEMPTS], copy.headers["x-other"])
    assert worker.copies.key is not None
    assert seal_attempts(worker.copies.key, forged.body, 1) == copy.headers[H_ATTEMPTS_SEAL]
    assert worker.db is not None and [(1,)] == read_rows(worker.db.path, "deliveries", "attempts")


def test_a_copy_sealed_by_another_database_starts_again(
        make_worker: MakeWorker, register: Callable[[ConsumerSpec], ConsumerSpec]) -> None:
    """A retry copy made with another database's key (another consumer, or a partition
    before a repartition) counts as 0: its count is lost, never inflated."""
    register(flaky_spec())
    worker, io = make_worker("wobbly", max_attempts=2)
    payload = body(new_event(title="transient"))
    foreign = {H_ATTEMPTS: 1, H_ATTEMPTS_SEAL: seal_attempts(b"another database's key", payload, 1)}
    worker.process([delivery(1, payload, message_id=str(uuid.uuid4()), headers=foreign)])
    (copy,) = io.calls[0].messages
    assert worker.topology.retry_queue(0) == copy.routing_key
    assert copy.headers is not None and 1 == copy.headers[H_ATTEMPTS]


# -- run, against the broker ---------------------------------------------------------------------


def test_run_gives_a_forged_count_the_full_budget_and_trace_shows_the_truth(ns: Namespace) -> None:
    """run: an event published with x-attempts 99 that always fails transiently is tried
    --max-attempts (3) times, dead-lettered "after 3 attempts", and trace counts 3 attempts."""
    event = new_event(article_id="forged", title="transient:99")
    topology = ns.topology("flaky")
    message = OutMessage(routing_key="material.published", body=orjson.dumps(event), exchange=ns.exchange,
                         message_id=event["eventId"], headers={H_ATTEMPTS: 99})
    with Publisher(ns.url, topologies=[topology], exchanges=[ns.exchange]) as pub:
        assert all(r.ok for r in pub.publish([message]))
    env = ns.env(DELIVERY_PLUGINS="flaky_consumer", FLAKY_DIR=str(ns.workdir / "flaky"))
    done = ns.run_until_idle("flaky", "--retry-delays", "100ms,200ms,300ms", "--max-attempts", "3", env=env, idle=3)
    assert 0 == done.returncode, done.stderr
    (props, _body), = ns.drain(topology.dead_queue)
    assert (RETRIES_EXHAUSTED, 3) == (props.headers[H_ERROR_CODE], props.headers[H_ATTEMPTS])
    assert "after 3 attempts" in props.headers[H_ERROR_REASON]
    assert 3 == int((ns.workdir / "flaky" / f"{event['eventId']}.tries").read_text())
    traced = ns.cli("trace", "--db", str(ns.db("flaky")), event["eventId"], "--json", env=env)
    assert 0 == traced.returncode, traced.stderr
    deliveries = orjson.loads(traced.stdout)["deliveries"]
    assert (3, 3) == (deliveries["attempts"], deliveries["deliveries"])
