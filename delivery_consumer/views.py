"""Deprecated: the old import path of :mod:`delivery_consumer.inbox.views`, kept for one release.

It is an internal module now: inbox.views.
"""

import warnings as _warnings
from typing import Any as _Any

from .inbox import views as _new
from .inbox.views import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.views is deprecated and goes in the next release: "
    "import it from delivery_consumer.inbox.views",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
