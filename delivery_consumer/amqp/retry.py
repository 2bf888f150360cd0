"""Pure retry policy: what to do with a failed attempt, and reconnect backoff.

No I/O here, so every rule is unit-tested (and property-tested) without a
broker. Units are in the names: ``_ms`` milliseconds, ``_s`` seconds.

Attempts count *tries*: the first delivery is attempt 1. A transient failure
of attempt ``n`` goes to retry tier ``n - 1`` (delays 1 s, 10 s, 60 s by
default, the last one repeating) unless ``n`` reached ``max_attempts``, in
which case the event is dead-lettered with ``retries-exhausted``.

The count travels in the ``x-attempts`` header of the copies ``run`` makes,
sealed (``x-attempts-seal``) with a key only the consumer's database holds:
a count anyone else wrote -- a producer's own header, a copy of the
previous release -- is not trusted and counts as 0 (docs/failures.md,
"Attempts").
"""

from __future__ import annotations

import hashlib
import hmac
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..model.errors import RETRIES_EXHAUSTED
from .topology import DEFAULT_RETRY_DELAYS_MS, H_ATTEMPTS, H_ATTEMPTS_SEAL

DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Retry:
    """Send a copy to retry tier ``tier`` carrying ``attempts`` done so far."""

    tier: int
    delay_ms: int
    attempts: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Dead-letter the event: it failed ``attempts`` times."""

    attempts: int
    code: str = RETRIES_EXHAUSTED


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    delays_ms: tuple[int, ...] = DEFAULT_RETRY_DELAYS_MS

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not self.delays_ms or min(self.delays_ms) < 1:
            raise ValueError("retry delays must be positive")

    def after_failure(self, attempt: int) -> Retry | GiveUp:
        """Decide what follows the transient failure of try number *attempt*."""
        attempt = max(1, attempt)
        if attempt >= self.max_attempts:
            return GiveUp(attempts=attempt)
        tier = attempt - 1
        delay = self.delays_ms[min(tier, len(self.delays_ms) - 1)]
        return Retry(tier=tier, delay_ms=delay, attempts=attempt)


def retry_after_tier(decision: Retry, delays_ms: tuple[int, ...], retry_after_s: float) -> Retry:
    """Move *decision* to a tier that honours a ``Retry-After`` of *retry_after_s*.

    The first tier whose delay is at least the wait asked for, but never a
    shorter tier than the policy chose; when no tier is that long, the
    longest one (the closest we can come). The attempt count is unchanged:
    a throttled try is still a try.
    """
    wanted_ms = max(0.0, retry_after_s) * 1000
    fitting = [i for i, delay in enumerate(delays_ms) if delay >= wanted_ms]
    tier = fitting[0] if fitting else max(range(len(delays_ms)), key=lambda i: delays_ms[i])
    tier = tier if delays_ms[tier] >= delays_ms[min(decision.tier, len(delays_ms) - 1)] else decision.tier
    if tier == decision.tier:
        return decision
    return Retry(tier=tier, delay_ms=delays_ms[tier], attempts=decision.attempts)


def attempts_done(headers: Mapping[str, Any] | None) -> int:
    """Failed tries recorded on a message (``x-attempts``); 0 when absent or garbled."""
    if not headers:
        return 0
    value = headers.get(H_ATTEMPTS)
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value) if isinstance(value, (str, bytes)) else 0
        except ValueError:
            return 0
    return max(0, min(int(value), 1_000_000))


#: The version prefix of a seal (a later scheme gets another one; an unknown one is not trusted).
_SEAL_VERSION = "v1."


def seal_attempts(key: bytes, body: bytes, attempts: int) -> str:
    """The ``x-attempts-seal`` of a copy of *body* carrying *attempts*: an
    HMAC-SHA-256 (128 bits of it) of the count and the body's digest, under
    the consumer's *key*."""
    message = b"%s%d:" % (_SEAL_VERSION.encode(), attempts) + hashlib.sha256(body).digest()
    return _SEAL_VERSION + hmac.new(key, message, hashlib.sha256).hexdigest()[:32]


def sealed_attempts(headers: Mapping[str, Any] | None, body: bytes, key: bytes | None) -> int:
    """:func:`attempts_done` when the message's seal proves that a copy made
    with *key* wrote the count for this very body; else 0 (a count nobody
    can vouch for starts again, never goes up)."""
    attempts = attempts_done(headers)
    if attempts == 0 or key is None or headers is None:
        return 0
    seal = headers.get(H_ATTEMPTS_SEAL)
    if isinstance(seal, bytes):
        seal = seal.decode("ascii", "replace")
    if not isinstance(seal, str) or not seal.isascii() \
            or not hmac.compare_digest(seal, seal_attempts(key, body, attempts)):
        return 0
    return attempts


#: The longest wait between two connection attempts: a broker that comes back
#: is reached again within this (plus one connect), however long it was away.
RECONNECT_CAP_S = 5.0


def reconnect_delay_s(failures: int, *, base_s: float = 0.5, cap_s: float = RECONNECT_CAP_S,
                      rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter for the *failures*-th failed connect.

    Grows ``base * 2**(failures-1)`` up to ``cap``, then takes a uniformly
    random value in its upper half, so that many consumers restarting
    together do not reconnect in lockstep.
    """
    ceiling = min(cap_s, base_s * 2 ** max(0, min(failures - 1, 32)))
    return float(ceiling * (0.5 + 0.5 * (rng or random).random()))
