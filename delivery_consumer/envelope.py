"""Deprecated: the old import path of :mod:`delivery_consumer.model.envelope`, kept for one release.

Its public names are exported from :mod:`delivery_consumer`.
"""

import warnings as _warnings
from typing import Any as _Any

from .model import envelope as _new
from .model.envelope import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.envelope is deprecated and goes in the next release: "
    "import Envelope from delivery_consumer "
    "(the module is now delivery_consumer.model.envelope)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
