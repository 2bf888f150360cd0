"""The copies ``run`` publishes instead of losing a message: to a retry tier
after a transient failure, to the dead queue after a rejection, to its own
partition's queue for a message of another partition. Each carries its attempt
count sealed with the consumer's key, and only a count so sealed is read back
(retry.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..amqp.retry import GiveUp, RetryPolicy, retry_after_tier, seal_attempts, sealed_attempts
from ..amqp.topology import (
    BROKER_HEADERS,
    H_ATTEMPTS,
    H_ATTEMPTS_SEAL,
    H_CONSUMER,
    H_ERROR_CODE,
    H_ERROR_REASON,
    H_FAILED_AT,
    H_FORWARDED_FROM,
    H_LAST_ERROR,
    H_ROUTING_KEY,
    Topology,
)
from ..inbox.database import SEAL_KEY
from ..inbox.seam import InboxDB
from ..model.contract import Outcome
from ..model.deliveries import Delivery, OutMessage
from ..model.envelope import Envelope
from ..model.errors import RETRIES_EXHAUSTED, Rejection, TransientError
from ..store.sqlite import now_iso


def seal_key(db: InboxDB) -> bytes | None:
    """The key that seals the attempt counts of *db*'s consumer (None in a
    database no writable open has given one yet)."""
    value = db.meta().get(SEAL_KEY)
    return bytes.fromhex(value) if value else None


def origin_of(parsed: Envelope | Rejection | None) -> tuple[str, str] | None:
    """The CloudEvent's (source, id) a delivery came as, if it did."""
    if isinstance(parsed, Envelope):
        return parsed.cloudevent
    return None if parsed is None else parsed.origin


@dataclass(slots=True)
class Copy:
    kind: str  # "retry" | "dead" | "forward"
    delivery: Delivery
    message: OutMessage
    rejection: Rejection | None  # what to record in `rejected` (dead copies); why (forwarded ones)
    attempts: int
    #: The event's eventId (None: its body was refused before it was read).
    event_id: str | None = None
    #: The CloudEvent's (source, id) the delivery came as, if it did.
    origin: tuple[str, str] | None = None


class CopyMaker:
    """Makes the copy a delivery's outcome calls for, if any."""

    def __init__(self, consumer: str, topology: Topology, policy: RetryPolicy, key: bytes | None = None) -> None:
        self.consumer = consumer
        self.topology = topology
        self.policy = policy
        #: The consumer's seal key (:func:`seal_key`); None: no count is trusted.
        self.key = key

    def attempts(self, d: Delivery) -> int:
        """Failed tries of *d* as this consumer's own copies counted them (0 for any other count)."""
        return sealed_attempts(d.headers, d.body, self.key)

    def for_outcome(self, d: Delivery, outcome: Outcome, parsed: Envelope | Rejection | None = None) -> Copy | None:
        """The copy *outcome* calls for (*parsed*: what the delivery parsed to), or None."""
        if outcome.result is not None:  # applied, or a duplicate: the usual case
            return None
        attempt = self.attempts(d) + 1
        if outcome.rejection is not None:
            return self.dead(d, outcome.rejection, attempt)
        if outcome.transient is None:
            return None
        decision = self.policy.after_failure(attempt)
        if isinstance(decision, GiveUp):
            rejection = Rejection(
                RETRIES_EXHAUSTED,
                f"{_transient(outcome.transient)} after {attempt} attempts: {outcome.transient.reason}",
                event_id=outcome.event_id,
                fingerprint=parsed.fingerprint if isinstance(parsed, Envelope) else None,
                key=parsed.key if isinstance(parsed, Envelope) else None,
                origin=origin_of(parsed),
            )
            return self.dead(d, rejection, attempt)
        if outcome.transient.retry_after_s is not None:  # e.g. an HTTP 429's Retry-After (webhook)
            decision = retry_after_tier(decision, self.topology.retry_delays_ms, outcome.transient.retry_after_s)
        headers = self._headers(d, decision.attempts)
        headers[H_LAST_ERROR] = outcome.transient.reason
        message = OutMessage(
            routing_key=self.topology.retry_queue(decision.tier),
            body=d.body,
            message_id=d.message_id,
            headers=headers,
            content_type=d.content_type or "application/json",
            content_encoding=d.content_encoding,
        )
        return Copy("retry", d, message, None, attempt, outcome.event_id, origin_of(parsed))

    def dead(self, d: Delivery, rejection: Rejection, attempt: int) -> Copy:
        headers = self._headers(d, attempt)
        headers.update({
            H_ERROR_CODE: rejection.code,
            H_ERROR_REASON: rejection.reason,
            H_FAILED_AT: now_iso(),
        })
        message = OutMessage(
            routing_key=self.topology.dead_queue,
            body=d.body,
            message_id=d.message_id or rejection.event_id,
            headers=headers,
            content_type=d.content_type or "application/octet-stream",
            content_encoding=d.content_encoding,
        )
        return Copy("dead", d, message, rejection, attempt, rejection.event_id, rejection.origin)

    def forward(self, d: Delivery, rejection: Rejection, partition: int) -> Copy:
        """*d*, an event of partition *partition* that reached this one, sent on to that partition's queue
        as it came (its attempts unchanged; the broker's redelivery headers left behind)."""
        home = replace(self.topology, partition=partition, partition_count=None)
        headers = {k: v for k, v in d.headers.items() if k not in BROKER_HEADERS}
        headers.setdefault(H_ROUTING_KEY, d.routing_key)
        headers[H_FORWARDED_FROM] = self.topology.queue
        message = OutMessage(
            routing_key=home.queue,
            body=d.body,
            message_id=d.message_id or rejection.event_id,
            headers=headers,
            content_type=d.content_type or "application/json",
            content_encoding=d.content_encoding,
        )
        return Copy("forward", d, message, rejection, self.attempts(d))

    def _headers(self, d: Delivery, attempts: int) -> dict[str, Any]:
        """*d*'s headers for a copy carrying *attempts*, sealed (without a key: no seal)."""
        headers = {k: v for k, v in d.headers.items() if k not in BROKER_HEADERS and k != H_ATTEMPTS_SEAL}
        headers.setdefault(H_ROUTING_KEY, d.routing_key)
        headers[H_CONSUMER] = self.consumer
        headers[H_ATTEMPTS] = attempts
        if self.key is not None:
            headers[H_ATTEMPTS_SEAL] = seal_attempts(self.key, d.body, attempts)
        return headers


def _transient(error: TransientError) -> str:
    """What failed, in a reason: the transient error's code, unless it is the generic one."""
    return "a transient failure" if error.code == "transient" else error.code
