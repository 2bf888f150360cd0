"""Deprecated: the old import path of :mod:`delivery_consumer.model.typed`, kept for one release.

Its public names are exported from :mod:`delivery_consumer`.
"""

import warnings as _warnings
from typing import Any as _Any

from .model import typed as _new
from .model.typed import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.typed is deprecated and goes in the next release: "
    "import Consumer, Event, event_type, make_envelope from delivery_consumer "
    "(the module is now delivery_consumer.model.typed)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
