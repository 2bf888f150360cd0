"""The options of ``run`` and what they derive: its topology and its database."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import consumers
from ..amqp.partitions import Identity
from ..amqp.topology import DEFAULT_DELIVERY_LIMIT, DEFAULT_EXCHANGE, DEFAULT_PREFIX, DEFAULT_RETRY_DELAYS_MS, Topology
from ..inbox.database import IntegrityCheck
from ..inbox.seam import InboxDB
from ..model.envelope import MAX_BODY_BYTES
from ..model.errors import ConfigError
from ..ops.partition_databases import PENDING_KEY, pending_words
from ..store import acked
from ..store.placement import database


@dataclass
class RunConfig:
    consumer: str
    url: str
    db_path: Path | None = None
    exchange: str = DEFAULT_EXCHANGE
    prefix: str = DEFAULT_PREFIX
    prefetch: int = 500
    batch: int = 250
    batch_wait_ms: int = 10
    max_attempts: int = 3
    retry_delays_ms: tuple[int, ...] = DEFAULT_RETRY_DELAYS_MS
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT
    max_crashes: int = 3
    exit_when_idle_s: float | None = None
    max_bytes: int = MAX_BODY_BYTES
    #: How long to wait for the broker to confirm a retry / dead copy.
    confirm_timeout_s: float = 30.0
    #: Options of a consumer whose effect is outside the database (webhook:
    #: webhook_url, endpoint_idempotent, timeouts); see ConsumerSpec.external.
    consumer_options: dict[str, Any] = field(default_factory=dict)
    #: Log one line per event (JSON logs) instead of one per batch.
    log_each_event: bool = False
    #: This run serves one partition of a partitioned consumer (partitions.py).
    partition: Identity | None = None
    #: How long the database may stay unusable as a whole (disk full, I/O
    #: error...) before run exits for a supervisor to act; meanwhile it
    #: holds its deliveries and retries with backoff.
    store_outage_limit_s: float = 600.0
    #: The longest the integrity check at open may take (ConsumerDB.check_integrity); a
    #: larger file is checked whole in the background, and nothing is acked before it passed.
    integrity_check_s: float = 10.0
    #: A standby takes over from a holder proven frozen (stopped, no heartbeat)
    #: after this many seconds of silence; None: never (docs/failures.md).
    take_over_after_s: float | None = 60.0
    #: Open a database older than what was acknowledged from it (a restored
    #: backup), or a new one where receipts were acknowledged: the loss is logged.
    accept_loss: bool = False
    #: The consumer's inbox in PostgreSQL (``postgresql://...``) instead of a file: db_path is then unused.
    db_url: str | None = None

    def topology(self) -> Topology:
        return consumers.topology(
            self.consumer, self.exchange, self.prefix,
            retry_delays_ms=self.retry_delays_ms,
            delivery_limit=self.delivery_limit,
            partition=self.partition.partition if self.partition else None,
            partition_count=self.partition.count if self.partition else None,
        )

    def database_path(self) -> Path:
        """The file of the run's database (the default one when no path was given)."""
        if self.db_path is not None:
            return self.db_path
        return database(self.consumer, self.partition.partition if self.partition else None, None)

    def database_label(self) -> str:
        """The run's database for logs: its file, or its URL without the password."""
        if self.db_url is not None:
            from ..inbox.pg import redact

            return redact(self.db_url)
        return str(self.database_path())

    def open_db(self, *, made_now: bool = False, check: bool | IntegrityCheck = True) -> InboxDB:
        """The run's database, checked to be this consumer's (and partition's), not older
        than what was acknowledged from it (acked.py), and (*check*) not damaged: within
        ``integrity_check_s``, or else by the whole check in the background
        (``db.integrity``), before the first ack. *check* may be a standby's check of the
        file it watched while it waited: taken over as it is. *made_now*: the writer lock
        made the file just now (an empty file is ours)."""
        if self.db_url is not None:
            return self._open_pg(self.db_url)
        path = self.database_path()
        db = consumers.open_db(path, self.consumer, create=True, partition=self.partition,
                               unpartitioned=self.partition is None, empty_ok=made_now)
        pending = db.meta().get(PENDING_KEY)
        if pending is not None:
            db.close()
            words, option = pending_words(pending)
            raise ConfigError(f"{path}: the repartition of {self.consumer} to {words} has not finished (its queues "
                              f"are not switched yet): run delivery-consumer repartition --consumer {self.consumer} "
                              f"{option} again, then start the runs")
        log = logging.getLogger("delivery_consumer.run")
        try:
            said = acked.judge(path, db.database_id(), db.high_water(), created=db.created,
                               accept_loss=self.accept_loss)
            if db.created:  # a first start, or a --db with a typo: the operator sees where state now lives
                log.warning("%s: no database was there; created a new, empty one for %s", db.path.resolve(),
                            self.consumer)
            if said:
                log.warning("%s", said)
            if isinstance(check, IntegrityCheck):  # a standby's, of the file it was watching
                if db.guard is None or check.identity != db.guard.identity:
                    db.integrity = IntegrityCheck(db.path)  # it watched another file: check this one
                elif not check.verdict():  # still running: the first ack waits for it
                    db.integrity = check
            elif check and not db.check_integrity(self.integrity_check_s):
                db.integrity = IntegrityCheck(db.path)
                log.warning("%s: integrity check not finished within %gs: checking the whole file in the "
                            "background; nothing is acknowledged before it passed", db.path, self.integrity_check_s)
        except BaseException:
            db.close()
            raise
        return db

    def _open_pg(self, url: str) -> InboxDB:
        """The run's inbox in PostgreSQL: made or migrated, checked to be this consumer's (and
        partition's). No file guards: nothing can be copied over a database, and several runs of
        one consumer share it safely (docs/postgres-inbox.md)."""
        from ..inbox.pg import PgInboxDB

        spec = consumers.get(self.consumer)
        db = PgInboxDB.open(url, spec, create=True, partition=self.partition, unpartitioned=self.partition is None)
        pending = db.meta().get(PENDING_KEY)
        if pending is not None:
            db.close()
            raise ConfigError(f"{db.path}: a repartition of {self.consumer} has not finished")
        if db.created:
            logging.getLogger("delivery_consumer.run").warning("%s: no inbox was there; created a new, empty one "
                                                               "for %s", db.path, self.consumer)
        return db
