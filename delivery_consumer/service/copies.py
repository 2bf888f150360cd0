"""The copies ``run`` publishes instead of losing a message: to a retry tier
after a transient failure, to the dead queue after a rejection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..amqp.consumer import Delivery
from ..amqp.publisher import OutMessage
from ..contract import Outcome
from ..errors import RETRIES_EXHAUSTED, Rejection
from ..retry import GiveUp, RetryPolicy, attempts_done, retry_after_tier
from ..sqlite import now_iso
from ..topology import (
    BROKER_HEADERS,
    H_ATTEMPTS,
    H_CONSUMER,
    H_ERROR_CODE,
    H_ERROR_REASON,
    H_FAILED_AT,
    H_LAST_ERROR,
    H_ROUTING_KEY,
    Topology,
)


@dataclass(slots=True)
class Copy:
    kind: str  # "retry" | "dead"
    delivery: Delivery
    message: OutMessage
    rejection: Rejection | None  # what to record in `rejected` (dead copies)
    attempts: int


class CopyMaker:
    """Makes the copy a delivery's outcome calls for, if any."""

    def __init__(self, consumer: str, topology: Topology, policy: RetryPolicy) -> None:
        self.consumer = consumer
        self.topology = topology
        self.policy = policy

    def for_outcome(self, d: Delivery, outcome: Outcome) -> Copy | None:
        attempt = attempts_done(d.headers) + 1
        if outcome.rejection is not None:
            return self.dead(d, outcome.rejection, attempt)
        if outcome.transient is None:
            return None
        decision = self.policy.after_failure(attempt)
        if isinstance(decision, GiveUp):
            rejection = Rejection(
                RETRIES_EXHAUSTED,
                f"{outcome.transient.code} after {attempt} attempts: {outcome.transient.reason}",
                event_id=outcome.event_id,
            )
            return self.dead(d, rejection, attempt)
        if outcome.transient.retry_after_s is not None:  # e.g. an HTTP 429's Retry-After (webhook)
            decision = retry_after_tier(decision, self.topology.retry_delays_ms, outcome.transient.retry_after_s)
        headers = self._headers(d)
        headers[H_ATTEMPTS] = decision.attempts
        headers[H_LAST_ERROR] = outcome.transient.reason
        message = OutMessage(
            routing_key=self.topology.retry_queue(decision.tier),
            body=d.body,
            message_id=d.message_id,
            headers=headers,
            content_type=d.content_type or "application/json",
            content_encoding=d.content_encoding,
        )
        return Copy("retry", d, message, None, attempt)

    def dead(self, d: Delivery, rejection: Rejection, attempt: int) -> Copy:
        headers = self._headers(d)
        headers.update({
            H_ERROR_CODE: rejection.code,
            H_ERROR_REASON: rejection.reason,
            H_ATTEMPTS: attempt,
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
        return Copy("dead", d, message, rejection, attempt)

    def _headers(self, d: Delivery) -> dict[str, Any]:
        headers = {k: v for k, v in d.headers.items() if k not in BROKER_HEADERS}
        headers.setdefault(H_ROUTING_KEY, d.routing_key)
        headers[H_CONSUMER] = self.consumer
        return headers
