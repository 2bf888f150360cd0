"""Deprecated: the old import path of :mod:`delivery_consumer.model.state`, kept for one release.

Its public names are exported from :mod:`delivery_consumer`.
"""

import warnings as _warnings
from typing import Any as _Any

from .model import state as _new
from .model.state import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.state is deprecated and goes in the next release: "
    "import RevisionTable, StateOf from delivery_consumer "
    "(the module is now delivery_consumer.model.state)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
