"""Helpers of the outbox tests: envelopes, a clock and a publisher under the test's control."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Sequence
from typing import Any

from delivery_consumer import outbox
from delivery_consumer.amqp.partitions import slot_of
from delivery_consumer.model.deliveries import OutMessage, PublishResult
from delivery_consumer.model.errors import BrokerUnavailable


def envelope(article: str = "article-1", revision: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "eventId": str(uuid.uuid4()),
        "type": "material.published",
        "articleId": article,
        "revision": revision,
        "occurredAt": "2026-11-29T10:00:00Z",
        "data": {"title": f"{article} r{revision}", "url": f"https://example.org/{article}"},
        **extra,
    }


class Clock:
    """Wall clock and sleep under the test's control."""

    def __init__(self) -> None:
        import time

        self.now = time.time()
        self.slept: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class FakePublisher:
    """amqp.publisher.StreamPublisher's interface; verdicts scripted per eventId."""

    def __init__(self) -> None:
        self.down = 0  # connect() fails this many more times
        self.connects = 0
        self.verdicts: dict[str, str] = {}  # eventId -> status other than confirmed
        self.sent: list[OutMessage] = []
        self.log: list[tuple[str, list[str]]] = []  # ("send" | "collect", eventIds)
        self.raise_on_collect: BaseException | None = None
        self.idled: list[float] = []
        self.renewals = 0  # renew_channel() calls: the channels after the connection's first

    def connect(self) -> None:
        self.connects += 1
        if self.down:
            self.down -= 1
            raise BrokerUnavailable("broker unreachable: connection refused")

    def send(self, messages: Sequence[OutMessage]) -> list[tuple[str, PublishResult]]:
        self.sent.extend(messages)
        self.log.append(("send", [m.message_id or "" for m in messages]))
        ticket = []
        for msg in messages:
            status = self.verdicts.get(msg.message_id or "", "confirmed")
            reason = {"returned": "unroutable: 312 NO_ROUTE", "nacked": "the broker could not store the message",
                      "unconfirmed": "connection lost"}.get(status, "")
            ticket.append((msg.message_id or "", PublishResult(status, reason)))
        return ticket

    def wait(self, ticket: list[tuple[str, PublishResult]], wake: int) -> bool:
        return True

    def collect(self, ticket: list[tuple[str, PublishResult]]) -> list[PublishResult]:
        if self.raise_on_collect is not None:
            raise self.raise_on_collect
        self.log.append(("collect", [event_id for event_id, _ in ticket]))
        return [result for _, result in ticket]

    def idle(self, seconds: float, wake: int | None = None) -> None:
        self.idled.append(seconds)

    def renew_channel(self) -> None:
        self.renewals += 1
        self.log.append(("renew", []))


def twin(key: str) -> str:
    """Another ordering key in the same partition slot as *key*: with the same routing key its rows go to the
    same destination, so a confirm of one of them behind a nack of *key*'s makes that nack the row's own
    (outbox.outage.own_nacks)."""
    return next(f"{key}-twin{i}" for i in range(100_000) if slot_of(f"{key}-twin{i}") == slot_of(key))


def add(conn: sqlite3.Connection, *envs: dict[str, Any]) -> list[str]:
    with outbox.transaction(conn):
        for env in envs:
            outbox.enqueue(conn, env)
    return [env["eventId"] for env in envs]


def row(conn: sqlite3.Connection, event_id: str) -> dict[str, Any]:
    return outbox.show(conn, event_id)


def dispatcher(conn: sqlite3.Connection, pub: FakePublisher, clock: Clock, **config: Any) -> outbox.Dispatcher:
    config.setdefault("exchange", "test.events")
    return outbox.Dispatcher(conn, pub, outbox.DispatchConfig(**config), clock=clock.time, sleep=clock.sleep)
