"""One grammar for every duration a user types: ``250ms``, ``45s``, ``90m``,
``12h``, ``30d``, ``2w``, or a bare number of seconds (``2``, ``0.5``).

:func:`parse` and :func:`format` are exact inverses for every value
:func:`parse` returns. The command line's option type over them is
:class:`delivery_consumer.cli.duration_type.Duration` (no click here: a library
that embeds the outbox does not load it).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Final

#: Unit -> its length in milliseconds (integers: the arithmetic stays exact).
UNITS_MS: Final = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
#: Units :func:`format` writes, largest first (weeks are read, days written:
#: ``7d`` is what operators say).
_WRITTEN: Final = ("d", "h", "m", "s", "ms")
#: Below this many seconds every whole number of milliseconds is a float.
_EXACT_MS: Final = 2**53 / 1000
_GRAMMAR = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*(ms|s|m|h|d|w)?\s*")


def error_message(text: str) -> str:
    """The one message for a duration that does not parse."""
    shown = text if len(text) <= 40 else text[:40] + "..."
    return (f"{shown!r} is not a duration: give a number and a unit (ms, s, m, h, d, w), "
            "e.g. 250ms, 45s, 90m, 12h, 30d, 2w; a bare number means seconds")


def parse(text: str) -> float:
    """A duration -> seconds (a float >= 0); ValueError with :func:`error_message`."""
    match = _GRAMMAR.fullmatch(text.lower())
    if match is None:
        raise ValueError(error_message(text))
    number, unit = match.groups()
    if unit in (None, "s"):
        seconds = float(number)
    else:
        # The number times the unit's integral milliseconds, divided once: for
        # a whole number of a unit this is the float nearest the true value.
        seconds = float(number) * UNITS_MS[unit] / 1000
    if not math.isfinite(seconds):
        raise ValueError(error_message(text))
    return seconds


def format(seconds: float) -> str:
    """Seconds -> the shortest exact spelling: ``7d``, ``90m``, ``250ms``,
    ``0.0001s``; ``parse(format(x)) == x`` for every finite ``x >= 0``."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"not a duration: {seconds!r}")
    ms = round(seconds * 1000) if seconds < _EXACT_MS else None
    if ms is not None and ms / 1000 == seconds:
        for unit in _WRITTEN:
            size = UNITS_MS[unit]
            if ms % size == 0:
                return f"{ms // size}{unit}" if ms else "0s"
    # Not a whole number of milliseconds: the float's shortest exact decimal.
    return f"{Decimal(repr(float(seconds))):f}s"


def age(seconds: float | None) -> str:
    """An elapsed time for a person: two units at most (``6m 16s``, ``3h 5m``), ``-`` for None."""
    if seconds is None:
        return "-"
    whole = max(0, int(seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if whole >= size:
            return f"{whole // size}{unit} {whole % size // sub_size}{sub}"
    return f"{whole}s"


__all__ = ["UNITS_MS", "age", "error_message", "format", "parse"]
