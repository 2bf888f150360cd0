"""Deprecated: the old import path of :mod:`delivery_consumer.model.contract`, kept for one release.

Its public names are exported from :mod:`delivery_consumer`.
"""

import warnings as _warnings
from typing import Any as _Any

from .model import contract as _new
from .model.contract import *  # noqa: F403

_warnings.warn(
    "delivery_consumer.contract is deprecated and goes in the next release: "
    "import ConsumerSpec, View, ApplyFn, ApplyManyFn from delivery_consumer "
    "(the module is now delivery_consumer.model.contract)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> _Any:
    return getattr(_new, name)
