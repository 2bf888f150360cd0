"""Deprecated: the old import path of :mod:`delivery_consumer.store.sqlite`, kept for one release.

It is an internal module now: store.sqlite.
"""

import warnings as _warnings
from typing import Any as _Any

from .store import sqlite as _new
from .store.sqlite import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.sqlite is deprecated and goes in the next release: "
    "import it from delivery_consumer.store.sqlite",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
