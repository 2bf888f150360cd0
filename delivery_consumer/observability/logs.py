"""Log set-up for the long-running commands: text or one JSON object per line.

Never payloads or secrets: the code only logs eventIds, outcomes, codes,
short safe reasons, delivery tags and queue names, and the broker URL is
logged without its password (amqp.connection.redact).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

from ..model.errors import safe_reason

#: Attributes a log call may pass with ``extra=`` that JSON lines carry.
FIELDS = ("consumer", "eventId", "ceId", "ceSource", "key", "outcome", "deliveryTag", "code", "reason", "queue",
          "attempts", "batch")


def cloudevent_text(origin: tuple[str, str] | None) -> str:
    """`` (CloudEvent ID from SOURCE)`` after an eventId in a text line, or '' for an envelope."""
    if origin is None:
        return ""
    source, event_id = origin
    return f" (CloudEvent {safe_reason(event_id, 80)} from {safe_reason(source, 120)})"


def cloudevent_fields(origin: tuple[str, str] | None) -> dict[str, str]:
    """The JSON line's ``ceId`` and ``ceSource`` of a CloudEvent (none for an envelope)."""
    return {} if origin is None else {"ceSource": origin[0], "ceId": origin[1]}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message and FIELDS."""

    def __init__(self, consumer: str | None = None) -> None:
        super().__init__()
        self.consumer = consumer

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "consumer": self.consumer,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                obj[name] = value
        if record.exc_info:
            obj["error"] = self.formatException(record.exc_info).splitlines()[-1]
        return orjson.dumps(obj, default=str).decode("utf-8")


def setup(level: str = "info", fmt: str = "text", consumer: str | None = None) -> None:
    """Configure the root logger for a command (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(consumer))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("pika").setLevel(logging.CRITICAL)  # its errors are reported by amqp.connection.classify


def quiet_pika() -> None:
    """Silence pika's own logger (its connection steps at INFO, a passive declare's 404 at
    WARNING, tracebacks before the toolkit's one line), unless the program set its level:
    the toolkit reports what pika does in its own words (``amqp.connection.classify``)."""
    pika = logging.getLogger("pika")
    if pika.level == logging.NOTSET:
        pika.setLevel(logging.CRITICAL)
