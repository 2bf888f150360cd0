"""Deprecated: the old import path of :mod:`delivery_consumer.outbox.demo_producer`, kept for one release.

It is an internal module now: outbox.producer.
"""

import warnings as _warnings
from typing import Any as _Any

from .outbox import demo_producer as _new
from .outbox.demo_producer import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.producer is deprecated and goes in the next release: "
    "import it from delivery_consumer.outbox.demo_producer",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
