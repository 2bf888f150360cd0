"""Deprecated: the old import path of :mod:`delivery_consumer.model.faults`, kept for one release.

It is an internal module now: model.faults.
"""

import warnings as _warnings
from typing import Any as _Any

from .model import faults as _new
from .model.faults import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.faults is deprecated and goes in the next release: "
    "import it from delivery_consumer.model.faults",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
