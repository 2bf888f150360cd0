"""Counts in words: ``1 dead letter``, ``2 dead letters`` -- one helper for every line that prints one."""

from __future__ import annotations


def count(n: int, singular: str, plural: str | None = None) -> str:
    """*n* and the noun, singular for exactly one (``plural`` defaults to *singular* + "s")."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


__all__ = ["count"]
