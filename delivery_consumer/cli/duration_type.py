"""The click type of every duration option, so that each one accepts the same
spellings (:mod:`delivery_consumer.model.durations`) and refuses the rest with the
same message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..model.durations import format, parse

if TYPE_CHECKING:
    _ParamType = click.ParamType[Any]
else:  # click < 8.4: not generic
    _ParamType = click.ParamType


class Duration(_ParamType):
    """A click option type for durations (the grammar: :mod:`delivery_consumer.model.durations`).

    The value is seconds as a float, or whole milliseconds with
    ``milliseconds=True``; ``many=True`` reads a comma-separated list into a
    tuple. ``minimum`` / ``maximum`` bound each value in seconds;
    ``positive`` refuses zero.
    """

    name = "duration"

    def __init__(self, *, minimum: float = 0.0, maximum: float | None = None, positive: bool = False,
                 many: bool = False, milliseconds: bool = False) -> None:
        self.minimum, self.maximum, self.positive = minimum, maximum, positive
        self.many, self.milliseconds = many, milliseconds

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if self.many:
            if isinstance(value, tuple):
                return value
            parts = [part for part in str(value).split(",") if part.strip()]
            if not parts:
                self.fail("give at least one duration, e.g. 1s,10s,60s", param, ctx)
            return tuple(self._one(part, param, ctx) for part in parts)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value  # already converted (a default given as a number)
        return self._one(str(value), param, ctx)

    def _one(self, text: str, param: click.Parameter | None, ctx: click.Context | None) -> float | int:
        try:
            seconds = parse(text)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        too_small = seconds <= 0 if self.positive else seconds < self.minimum
        if too_small or (self.maximum is not None and seconds > self.maximum):
            self.fail(f"{text.strip()} is out of range: {self._range()}", param, ctx)
        if self.milliseconds:
            return round(seconds * 1000)
        return seconds

    def _range(self) -> str:
        low = "more than 0s" if self.positive else f"at least {format(self.minimum)}"
        return low if self.maximum is None else f"{low} and at most {format(self.maximum)}"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "DURATIONS" if self.many else "DURATION"

    def __repr__(self) -> str:
        return "DURATION"


__all__ = ["Duration"]
