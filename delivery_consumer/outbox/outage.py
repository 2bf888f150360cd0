"""A broker outage as the dispatcher sees it: one episode from the first sign
(a connect that fails, confirms that never come, a destination that nacks
everything) to the first confirm after it, whatever the number of rows it
touched. Rows waiting on it spend no failure and wait no backoff of their
own: the dispatcher probes, and when the broker confirms again they all go.
Why, and what makes a nack a row's own: docs/outbox.md, "Nack storms".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from ..amqp.partitions import slot_of
from ..model.plural import count

#: Where a message goes, as far as the dispatcher can tell: its routing key and
#: its partition slot (the topic exchange routes on the first, a partitioned
#: consumer's headers exchange on the second). A queue that refuses messages
#: refuses every message of the destinations routed to it.
Destination = tuple[str, int]

#: Rows of one refusing destination sent in one probe: the two oldest waiting,
#: of different keys. The second one confirmed while the first is nacked tells
#: that the nack is the first row's own (a body over the queue's byte limit).
PROBE_ROWS = 2
#: The longest pause between two probes (seconds): what a recovery waits at most before its rows
#: go. A probe costs a few rows' publication, so it is shorter than the reconnect backoff's cap.
PROBE_CAP_S = 2.0


@lru_cache(maxsize=65_536)
def _slot(ordering_key: str) -> int:
    return slot_of(ordering_key)


def destination(routing_key: str, ordering_key: str) -> Destination:
    """The destination of a row (see :data:`Destination`)."""
    return routing_key, _slot(ordering_key)


def own_nacks(destinations: Sequence[Destination], statuses: Sequence[str]) -> set[int]:
    """Indexes of the nacks that are their row's own: a later message of the
    same destination, sent behind it on the same channel, was confirmed, so
    the queues of that destination were storing messages and refused this one.
    Every other nack is the destination's: the row waits on the outage."""
    own: set[int] = set()
    if "nacked" not in statuses:
        return own
    confirmed_later: set[Destination] = set()
    for i in range(len(statuses) - 1, -1, -1):
        status = statuses[i]
        if status == "confirmed":
            confirmed_later.add(destinations[i])
        elif status == "nacked" and destinations[i] in confirmed_later:
            own.add(i)
    return own


@dataclass
class Outage:
    """One outage of the broker, open until it confirms again.

    ``link``: why the connection cannot be used (a failed connect, confirms
    lost or never come; None: the broker answers). ``refused``: the
    destinations whose every message it nacks, with the rows nacked waiting on
    each. The outage is over when both are cleared.
    """

    why: str
    #: time.monotonic() when it began (for the log's duration).
    since: float
    link: str | None = None
    refused: dict[Destination, set[int]] = field(default_factory=dict)
    #: Totals for the closing line.
    nacks: int = 0
    unconfirmed: int = 0
    connects: int = 0  # failed connects
    probes: int = 0  # probe rounds sent
    rows: set[int] = field(default_factory=set)  # seqs of the rows nacked by it
    #: Rounds without any destination recovering (the probes' backoff), and
    #: when the next probe is due (the dispatcher's clock; inf: one in flight).
    tries: int = 0
    probe_at: float = 0.0
    #: Whether its first line was logged (and the outage counted); whether
    #: the connection failed during it; the last reason logged.
    logged: bool = False
    link_seen: bool = False
    last_why: str = ""

    @property
    def over(self) -> bool:
        return self.link is None and not self.refused

    def refuse(self, dest: Destination, seq: int) -> None:
        """A nack of *dest*'s, not of its row's: the row waits on the outage."""
        self.refused.setdefault(dest, set()).add(seq)
        self.rows.add(seq)
        self.nacks += 1

    def confirmed(self, dest: Destination) -> bool:
        """*dest* stored a message: its rows need not wait any more (True: it was refusing)."""
        return self.refused.pop(dest, None) is not None

    def summary(self) -> str:
        """The counts for the closing line, those that are not 0: ``3 failed connects, 120 nacks of 40 rows,
        70 unconfirmed, 5 probes``."""
        parts = []
        if self.connects:
            parts.append(count(self.connects, "failed connect"))
        if self.nacks:
            parts.append(f"{count(self.nacks, 'nack')} of {count(len(self.rows), 'row')}")
        if self.unconfirmed:
            parts.append(f"{self.unconfirmed} unconfirmed")
        if self.probes:
            parts.append(count(self.probes, "probe"))
        return ", ".join(parts) or "no row touched"


def describe(refused: dict[Destination, set[int]]) -> str:
    """``material.published (3 slots)``: the routing keys refusing, for the log."""
    keys: dict[str, int] = {}
    for routing_key, _ in refused:
        keys[routing_key] = keys.get(routing_key, 0) + 1
    shown = [f"{key} ({count(n, 'slot')})" for key, n in sorted(keys.items())[:3]]
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return ", ".join(shown) + more


__all__ = ["PROBE_CAP_S", "PROBE_ROWS", "Destination", "Outage", "describe", "destination", "own_nacks"]
