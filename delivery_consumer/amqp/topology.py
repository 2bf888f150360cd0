"""Names and arguments of the RabbitMQ objects of a consumer (no pika here).

Every queue is a quorum queue (replicated: no queue lives on one node); the
main queue and its retry tiers (named after their delay) dead-letter
at-least-once. Why the dead queue and the partition marker are quorum queues
too, and the names of a partitioned consumer's queues: docs/amqp.md, "Queues". A broker
address string may name several nodes (:func:`addresses`, docs/amqp.md,
"Several addresses").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..model.errors import ConfigError

#: The broker when neither a flag, DELIVERY_AMQP_URL nor the deployment file names one.
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
#: Environment variable naming the order in which several broker addresses are
#: tried (``--amqp-order`` and the deployment file's ``amqp_order`` set it).
AMQP_ORDER_ENV = "DELIVERY_AMQP_ORDER"
#: The orders: as given (the default), or shuffled for every attempt.
AMQP_ORDERS = ("in-order", "shuffle")


class AddressError(ConfigError):
    """A broker address string that names no AMQP URL, or a malformed multi-host URL."""


_SCHEME = re.compile(r"^amqps?://", re.IGNORECASE)


def addresses(text: str) -> list[str]:
    """The AMQP URLs of an address string, in order (AddressError when it names none or is malformed).

    URLs are separated by commas or whitespace; a piece without a scheme is one
    more host of the URL before it (``amqp://u:p@h1:5672,h2:5673/vhost?q``): it
    gets that URL's scheme and user, and the path and query written after the
    last host. A comma inside a password must be percent-encoded (``%2C``).
    """
    groups: list[list[str]] = []
    for piece in re.split(r"[,\s]+", text.strip()):
        if not piece:
            continue
        if _SCHEME.match(piece):
            groups.append([piece])
        elif groups:
            groups[-1].append(piece)
        else:
            raise AddressError(f"{piece.split('@')[-1]!r} is not an amqp:// or amqps:// URL")
    if not groups:
        raise AddressError("no address given")
    urls: list[str] = []
    for group in groups:
        if len(group) == 1:
            urls.append(group[0])
            continue
        head, *hosts = group
        scheme, rest = head.split("://", 1)
        userinfo, first = rest.rsplit("@", 1) if "@" in rest else ("", rest)
        cut = re.search(r"[/?]", hosts[-1])
        tail = hosts[-1][cut.start():] if cut else ""
        hosts[-1] = hosts[-1][:cut.start()] if cut else hosts[-1]
        if re.search(r"[/?]", first) or any(re.search(r"[/?@]", host) or not host for host in hosts):
            raise AddressError("in a URL with several hosts (amqp://user:password@h1:port,"
                              "h2:port/vhost) only the last host may be followed by /vhost or ?options")
        prefix = f"{scheme}://{userinfo}@" if userinfo else f"{scheme}://"
        urls.extend(f"{prefix}{host}{tail}" for host in [first, *hosts])
    return urls


def join(urls: Sequence[str]) -> str:
    """The address string of *urls* (the inverse of :func:`addresses` for URLs without commas)."""
    return ",".join(urls)
DEFAULT_EXCHANGE = "delivery.events"
DEFAULT_PREFIX = "delivery"
#: Retry delays in milliseconds (1 s, 10 s, 60 s).
DEFAULT_RETRY_DELAYS_MS: tuple[int, ...] = (1_000, 10_000, 60_000)
#: The broker's backstop for a message that kills the process before any code
#: can count it (our own durable count normally stops it much earlier).
DEFAULT_DELIVERY_LIMIT = 20
#: The dead queue's delivery limit: never reached. Its readers give back what they leave by closing
#: their channel, which a quorum queue counts as a delivery; without a limit of its own, a broker
#: whose default is one (RabbitMQ 4.0: 20) would drop a dead letter after that many listings.
#: Not -1: RabbitMQ 3.10 takes it and drops every message at its first return.
DEAD_DELIVERY_LIMIT = 1_000_000_000

# Headers we set on copies (retry tiers, dead letters, requeues).
H_ATTEMPTS = "x-attempts"
#: The seal of H_ATTEMPTS on a copy we made (retry.seal_attempts): a count without it is not ours.
H_ATTEMPTS_SEAL = "x-attempts-seal"
H_ERROR_CODE = "x-error-code"
H_ERROR_REASON = "x-error-reason"
H_CONSUMER = "x-consumer"
H_FAILED_AT = "x-failed-at"
H_ROUTING_KEY = "x-original-routing-key"
H_LAST_ERROR = "x-last-error"  # a retry copy: the reason of its transient failure
#: On an event forwarded by a partition's run to its own partition: the queue it reached first.
H_FORWARDED_FROM = "x-forwarded-from"
H_DELIVERY_COUNT = "x-delivery-count"  # set by quorum queues on redelivery
H_PRODUCED_MS = "x-produced-ms"  # dispatch: the outbox row's created_at, ms since the epoch
#: Headers a copy carries about its failure (run's retry and dead copies write
#: them); a requeued copy starts afresh without them.
FAILURE_HEADERS = (H_ATTEMPTS, H_ATTEMPTS_SEAL, H_ERROR_CODE, H_ERROR_REASON, H_FAILED_AT, H_CONSUMER, H_LAST_ERROR)
#: Headers the broker owns; a copy we publish must not carry them back.
BROKER_HEADERS = ("x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
                  "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", H_DELIVERY_COUNT)


@dataclass(frozen=True)
class Topology:
    """The exchange and queues of one consumer."""

    consumer: str
    binding_keys: tuple[str, ...] = ("#",)
    exchange: str = DEFAULT_EXCHANGE
    prefix: str = DEFAULT_PREFIX
    retry_delays_ms: tuple[int, ...] = DEFAULT_RETRY_DELAYS_MS
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT
    extra_queue_args: dict[str, Any] = field(default_factory=dict)
    #: The partition these queues serve (None: an unpartitioned consumer).
    partition: int | None = None
    #: The consumer's partition count, recorded on the broker by a marker
    #: queue (see :attr:`count_marker`).
    partition_count: int | None = None

    @property
    def queue(self) -> str:
        base = f"{self.prefix}.{self.consumer}"
        return base if self.partition is None else f"{base}.p{self.partition}"

    @property
    def queue_binding_keys(self) -> tuple[str, ...]:
        """Keys binding the main queue to the exchange; none for a partition
        (its messages come through the consumer's slot route)."""
        return self.binding_keys if self.partition is None else ()

    @property
    def count_marker(self) -> str:
        """A partitioned consumer's marker queue (quorum: replicated): never used, its
        ``x-max-length`` is the partition count, so that declaring another count fails
        (406, inequivalent arg) instead of binding an article to two partitions."""
        return f"{self.prefix}.{self.consumer}.partitions"

    @property
    def dead_queue(self) -> str:
        return f"{self.queue}.dead"

    def retry_queue(self, tier: int) -> str:
        """The queue of retry tier *tier* (0-based; the last tier repeats)."""
        delay = self.retry_delays_ms[min(tier, len(self.retry_delays_ms) - 1)]
        return f"{self.queue}.retry.{delay}ms"

    @property
    def handover_queue(self) -> str:
        """Where ``repartition`` leaves the messages of this queue's keys that waited in the queues
        of the former layout: ``run`` applies them before anything of its own queue, and then
        deletes it (docs/partitions.md, "Changing the count"). Not one of :meth:`queues`: it
        exists only between a repartition and the first run after it."""
        return f"{self.queue}.handover"

    def main_arguments(self) -> dict[str, Any]:
        """The declare arguments of the main queue (and of its handover queue)."""
        return {
            "x-queue-type": "quorum",
            "x-delivery-limit": self.delivery_limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.dead_queue,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
            **({"x-single-active-consumer": True} if self.partition is not None else {}),
            **self.extra_queue_args,
        }

    def dead_arguments(self) -> dict[str, Any]:
        """The declare arguments of the dead queue (docs/amqp.md, "Queues")."""
        return {"x-queue-type": "quorum", "x-delivery-limit": DEAD_DELIVERY_LIMIT}

    def marker_arguments(self, count: int) -> dict[str, Any]:
        """The declare arguments of the partition count's marker queue."""
        return {"x-queue-type": "quorum", "x-max-length": count}

    def queues(self) -> list[tuple[str, dict[str, Any]]]:
        """Every queue with its declare arguments, the dead queue first (it
        must exist before anything can dead-letter into it)."""
        quorum: dict[str, Any] = {"x-queue-type": "quorum"}
        at_least_once = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
        result: list[tuple[str, dict[str, Any]]] = [(self.dead_queue, self.dead_arguments()),
                                                    (self.queue, self.main_arguments())]
        if self.partition_count is not None:  # first: a wrong count fails before anything is declared
            result.insert(0, (self.count_marker, self.marker_arguments(self.partition_count)))
        for delay in dict.fromkeys(self.retry_delays_ms):
            result.append(
                (
                    f"{self.queue}.retry.{delay}ms",
                    {
                        **quorum,
                        "x-message-ttl": delay,
                        "x-dead-letter-exchange": "",
                        "x-dead-letter-routing-key": self.queue,
                        **at_least_once,
                    },
                )
            )
        return result


@dataclass(frozen=True)
class Binding:
    """One binding: to a queue, or (``to_exchange``) exchange to exchange."""

    source: str
    destination: str
    routing_key: str = ""
    arguments: dict[str, Any] | None = None
    to_exchange: bool = False


@dataclass(frozen=True)
class Route:
    """Exchanges to declare (name, type, arguments) and bindings to add or remove."""

    exchanges: tuple[tuple[str, str, dict[str, Any]], ...] = ()
    queues: tuple[tuple[str, dict[str, Any]], ...] = ()
    bind: tuple[Binding, ...] = ()
    unbind: tuple[Binding, ...] = ()


def classic_leftover(error: str, base: Topology) -> str | None:
    """The queue of *base*'s consumer that *error* (a refused declare) says an earlier release
    declared as a classic queue -- its dead queue or its partition marker -- or None."""
    if "inequivalent arg 'x-queue-type'" not in error or "current is 'classic'" not in error:
        return None
    stem = f"'{base.prefix}.{base.consumer}."
    at = error.find(stem)
    if at < 0:
        return None
    name = error[at + 1:error.find("'", at + 1)]
    return name if name.endswith((".dead", ".partitions")) else None


def upgrade_hint(error: str, base: Topology) -> str:
    """*error* as one line saying what to run, when it is a classic queue an earlier release declared."""
    queue = classic_leftover(error, base)
    if queue is None:
        return error
    prefix = "" if base.prefix == DEFAULT_PREFIX else f" --queue-prefix {base.prefix}"
    return (f"{queue} is a classic queue declared by an earlier release (now every queue is a quorum queue): run "
            f"delivery-consumer topology upgrade --consumer {base.consumer}{prefix} once, then start again "
            "(docs/amqp.md, \"Upgrading from classic queues\")")


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` one word, ``#`` zero or more."""

    def match(p: list[str], k: list[str]) -> bool:
        if not p:
            return not k
        if p[0] == "#":
            return any(match(p[1:], k[i:]) for i in range(len(k) + 1))
        return bool(k) and (p[0] == "*" or p[0] == k[0]) and match(p[1:], k[1:])

    return match(pattern.split("."), key.split("."))
