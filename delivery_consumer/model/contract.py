"""What a consumer implements and what the store hands back: the types both sides share.

A leaf module: it imports only errors, envelope and event_types (type
checking included), so the store, the registry, the worker and the metrics
can all import it. A consumer is a :class:`ConsumerSpec`; the store applies
it and answers one :class:`Outcome` per event; ``run`` counts each broker
delivery with its :class:`DeliveryMark`. How a consumer is written: docs/adding-a-consumer.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .envelope import Envelope
from .errors import Rejection, StoreUnavailable, TransientError
from .event_types import MATERIAL, EventTypes


class Cursor(Protocol):
    """What an effect reads of a statement's cursor (sqlite3's, and the PostgreSQL wrapper's)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What an effect is handed: a ``sqlite3.Connection`` on SQLite, on PostgreSQL a small
    wrapper of the same shape (``?`` parameters, ``dialect == "postgres"``;
    ``inbox/pg.py``). An effect written with these calls and portable SQL runs on both."""

    def execute(self, sql: str, parameters: Any = (), /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Iterable[Any], /) -> Cursor: ...


def dialect(conn: Connection) -> str:
    """``sqlite`` or ``postgres``: the database behind an effect's *conn*."""
    return getattr(conn, "dialect", "sqlite")


#: A consumer's effect: receives the open connection *inside* the store's
#: transaction and the validated envelope, changes its own tables and returns
#: a result string (``updated``, ``recorded``, ...). It never commits, rolls
#: back or opens a transaction: the store owns the boundary. It raises
#: :class:`~delivery_consumer.model.errors.Rejection` for a permanent refusal and
#: :class:`~delivery_consumer.model.errors.TransientError` to ask for a retry.
ApplyFn = Callable[[Connection, Envelope], str]
#: Applies several events at once (see ``ConsumerSpec.apply_many``).
ApplyManyFn = Callable[[Connection, Sequence[Envelope]], list[str]]
#: Applies a batch whose effect lives outside the database (the fence,
#: ``inbox/fence.py``): the consumer's database (an ``inbox.ConsumerDB``: the
#: inbox imports this module, so it is not named here), the parsed deliveries
#: (a Rejection for a body that did not parse), their delivery marks and run's
#: hooks in, one Outcome per delivery out.
ExternalBatchFn = Callable[
    [Any, Sequence["Envelope | Rejection"], Sequence["DeliveryMark"], "WorkHooks"], list["Outcome"]
]
#: Given the options of ``run`` (``RunConfig.consumer_options``), checks them
#: (ConfigError) and returns the batch function.
ExternalFactory = Callable[[Mapping[str, Any]], ExternalBatchFn]


@dataclass(frozen=True)
class View:
    """How ``<consumer> list|show`` and ``trace`` read one effect table.

    Columns are SQL column names of ``table``; rows come out keyed by their
    camelCase form (``article_id`` -> ``articleId``) unless ``rename`` says
    otherwise.
    """

    table: str
    columns: Sequence[str]
    #: ``list`` order: column names (``rowid`` too), ``-`` in front for descending.
    order: Sequence[str] = ()
    #: The unique column ``show KEY`` looks up; None: no ``show``.
    key: str | None = None
    #: The columns of ``list``'s text table (default: all); ``--json`` has all.
    brief: Sequence[str] = ()
    #: Option name -> column: ``list --NAME VALUE`` keeps the rows where it equals VALUE.
    filters: Mapping[str, str] = field(default_factory=dict)
    #: Default ``--limit`` of ``list``; 0 lists every row.
    limit: int = 0
    #: The column holding the event's key (the value of its type's key field:
    #: ``articleId``, ``orderId``, ...): ``show`` of a partitioned consumer
    #: reads the key's partition, ``trace`` shows the key's row.
    key_column: str | None = None
    #: The column holding the eventId that last wrote the row: ``trace`` finds
    #: the event's row by it when the receipt holds no key.
    event: str | None = None
    #: Column -> output name, where camelCase is not the name wanted.
    rename: Mapping[str, str] = field(default_factory=dict)
    #: Column -> function applied to its stored value (``bool`` for a 0/1 flag).
    decode: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    #: What ``list`` prints when there is no row.
    empty: str = "no rows"


@dataclass(frozen=True)
class ConsumerSpec:
    """Everything the store and the broker need to know about one consumer."""

    name: str
    apply: ApplyFn
    #: Forward-only SQL scripts creating and evolving the effect tables; the
    #: store runs the ones a database has not seen yet, in order. Never edit
    #: or remove a published entry: append a new one.
    migrations: Sequence[str]
    #: Topic-exchange binding keys of the consumer's queue.
    binding_keys: Sequence[str] = ("#",)
    description: str = ""
    #: Optional: the same effect as ``apply`` for several events in one go
    #: (fewer statements). It receives events that have no receipt and
    #: distinct eventIds, in delivery order, and returns exactly the results
    #: ``apply`` would have returned called on each in turn; or it raises
    #: (any error, at any point, even after writing): the store then rolls
    #: the transaction back and applies the batch event by event.
    apply_many: ApplyManyFn | None = None
    #: Effect tables of the consumer (``trace`` shows their rows with an
    #: ``event_id`` column; ``repartition`` moves them by ``article_id``).
    tables: Sequence[str] = field(default_factory=tuple)
    #: For an effect outside the database (an HTTP call, see
    #: ``consumers/webhook.py``): ``run`` applies its batches with this instead
    #: of ``apply`` (the fence protocol, ``inbox/fence.py``). None for effects
    #: that live inside the store's transaction.
    external: ExternalFactory | None = None
    #: The view of ``<name> list|show`` and of ``trace``; None: no such commands.
    view: View | None = None
    #: The event types the consumer handles (a type not declared here is
    #: ``unknown-type``); the material types unless told otherwise.
    event_types: EventTypes = MATERIAL
    #: Run on the database's connection once it is migrated, at every open: each
    #: raises ConfigError for tables the consumer cannot work with, so that a
    #: wrong table stops the start-up rather than the first event
    #: (``state.RevisionTable.check``).
    checks: Sequence[Callable[[Connection], None]] = ()
    #: Optional: the migrations of the effect tables on PostgreSQL, when the SQLite ones
    #: (``migrations``, translated: ``inbox/pg.py``'s ``portable_ddl``) do not fit.
    postgres_migrations: Sequence[str] | None = None
    #: Optional: the effect on PostgreSQL, when ``apply`` (and ``apply_many``) are
    #: SQLite's own; an ``apply_many`` is then not used there.
    postgres_apply: ApplyFn | None = None


@dataclass(slots=True)
class Outcome:
    """What happened to one event in a transaction."""

    event_id: str | None
    result: str | None = None
    rejection: Rejection | None = None
    transient: TransientError | None = None

    @property
    def status(self) -> str:
        """The result, the rejection code, or ``transient:<code>``."""
        if self.result is not None:
            return self.result
        if self.rejection is not None:
            return self.rejection.code
        assert self.transient is not None
        return f"transient:{self.transient.code}"


@dataclass(frozen=True, slots=True)
class DeliveryCount:
    """Durable counters of one message key after a delivery was recorded."""

    deliveries: int
    attempts: int
    crashes: int


class DeliveryRecorder(Protocol):
    """What counts a broker delivery: the store's write transaction (``inbox.Transaction``)."""

    def record_delivery(self, key: str, event_id: str | None, *, redelivered: bool, attempt: int, outcome: str,
                        count: bool = True, delivered_hint: int = 0) -> DeliveryCount:
        """Count one delivery of *key* with its *outcome*; its counters after."""
        ...


@dataclass(frozen=True, slots=True)
class DeliveryMark:
    """What :meth:`Transaction.record_delivery` needs to count one broker
    delivery, read from the delivery before its batch is applied."""

    key: str
    redelivered: bool
    attempt: int
    #: False when the delivery was already counted (run's isolated redeliveries).
    count: bool = True
    delivered_hint: int = 0

    def record(self, tx: DeliveryRecorder, event_id: str | None, outcome: str) -> DeliveryCount:
        """Count the delivery in *tx* with its *outcome*."""
        return tx.record_delivery(
            self.key, event_id, redelivered=self.redelivered, attempt=self.attempt, outcome=outcome,
            count=self.count, delivered_hint=self.delivered_hint,
        )


def _give_up(exc: StoreUnavailable) -> None:
    raise exc


@dataclass(frozen=True, slots=True)
class WorkHooks:
    """What ``run`` lends an effect applied in several transactions (the fence)."""

    #: Where to note the delivery being called (None: not noted): an
    #: ``inbox.InFlight``, which this module cannot name (the inbox imports it).
    in_flight: Any = None
    #: True once the process is stopping for good: start no more calls.
    abandoned: Callable[[], bool] = lambda: False
    #: Given a failure of the database as a whole, returns when it is worth
    #: trying again, or raises (the default: at once).
    wait_for_store: Callable[[StoreUnavailable], None] = _give_up


__all__ = [
    "ApplyFn",
    "ApplyManyFn",
    "Connection",
    "ConsumerSpec",
    "Cursor",
    "DeliveryCount",
    "DeliveryMark",
    "DeliveryRecorder",
    "ExternalBatchFn",
    "ExternalFactory",
    "Outcome",
    "View",
    "WorkHooks",
    "dialect",
]
