"""Helpers for tests and benchmarks of partitioned consumers on the real broker.

A :class:`Cluster` is one partitioned consumer in a test namespace: its
topology declared with ``topology declare --partitions``, ``run`` processes
per partition (the first one started is the active one: single active
consumer), events published with the ``publish`` command, and the partition
databases read back.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pika
import pytest
from brokerkit import Namespace, RunProcess, wait_for_broker
from support import count_rows, read_rows, wait_until

from delivery_consumer.amqp.partitions import SLOT_COUNT, partition_of, slot_headers
from delivery_consumer.amqp.publisher import Publisher
from delivery_consumer.model.deliveries import OutMessage


def make_events(n: int, articles: int, seed: int = 7) -> list[dict[str, Any]]:
    """*n* events over *articles* articles, in revision order per article (interleaved)."""
    rnd = random.Random(seed)
    revision = [0] * articles
    out = []
    for i in range(n):
        a = i % articles
        revision[a] += 1
        out.append({
            "eventId": str(uuid.UUID(int=rnd.getrandbits(128), version=4)),
            "type": "material.withdrawn" if rnd.random() < 0.1 else "material.published",
            "articleId": f"article-{a}",
            "revision": revision[a],
            "occurredAt": "2026-12-01T10:00:00Z",
            "data": {"title": f"Материал {a}, редакция {revision[a]}", "url": f"https://example.org/a/{a}"},
        })
    return out


def model(events: list[dict[str, Any]]) -> dict[str, tuple[int, str, int]]:
    """What the merged catalog must hold: the last revision of each article."""
    out: dict[str, tuple[int, str, int]] = {}
    for e in events:
        out[e["articleId"]] = (e["revision"], e["data"]["title"], int(e["type"] == "material.published"))
    return out


class LivePublisher(threading.Thread):
    """A producer that goes on publishing while the test acts: events of *keys* articles (*kind*
    ``material``) or orders (``order``, the orders consumer's own types, keyed by ``orderId``), in
    revision order per key, through the namespace's exchange with their slot headers, in confirmed
    batches, until :meth:`finish`. :attr:`confirmed` is every event the broker confirmed, in
    publishing order (each was the newest of its key when published); :attr:`rate` (events/s, None:
    as fast as confirms come) may be changed meanwhile."""

    def __init__(self, ns: Namespace, *, keys: int, kind: str = "material", batch: int = 250,
                 rate: float | None = None, seed: int = 23) -> None:
        super().__init__(name="live-publisher", daemon=True)
        self.ns = ns
        self.keys = keys
        self.kind = kind
        self.batch = batch
        self.rate = rate
        self.confirmed: list[dict[str, Any]] = []
        self.error: str | None = None
        self._rnd = random.Random(seed)
        self._revision = [0] * keys
        self._made = 0
        self._halt = threading.Event()

    @property
    def field(self) -> str:
        """The key field of the events."""
        return "orderId" if self.kind == "order" else "articleId"

    def _next(self) -> dict[str, Any]:
        a = self._made % self.keys
        self._made += 1
        self._revision[a] += 1
        revision = self._revision[a]
        event_id = str(uuid.UUID(int=self._rnd.getrandbits(128), version=4))
        if self.kind == "order":
            return {"eventId": event_id, "type": "order.placed" if revision == 1 else "order.changed",
                    "orderId": f"order-{a}", "revision": revision, "occurredAt": "2026-12-01T10:00:00Z",
                    "data": {"status": self._rnd.choice(["placed", "paid", "shipped"]),
                             "totalCents": self._rnd.randrange(10_000)}}
        return {
            "eventId": event_id,
            "type": "material.withdrawn" if self._rnd.random() < 0.1 else "material.published",
            "articleId": f"article-{a}",
            "revision": revision,
            "occurredAt": "2026-12-01T10:00:00Z",
            "data": {"title": f"Материал {a}, редакция {revision}", "url": f"https://example.org/a/{a}"},
        }

    def run(self) -> None:
        with Publisher(self.ns.url, exchanges=[self.ns.exchange], name="test live publisher") as pub:
            while not self._halt.is_set():
                began = time.monotonic()
                events = [self._next() for _ in range(self.batch)]
                results = pub.publish([
                    OutMessage(routing_key=e["type"], body=orjson.dumps(e), exchange=self.ns.exchange,
                               message_id=e["eventId"], headers=slot_headers(e[self.field])) for e in events])
                bad = [r for r in results if not r.ok]
                if bad:
                    self.error = f"publish failed: {bad[:3]}"
                    return
                self.confirmed.extend(events)
                rate = self.rate
                if rate is not None:  # pace the batches: a producer, not a flood
                    self._halt.wait(max(0.0, began + len(events) / rate - time.monotonic()))

    def finish(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Stop after the batch under way; every confirmed event."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout)
        assert not self.is_alive(), "the publisher did not stop"
        assert self.error is None, self.error
        return self.confirmed


@dataclass
class Cluster:
    """One partitioned consumer in namespace *ns*."""

    ns: Namespace
    consumer: str
    count: int
    procs: list[RunProcess] = field(default_factory=list)

    def db(self, k: int) -> Path:
        return self.ns.workdir / "state" / self.consumer / f"p{k}" / "inbox.db"

    def declare(self, count: int | None = None) -> None:
        done = self.ns.cli("topology", "declare", "--consumer", self.consumer, "--partitions",
                           str(count or self.count))
        assert done.returncode == 0, done.stderr

    def start(self, k: int, *args: str) -> RunProcess:
        """Start ``run --partition k`` and wait until it is consuming (the active one)
        or waiting for the partition's database (a standby)."""
        cmd = [sys.executable, "-m", "delivery_consumer", "run", "--consumer", self.consumer, "--partition", str(k),
               "--partitions", str(self.count), *args]
        proc = RunProcess(cmd, cwd=self.ns.workdir, env=self.ns.env())
        self.procs.append(proc)
        wait_until(f"run --partition {k} to consume or stand by",
                   lambda: any(text in proc.output()[1] for text in ("consuming ", "standby: waiting")), 60, [proc])
        return proc

    def publish(self, events: list[dict[str, Any]]) -> None:
        """``publish`` the events (in order) and wait until every one is confirmed."""
        proc = self.publish_async(events)
        _out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err

    def publish_async(self, events: list[dict[str, Any]]) -> subprocess.Popen[str]:
        """Start ``publish`` of the events; the caller waits for it."""
        path = self.ns.workdir / f"events-{uuid.uuid4().hex[:6]}.ndjson"
        path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
        return subprocess.Popen([sys.executable, "-m", "delivery_consumer", "publish", str(path)], cwd=self.ns.workdir,
                                env=self.ns.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def receipts(self) -> int:
        return sum(count_rows(self.db(k), "inbox") for k in range(self.count))

    def stop(self) -> None:
        """SIGTERM every run still alive and reap them all. A run whose main
        process was killed may leave its worker process behind, in the run's
        process group: that group is killed."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
            elif p.returncode < 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            try:
                p.communicate(timeout=60)
            except Exception:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.communicate()

    def delete(self, counts: tuple[int, ...] = ()) -> None:
        """Delete what the cluster declared on the shared broker (once more after a
        broker restart that another test caused midway)."""
        try:
            self._delete(counts)
        except pika.exceptions.AMQPError:
            wait_for_broker(self.ns.url)
            self._delete(counts)

    def _delete(self, counts: tuple[int, ...]) -> None:
        conn = pika.BlockingConnection(pika.URLParameters(self.ns.url))
        try:
            ch = conn.channel()
            base = f"{self.ns.prefix}.{self.consumer}"
            for k in range(max((self.count, *counts))):
                topo = self.ns.topology(self.consumer, partition=k)
                for queue, _ in topo.queues():
                    ch.queue_delete(queue)
                ch.queue_delete(topo.handover_queue)
            ch.queue_delete(f"{base}.handover")
            ch.queue_delete(f"{base}.unrouted")
            ch.queue_delete(f"{base}.partitions")
            ch.exchange_delete(f"{base}.slots")
            ch.exchange_delete(f"{base}.unrouted")
        finally:
            conn.close()

    # -- checks --
    def check_exactly_once(self, events: list[dict[str, Any]]) -> dict[str, int]:
        """Every event has one receipt in one partition DB, each article lives in
        exactly its own partition, and the merged catalog equals the model.
        Returns the receipts' results, counted."""
        seen: dict[str, int] = {}
        results: dict[str, int] = {}
        catalog: dict[str, tuple[int, str, int]] = {}
        for k in range(self.count):
            for event_id, result, key in read_rows(self.db(k), "inbox", "event_id, result, partition_key"):
                assert event_id not in seen, f"{event_id} has receipts in p{seen[event_id]} and p{k}"
                seen[event_id] = k
                results[result] = results.get(result, 0) + 1
                assert partition_of(key, self.count) == k, f"{key} receipt in p{k}"
            for article, revision, title, published in read_rows(
                    self.db(k), "catalog", "article_id, revision, title, published"):
                assert article not in catalog, f"{article} lives in two partitions"
                assert partition_of(article, self.count) == k
                catalog[article] = (revision, title, published)
        assert set(seen) == {e["eventId"] for e in events}
        assert catalog == model(events)
        return results


@pytest.fixture
def cluster(ns: Namespace, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The catalog partitioned in the requesting test module's ``PARTITIONS`` partitions, its
    topology declared; afterwards its runs are stopped and its broker objects deleted."""
    c = Cluster(ns, "catalog", request.module.PARTITIONS)
    c.declare()
    yield c
    c.stop()
    c.delete()


__all__ = ["SLOT_COUNT", "Cluster", "LivePublisher", "cluster", "make_events", "model", "wait_until"]
