"""Outcomes per minute from the receipts' times, and their chart as inline SVG.

The minutes come from the receipt counters the writers keep per minute
(:mod:`inbox.counters`) and the ``rejected_at`` index, over a bounded window.
Minutes that can no longer change are kept in memory (:class:`MinuteCache`),
so a page load reads only the last few minutes, not the whole window again.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from html import escape
from typing import Any

from ..inbox import ConsumerDB, reports
from ..store.sqlite import now_iso

#: Outcome categories, in drawing order, with their colour.
CATEGORIES: dict[str, str] = {"applied": "#2e7d32", "duplicate": "#90a4ae", "stale": "#f9a825",
                              "rejected": "#c62828"}
#: A minute this far in the past no longer gets receipts (stamped at commit).
SETTLE_S = 120

Minutes = dict[str, Counter[str]]


def category(result: str) -> str:
    if result.startswith("duplicate"):
        return "duplicate"
    if result == "stale":
        return "stale"
    return "applied"


def read_minutes(db: ConsumerDB, since: str, until: str | None = None) -> Minutes:
    """``{"YYYY-MM-DDTHH:MM": Counter(category -> n)}`` of receipts and rejections in [since, until).

    *since* and *until* are minutes (``YYYY-MM-DDTHH:MM``): the receipts come
    from the per-minute counters (inbox/counters.py; on PostgreSQL the receipts' index).
    """
    out: Minutes = {}
    receipts, rejections = reports.outcomes_per_minute(db, since, until)
    for minute, result, n in receipts:
        out.setdefault(minute, Counter())[category(result)] += n
    for minute, n in rejections:
        out.setdefault(minute, Counter())["rejected"] += n
    return out


class MinuteCache:
    """Settled minutes per database, so each page load reads only the recent ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settled: dict[str, tuple[str, Minutes]] = {}  # path -> (settled up to, minutes)

    def minutes(self, db: ConsumerDB, window_s: float, now: float | None = None) -> Minutes:
        """The counts per minute of the last *window_s* seconds."""
        now = time.time() if now is None else now
        start = now_iso(now - window_s)[:16]
        settled_until = now_iso(now - SETTLE_S)[:16]
        key = str(db.path)
        with self._lock:
            upto, kept = self._settled.get(key, (start, {}))
        upto = max(upto, start)
        if upto < settled_until:
            kept = {**kept, **read_minutes(db, upto, settled_until)}
            upto = settled_until
        kept = {m: c for m, c in kept.items() if m >= start}
        with self._lock:
            self._settled[key] = (upto, kept)
        return {**kept, **read_minutes(db, upto)}


def svg(minutes: Minutes, window_s: float, now: float | None = None, *, width: int = 720,
        height: int = 140) -> str:
    """Stacked bars, one per minute of the last *window_s* seconds, newest on the right."""
    now = time.time() if now is None else now
    count = max(1, int(window_s // 60))
    first = int(now // 60) - count + 1
    labels = [now_iso((first + i) * 60)[:16] for i in range(count)]
    peak = max((sum(minutes.get(m, Counter()).values()) for m in labels), default=0) or 1
    bar = width / count
    plot = height - 18
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="outcomes per minute">',
             f'<rect x="0" y="0" width="{width}" height="{plot}" fill="#fafafa" stroke="#ddd"/>']
    for i, minute in enumerate(labels):
        counts = minutes.get(minute)
        x = i * bar
        if minute.endswith(":00"):
            parts.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{plot}" stroke="#e0e0e0"/>'
                         f'<text x="{x + 2:.1f}" y="{height - 4}" font-size="10" fill="#555">'
                         f'{escape(minute[11:])}</text>')
        if not counts:
            continue
        y = float(plot)
        tip = escape(f"{minute}Z: " + ", ".join(f"{n} {c}" for c, n in counts.items()))
        for name, colour in CATEGORIES.items():
            n = counts.get(name, 0)
            if not n:
                continue
            h = max(1.0, n / peak * (plot - 4))
            y -= h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar - 0.5, 0.5):.1f}" height="{h:.1f}" '
                         f'fill="{colour}"><title>{tip}</title></rect>')
    # a halo in the background colour keeps the label readable over the newest bars
    parts.append(f'<text x="{width - 4}" y="12" font-size="10" text-anchor="end" fill="#555" stroke="#fafafa" '
                 f'stroke-width="3" paint-order="stroke">peak {peak}/min</text></svg>')
    return "".join(parts)


def legend() -> str:
    return " ".join(f'<span class="key" style="background:{c}"></span>{escape(n)}' for n, c in CATEGORIES.items())


def totals(minutes: Minutes) -> dict[str, Any]:
    total: Counter[str] = Counter()
    for counts in minutes.values():
        total.update(counts)
    return dict(total)
