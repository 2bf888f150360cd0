"""Turning a classic queue an earlier release declared into a quorum queue of the same name.

A queue's type cannot change: the classic queue's messages go to a quorum queue
beside it (``<name>.upgrade``), the classic queue is deleted once empty, the
quorum one declared under the name, and the messages come back into it. Every
copy is confirmed before its original is acknowledged, so a crash leaves at worst
a duplicate, never a loss; running it again finishes the job (docs/amqp.md,
"Upgrading from classic queues").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import pika.exceptions as pex

from ..model.errors import BrokerError, BrokerFatal, BrokerUnavailable
from .admin import done_unless_refused
from .connection import FAILURES, Addresses, classify, open_blocking

#: Messages taken at once from a queue being emptied (the reader's prefetch, acked together).
WINDOW = 500


@dataclass
class Upgraded:
    """What :func:`upgrade_queue` did to one queue."""

    queue: str
    #: "quorum already" | "created" | "upgraded" (a classic queue became a quorum queue)
    outcome: str
    #: Messages it moved out of the classic queue and back in.
    moved: int = 0


#: What the broker says when a queue's declare names another type than the classic queue it is.
_CLASSIC_REFUSAL = (406, "x-queue-type", "current is 'classic'")


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, pex.ChannelClosedByBroker) and exc.reply_code == 404 and "no queue" in exc.reply_text


class _Session:
    """One connection: a channel for declares (a refusal closes it: a new one then) and a confirm
    channel for copies."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.conn: Any = open_blocking(Addresses(url, name=name))
        self.channel: Any = self.conn.channel()
        self.pub: Any = self.conn.channel()
        self.pub.confirm_delivery()

    def fresh(self) -> Any:
        if not self.channel.is_open:
            self.channel = self.conn.channel()
        return self.channel

    def declare(self, queue: str, args: dict[str, Any]) -> bool:
        """Declare *queue* with *args*; False when it exists as a classic queue (406 on its type)."""
        return done_unless_refused(lambda: self.fresh().queue_declare(queue, durable=True, arguments=args),
                                   *_CLASSIC_REFUSAL)

    def ready(self, queue: str) -> int | None:
        """Ready messages of *queue* (None: it does not exist)."""
        try:
            return int(self.fresh().queue_declare(queue, passive=True).method.message_count)
        except pex.ChannelClosedByBroker as exc:
            if _missing(exc):
                return None
            raise

    def move(self, source: str, target: str) -> int:
        """Every message of *source* into *target* (default exchange, mandatory, confirmed, each with its
        properties and headers), each window acknowledged once its copies are confirmed; in order."""
        moved = 0
        reader = self.conn.channel()
        try:
            reader.basic_qos(prefetch_count=WINDOW)
            held: list[tuple[Any, Any, bytes]] = []
            reader.basic_consume(source, lambda _c, m, p, b: held.append((m, p, b)), auto_ack=False, exclusive=True)
            while True:
                while len(held) < WINDOW:  # a window, or all there is: nothing ready, nothing arriving
                    before = len(held)
                    self.conn.process_data_events(time_limit=0.1)
                    if len(held) == before and not self.ready(source):
                        break
                if not held:
                    return moved
                for _method, props, body in held:
                    if props.delivery_mode != 2:
                        props.delivery_mode = 2
                    try:
                        self.pub.basic_publish("", target, body, props, mandatory=True)
                    except (pex.UnroutableError, pex.NackError) as exc:
                        raise BrokerUnavailable(f"a copy from {source} to {target} was not accepted "
                                                f"({type(exc).__name__}); nothing of this window was removed, "
                                                "run the upgrade again") from None
                reader.basic_ack(held[-1][0].delivery_tag, multiple=True)
                moved += len(held)
                held.clear()
        finally:
            with suppress(*FAILURES):
                if reader.is_open:
                    reader.close()

    def delete_if_empty(self, queue: str, *, classic: bool) -> bool:
        """Delete *queue* when it holds nothing; False when it does (it received messages meanwhile).
        A classic queue is asked with ``if-empty``; a quorum queue refuses that flag (RabbitMQ 3.10), so
        its count is checked just before."""
        if classic:
            return done_unless_refused(lambda: self.fresh().queue_delete(queue, if_empty=True), 406)
        ready = self.ready(queue)
        if ready:
            return False
        if ready is not None:
            self.fresh().queue_delete(queue)
        return True

    def close(self) -> None:
        with suppress(*FAILURES):
            if self.conn.is_open:
                self.conn.close()


@contextmanager
def _session(url: str, name: str) -> Iterator[_Session]:
    """A :class:`_Session` for one call, closed after it; pika's failures leave classified."""
    session: _Session | None = None
    try:
        session = _Session(url, name)
        yield session
    except BrokerError:
        raise
    except FAILURES as exc:
        raise classify(exc, url=url) from None
    finally:
        if session is not None:
            session.close()


def upgrade_queue(url: str, queue: str, args: dict[str, Any], *, name: str = "delivery-consumer topology upgrade",
                  rounds: int = 10) -> Upgraded:
    """Make *queue* a quorum queue declared with *args* (which say ``x-queue-type: quorum``), moving the
    messages of the classic queue of that name, if there is one, into it; also finishes an upgrade a
    crash interrupted (messages left in ``<queue>.upgrade``). Whoever publishes to *queue* meanwhile
    finds it missing for a moment: ``run`` holds such a delivery and tries again, a main queue's
    at-least-once dead-lettering keeps the message until it can."""
    parking = f"{queue}.upgrade"
    with _session(url, name) as session:
        moved = 0
        upgraded = False
        if not session.declare(queue, args):  # a classic queue of that name: park its messages
            upgraded = True
            session.declare(parking, args)
            for _ in range(rounds):
                moved += session.move(queue, parking)
                if session.delete_if_empty(queue, classic=True):
                    break
            else:
                raise BrokerUnavailable(f"{queue} keeps receiving messages; stop what publishes to it and run "
                                        "the upgrade again")
            if not session.declare(queue, args):
                raise BrokerFatal(f"{queue} is a classic queue again: something declared it meanwhile (a run of the "
                                  "earlier release?); stop it and run the upgrade again")
        if session.ready(parking) is not None:  # its messages come back (also after an interrupted upgrade)
            upgraded = True
            for _ in range(rounds):
                session.move(parking, queue)
                if session.delete_if_empty(parking, classic=False):
                    break
        return Upgraded(queue, "upgraded" if upgraded else "quorum already", moved)


def replace_marker(url: str, queue: str, classic_args: dict[str, Any], args: dict[str, Any], *,
                   name: str = "delivery-consumer topology upgrade") -> str:
    """Replace a classic marker queue (never used, empty) by a quorum one declared with *args*.
    *classic_args*: what the earlier release declared it with; a marker recording another count is
    refused (BrokerFatal) and left alone. Returns what was done."""
    with _session(url, name) as session:
        if session.declare(queue, args):
            return "quorum already"
        try:
            session.fresh().queue_declare(queue, durable=True, arguments=classic_args)
        except pex.ChannelClosedByBroker as exc:
            raise BrokerFatal(f"{queue} records another partition count than the one given: "
                              f"{exc.reply_text}") from None
        if not session.delete_if_empty(queue, classic=True):
            raise BrokerFatal(f"{queue} holds messages: it is not a marker queue of delivery-consumer")
        session.declare(queue, args)
        return "upgraded"


__all__ = ["Upgraded", "replace_marker", "upgrade_queue"]
