"""Deprecated: the old import path of :mod:`delivery_consumer.model.cloudevents`, kept for one release.

It is an internal module now: model.cloudevents.
"""

import warnings as _warnings
from typing import Any as _Any

from .model import cloudevents as _new
from .model.cloudevents import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.cloudevents is deprecated and goes in the next release: "
    "import it from delivery_consumer.model.cloudevents",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
