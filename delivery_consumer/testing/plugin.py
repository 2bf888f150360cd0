"""The pytest plugin of the test kit: the ``consumer_harness`` fixture.

Loaded by the ``pytest11`` entry point of delivery-consumer (or
``pytest_plugins = ["delivery_consumer.testing.plugin"]``). Importing it
costs nothing: the harness is imported when a test asks for the fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ..model.contract import ConsumerSpec
    from . import ConsumerHarness


@pytest.fixture
def consumer_harness(tmp_path: Path) -> Iterator[Callable[..., ConsumerHarness]]:
    """Make a :class:`~delivery_consumer.testing.ConsumerHarness` of a consumer (its spec, or its
    registered name), its database in the test's ``tmp_path`` unless ``db=`` says where; the other
    keywords are run options (``max_attempts=``, ``retry_delays_ms=``...). Closed after the test."""
    from . import ConsumerHarness

    made: list[ConsumerHarness] = []

    def make(consumer: ConsumerSpec | str, *, db: str | Path | None = None, **options: Any) -> ConsumerHarness:
        name = consumer if isinstance(consumer, str) else consumer.name
        harness = ConsumerHarness(consumer, db if db is not None else tmp_path / f"{name}-{len(made)}.db", **options)
        made.append(harness)
        return harness

    yield make
    for harness in reversed(made):
        harness.close()
