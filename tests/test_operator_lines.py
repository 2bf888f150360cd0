"""What the operator's commands say, checked without a broker: the oldest
pending outbox row (quarantined rows aside), rejections resolved by hand,
counts written with the right plural, ``outbox list`` in the order its help
gives."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import orjson
from deploykit import write_deployment
from support import cli


def with_config(config: Path, *args: str) -> tuple[int, str, str]:
    result = cli(["--config", str(config), *args])
    return result.exit_code, result.stdout, result.stderr


def _produce(config: Path, article: str) -> str:
    code, out, err = with_config(config, "produce", "--article", article, "--title", "T", "--url", "https://x/1",
                                 "--json")
    assert 0 == code, err
    return str(orjson.loads(out)["eventId"])


def test_a_quarantined_row_is_not_the_oldest_pending_one(tmp_path: Path) -> None:
    """An old quarantined row beside a fresh pending one: status names the quarantined row as such and does
    not ask whether dispatch runs; the stats and the metric give the pending row's age, not the quarantined one's."""
    from prometheus_client import generate_latest

    from delivery_consumer.outbox.metrics import registry

    config = write_deployment(tmp_path, consumers=("catalog",), extra='[status]\noutbox_max_age = "1h"')
    old = _produce(config, "a-1")
    _produce(config, "a-2")
    with sqlite3.connect(tmp_path / "producer.db") as conn:
        conn.execute("UPDATE outbox SET status = 'quarantined', quarantined_at = '2026-01-01T08:00:00.000Z',"
                     " created_at = '2026-01-01T07:00:00.000Z', quarantine_reason = 'returned: unroutable'"
                     " WHERE event_id = ?", (old,))
    code, out, _err = with_config(config, "status", "--offline", "--json")
    shown = orjson.loads(out)
    assert 1 == code and ["producer material: 1 quarantined outbox row"] == shown["problems"]
    producer = shown["producers"][0]
    assert producer["oldestPendingAgeSeconds"] < 3600 and producer["oldestQuarantinedAt"].startswith("2026-01-01T08")
    page = generate_latest(registry(tmp_path / "producer.db")).decode()
    age = re.search(r"^outbox_oldest_pending_age_seconds (\S+)$", page, re.M)
    assert age is not None and float(age.group(1)) < 3600, page
    assert "outbox_oldest_unpublished_age_seconds" not in page
