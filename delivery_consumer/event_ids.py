"""Deprecated: the old import path of :mod:`delivery_consumer.model.event_ids`, kept for one release.

Its public names are exported from :mod:`delivery_consumer`.
"""

import warnings as _warnings
from typing import Any as _Any

from .model import event_ids as _new
from .model.event_ids import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.event_ids is deprecated and goes in the next release: "
    "import new_event_id from delivery_consumer "
    "(the module is now delivery_consumer.model.event_ids)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
