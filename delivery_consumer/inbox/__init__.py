"""The consumer's inbox: its database, the one path that applies events, and the fence.

* :mod:`.database` -- open a consumer's database, check whose it is, migrate it;
* :mod:`.apply` -- the transaction of a batch: receipt check, effect, receipt,
  rejection rows, commit (:func:`apply_batch`, used by replay, run and the fence);
* :mod:`.in_flight` -- what each process is handling now (poison detection);
* :mod:`.fence` -- an effect outside the database: claim, call, complete.

The event's path through these modules: docs/architecture.md.
"""

from __future__ import annotations

from .apply import (
    CLOCK_JUMP,
    Transaction,
    UnsyncedTransaction,
    apply_batch,
    apply_event,
    has_receipt,
    receipt,
    receipt_of,
    unsynced_transaction,
)
from .counters import inbox_rowid_before
from .database import CORE_MIGRATIONS, STORE_VERSION, ConsumerDB, keep_high_water
from .in_flight import CRASHED, INTERRUPTED, OPEN_OUTCOMES, InFlight, forget_in_flight, owner_alive, process_owner

__all__ = [
    "CLOCK_JUMP",
    "CORE_MIGRATIONS",
    "CRASHED",
    "INTERRUPTED",
    "OPEN_OUTCOMES",
    "STORE_VERSION",
    "ConsumerDB",
    "InFlight",
    "Transaction",
    "UnsyncedTransaction",
    "apply_batch",
    "apply_event",
    "forget_in_flight",
    "has_receipt",
    "inbox_rowid_before",
    "keep_high_water",
    "owner_alive",
    "process_owner",
    "receipt",
    "receipt_of",
    "unsynced_transaction",
]
