"""The exception tree of delivery-consumer.

Every failure that reaches an event carries a *code*, so that the CLI, the
broker loop and the ``rejected`` table speak the same vocabulary:

* :class:`Rejection` -- permanent: retrying the same bytes can never succeed.
  The event is recorded in ``rejected`` (and, with a broker, dead-lettered).
* :class:`TransientError` -- the same bytes may succeed later (database busy
  past its timeout, disk full, an endpoint that timed out). With a broker the
  delivery goes to a retry tier; ``replay`` reports it and exits non-zero.
* :class:`DatabaseError` -- the consumer's database cannot be used at all
  (missing, corrupt, of another consumer, newer schema). Not about one event:
  the command stops with one clear line.

The whole tree (every class derives from :class:`DeliveryError`)::

    DeliveryError
    ├── Rejection                 permanent refusal of one event (a code below)
    ├── TransientError            retry later
    │   └── StoreUnavailable      the database as a whole failed
    ├── DatabaseError             the database cannot be used (exit 2)
    │   ├── WrongDatabase, DatabaseLost, DatabaseInUse, DatabaseMalformed
    │   └── StoreOutage           unusable past run's outage limit (exit 75)
    │       └── TakenOver         a standby took the database over (exit 75)
    ├── ConfigError               configuration or usage (exit 2)
    ├── NotFound                  no record with that key (exit 1)
    ├── QueryError                ad-hoc SQL refused or failed
    ├── OutboxError               the outbox API used the wrong way
    ├── FenceError                a fence cannot be changed as asked
    ├── PruneRefused              a prune would remove receipts still needed
    └── BrokerError               talking to RabbitMQ failed (raised by ``amqp``)
        ├── BrokerUnavailable     unreachable or dropped: retry later
        └── BrokerFatal           retrying cannot help (credentials, vhost, arguments)

The broker's errors are defined here, not in ``amqp``, so that code without pika
catches them; ``amqp.connection.classify`` maps pika's failures to them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

# Rejection codes (exact strings; part of the public contract). REJECTIONS
# below is their one registry: every code with its meaning.
MALFORMED_JSON: Final = "malformed-json"
INVALID_ENVELOPE: Final = "invalid-envelope"
UNKNOWN_TYPE: Final = "unknown-type"
EVENT_ID_REUSED: Final = "event-id-reused"
REVISION_CONFLICT: Final = "revision-conflict"
RETRIES_EXHAUSTED: Final = "retries-exhausted"
DELIVERY_LIMIT: Final = "delivery-limit"
ENDPOINT_REJECTED: Final = "endpoint-rejected"
OUTCOME_UNKNOWN: Final = "outcome-unknown"
WRONG_PARTITION: Final = "wrong-partition"
#: Not a rejection: the outcome ``run`` records (``forwarded:p<k>``) for an event of partition k that
#: reached another partition's queue and was sent on to its own.
FORWARDED: Final = "forwarded"
UNSTORABLE_VALUE: Final = "unstorable-value"

#: Every rejection code, with its meaning in one line (docs/envelope.md's table of
#: codes lists exactly these; ``trace`` counts exactly these as rejections).
REJECTIONS: Final[Mapping[str, str]] = MappingProxyType({
    MALFORMED_JSON: "the body is not UTF-8, not JSON, not a JSON object, or names a key twice",
    INVALID_ENVELOPE: "a schema violation, an out-of-range value, or a body over the size limit",
    UNKNOWN_TYPE: "the event's type is one the contract does not know",
    EVENT_ID_REUSED: "the eventId was first received with another fingerprint",
    REVISION_CONFLICT: "the same revision is stored with another domain state",
    RETRIES_EXHAUSTED: "run: a transient failure outlived the attempts allowed",
    # The message killed the process max_crashes times while it was handled
    # alone (poison); its copy went to the dead queue unapplied.
    DELIVERY_LIMIT: "run: the message killed the process too many times while it was handled alone (poison)",
    # Effects outside the database (the webhook consumer, inbox/fence.py).
    ENDPOINT_REJECTED: "an endpoint refused the request for good (a 4xx)",
    OUTCOME_UNKNOWN: "a call to an endpoint that is not idempotent may have had its effect: not repeated on a guess",
    # Applied here, the article's state would be split in two files (a producer
    # that computes the slot differently, bindings that disagree with the databases).
    WRONG_PARTITION: "a partition's database refuses an article of another partition (run forwards it to its own)",
    # The same bytes fail the same way every time: retrying cannot help (the
    # database's own failures -- busy, full, read-only -- stay transient).
    UNSTORABLE_VALUE: "a value passed its schema but the consumer's tables cannot hold it (an integer past 64 bits, "
                      "a value its column's type refuses)",
})
#: Every rejection code, in the registry's order.
REJECTION_CODES: Final = tuple(REJECTIONS)
#: The codes an event's bytes and the stored state decide, whatever the
#: consumer, broker or endpoint: those a replay of files can answer.
CONTENT_CODES: Final = (MALFORMED_JSON, INVALID_ENVELOPE, UNKNOWN_TYPE, EVENT_ID_REUSED, REVISION_CONFLICT)

#: Reasons end up in logs, AMQP headers and the ``rejected`` table: keep them
#: short and free of control characters, whatever the payload contained.
MAX_REASON_CHARS: Final = 200
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def safe_reason(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """Return *text* as one short printable line, safe to log."""
    text = _UNSAFE.sub(" ", text).strip()
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


class DeliveryError(Exception):
    """Base class of every error raised by delivery-consumer."""


class Rejection(DeliveryError):
    """A permanent refusal of one event, with a rejection code.

    A consumer raises it from its effect with a code of its own or one of
    the codes above (``Rejection("payment-declined", "card expired")``); the
    store fills in what it knows of the event: ``event_id`` and
    ``fingerprint`` (a body that is not JSON has neither), ``key`` (the
    value of its type's key field) and ``origin`` (a CloudEvent's source and
    id, as its producer sent them).
    """

    def __init__(
        self,
        code: str,
        reason: str,
        *,
        event_id: str | None = None,
        fingerprint: str | None = None,
        key: str | None = None,
        origin: tuple[str, str] | None = None,
    ) -> None:
        self.code = code
        self.reason = safe_reason(reason)
        self.event_id = event_id
        self.fingerprint = fingerprint
        self.key = key
        #: ``(source, id)`` of the CloudEvent the event came as, or None.
        self.origin = origin
        super().__init__(f"{code}: {self.reason}")


class TransientError(DeliveryError):
    """A failure that may go away by itself; the event should be retried.

    Consumer effects raise it (or a subclass) to ask for a retry instead of a
    rejection. ``code`` names the cause in logs and headers.
    ``retry_after_s`` is how long the cause asked us to wait (an HTTP 429's
    ``Retry-After``); ``run`` then picks the first retry tier at least that
    long (:func:`delivery_consumer.amqp.retry.retry_after_tier`).
    """

    def __init__(self, reason: str, *, code: str = "transient", retry_after_s: float | None = None) -> None:
        self.code = code
        self.reason = safe_reason(reason)
        self.retry_after_s = retry_after_s
        super().__init__(f"{code}: {self.reason}")


class StoreUnavailable(TransientError):
    """The database as a whole failed (disk full, I/O error, busy past its
    timeout, read-only, cannot be opened): no event caused it, so no event
    pays for it. ``run`` holds its deliveries and waits for the database."""


class DatabaseError(DeliveryError):
    """The consumer database cannot be opened or used (not about one event)."""


class WrongDatabase(DatabaseError):
    """The file is a database of something else: another consumer's, or a
    producer's (it holds an outbox)."""


class DatabaseLost(DatabaseError):
    """The database file was deleted or replaced under a process that had it
    open: what it writes goes to a file nobody will read. Nothing more may be
    acknowledged; a person must look (exit 2, not restarted)."""


class DatabaseInUse(DatabaseError):
    """Another process writes this database (it holds the lock on the file)."""


class DatabaseMalformed(DatabaseError):
    """SQLite read the file as damaged ("database disk image is malformed"). Either
    the file is, or the disk under it failed: ``run`` reopens it and checks it before
    it calls it damaged (docs/failures.md)."""



class StoreOutage(DatabaseError):
    """The database stayed unusable as a whole past ``run``'s outage limit.
    Not a configuration error: ``run`` exits 75 (EX_TEMPFAIL) so that a
    supervisor restarts it, where a DatabaseError exits 2."""


class TakenOver(StoreOutage):
    """A standby took over this run's database while this run was frozen; it stops
    (exit 75: restarted, it waits as a standby)."""


class ConfigError(DeliveryError):
    """A configuration or usage error (unknown consumer, bad option value)."""


class NotFound(DeliveryError):
    """No record with the key asked for (the CLI exits 1, not 2)."""


class QueryError(DeliveryError):
    """Ad-hoc SQL was refused (a write, several statements) or failed."""


class OutboxError(DeliveryError):
    """The outbox was used the wrong way (enqueue outside a transaction,
    nested transactions, no outbox installed, an envelope of the wrong type,
    a routing key AMQP cannot carry)."""


class FenceError(DeliveryError):
    """A fence cannot be changed as asked (unknown key, already done)."""


class PruneRefused(DeliveryError):
    """The prune would remove receipts that may still be needed."""


# -- the broker's failures (raised by delivery_consumer.amqp; caught without importing pika) --

class BrokerError(DeliveryError):
    """Something went wrong talking to RabbitMQ."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached or dropped us; retrying later may work."""


class BrokerFatal(BrokerError):
    """Retrying cannot help: credentials, vhost, permissions, queue arguments."""
