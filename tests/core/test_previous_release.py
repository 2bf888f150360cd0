"""The previous release's databases and events keep their meaning under the declared event types.

The previous release's package is taken from git (``git archive`` of the
commit before the event types were declared) into a temporary directory and
run from there in subprocesses: it builds the databases and computes the
fingerprints; this checkout opens, migrates and answers them.
"""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orders_consumer  # registers the orders consumer in this process too
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import REPO, SAMPLES, json_lines, read_rows, subprocess_env

from delivery_consumer.consumers import open_db
from delivery_consumer.inbox.database import STORE_VERSION
from delivery_consumer.model import envelope
from delivery_consumer.model.cloudevents import parse_message
from delivery_consumer.model.errors import Rejection
from delivery_consumer.ops.replay import replay
from delivery_consumer.ops.sources import expand, read

#: The last commit of the release before declared event types.
PREVIOUS = "00f3786589c65cd93bf6bd87e7eecab306d53d84"
#: Tables whose every row must survive the migration.
TABLES = {"catalog": ("inbox", "rejected", "deliveries", "catalog"), "audit": ("inbox", "rejected", "deliveries")}


def extracted(commit: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package and schema of *commit*, extracted from git (skips outside a checkout holding it)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "delivery_consumer", "schemas"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"not a git checkout holding {commit[:12]}: {archive.stderr.decode().strip()}")
    root = tmp_path_factory.mktemp(commit[:12])
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    return root


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's package and schema, extracted from git."""
    return extracted(PREVIOUS, tmp_path_factory)


def _old(previous: Path, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "delivery_consumer", *args], input=input, capture_output=True,
                          env=subprocess_env(PYTHONPATH=str(previous)), cwd=previous, timeout=120)


def _replay_samples(db: Any) -> list[tuple[str, str]]:
    return [(item.location, outcome.status) for item, outcome in
            replay(db, read(expand([str(SAMPLES), str(SAMPLES / "invalid")])))]


@pytest.mark.parametrize("consumer", ["catalog", "audit"])
@pytest.mark.parametrize("batch", ["1", "100"])
def test_a_previous_release_database_opens_migrates_and_answers_duplicate(
    previous: Path, tmp_path: Path, consumer: str, batch: str
) -> None:
    """A database the previous release filled opens here with every row kept, and its events are duplicates."""
    db_path = tmp_path / "inbox.db"
    made = _old(previous, "replay", "--consumer", consumer, "--db", str(db_path), "--batch", batch, "--json",
                str(SAMPLES), str(SAMPLES / "invalid"))
    assert made.returncode == 1, made.stderr  # the samples include rejections, on purpose
    first = json_lines(made.stdout.decode())
    assert read_rows(db_path, "inbox")  # the old code really wrote receipts
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
        before = {table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall() for table in TABLES[consumer]}
    conn.close()

    with open_db(db_path, consumer) as db:
        assert db.conn.execute("PRAGMA user_version").fetchone()[0] == STORE_VERSION
        after = {table: db.conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
                 for table in TABLES[consumer]}
        again = _replay_samples(db)

    inbox_before, inbox_after = before.pop("inbox"), after.pop("inbox")
    assert [(*row, None, None) for row in inbox_before] == inbox_after  # the new meta and origin columns, NULL
    rejected_before, rejected_after = before.pop("rejected"), after.pop("rejected")
    assert [(*row, None, None) for row in rejected_before] == rejected_after  # the new origin and key columns
    assert before == after
    assert len(again) == len(first)
    for (source, status), old in zip(again, first, strict=True):
        if "rejected" in old:  # the same refusal again (no receipt was written for it)
            assert status == old["rejected"], (source, old, status)
        else:
            assert status == "duplicate:" + old["result"].removeprefix("duplicate:"), (source, old, status)


@pytest.fixture(scope="module")
def old_fingerprints(previous: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The previous release's parse, as a process answering one line per NDJSON line."""
    script = (
        "import sys\n"
        "from delivery_consumer.envelope import parse\n"
        "from delivery_consumer.errors import Rejection\n"
        "for line in sys.stdin.buffer:\n"
        "    try:\n"
        "        out = 'ok ' + parse(line.rstrip(b'\\n')).fingerprint\n"
        "    except Rejection as rej:\n"
        "        out = 'rejected ' + rej.code + ' ' + rej.reason\n"
        "    sys.stdout.write(out + '\\n')\n"
        "    sys.stdout.flush()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=subprocess_env(PYTHONPATH=str(previous)), cwd=previous)
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def _ask(proc: subprocess.Popen[bytes], body: bytes) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(body + b"\n")
    proc.stdin.flush()
    return proc.stdout.readline().decode().rstrip("\n")


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_TYPES = ["material.published", "material.withdrawn", "material.deleted", 3]


@st.composite
def material_envelopes(draw: st.DrawFn) -> dict[str, Any]:
    env: dict[str, Any] = {
        "eventId": draw(st.uuids().map(str) | st.sampled_from(["not-a-uuid", "0B1E9C1E-4A53-4F0E-9D2A-6F1F3F7B2C11"])),
        "type": draw(st.sampled_from(_TYPES)),
        "articleId": draw(_TEXT | st.sampled_from(["article-42", "a\nb", ""])),
        "revision": draw(st.integers(-1, 2**64 - 1) | st.sampled_from([1.0, "2", True])),
        "occurredAt": draw(st.sampled_from(["2026-11-29T10:00:00Z", "2026-11-29T13:00:00.5+03:00",
                                            "2026-02-30T10:00:00Z", "yesterday"])),
        "data": draw(st.fixed_dictionaries({"title": _TEXT, "url": _TEXT},
                                           optional={"lang": _TEXT, "tags": st.lists(_TEXT, max_size=2)})),
    }
    for key in draw(st.sets(st.sampled_from(sorted(env)), max_size=1)):
        del env[key]
    if draw(st.integers(0, 9)) == 0:
        env["revison"] = 1
    return env


@settings(max_examples=400, deadline=None)
@given(material_envelopes(), st.booleans())
def test_material_fingerprints_and_refusals_are_those_of_the_previous_release(
    old_fingerprints: subprocess.Popen[bytes], env: dict[str, Any], indent: bool
) -> None:
    """For any material envelope, valid or not: the same fingerprint, or the same refusal with the same reason."""
    body = orjson.dumps(env, option=orjson.OPT_INDENT_2 if indent else 0).replace(b"\n", b" ")
    old = _ask(old_fingerprints, body)
    try:
        new = "ok " + envelope.parse(body).fingerprint
    except Rejection as rej:
        new = f"rejected {rej.code} {rej.reason}"
    assert new == old


#: The last commit before a CloudEvent's time was mapped to one spelling (it kept a string verbatim).
BEFORE_ONE_TIME = "8ca718f9c2aec0f01d0398ac1380d7d943c27db2"


@pytest.fixture(scope="module")
def before_one_time(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as it was before, extracted from git."""
    return extracted(BEFORE_ONE_TIME, tmp_path_factory)


def _cloudevent_messages() -> list[tuple[bytes, str, dict[str, Any]]]:
    """One order event as producers send it: structured with its time in several spellings, binary with the
    AMQP binding's milliseconds, the RabbitMQ binding's text headers and an AMQP 0-9-1 timestamp."""
    data = {"status": "placed", "totalCents": 10}
    out = []
    for time in ("2026-12-02T10:00:00.123000Z", "2026-12-02T11:00:00.123+01:00", "2026-12-02T10:00:00Z",
                 "2026-12-02t10:00:00.1234567z"):
        event = {"specversion": "1.0", "id": "order-1-r1", "source": "/shop", "type": "order.placed",
                 "subject": "order-1", "revision": 1, "time": time, "data": data}
        out.append((orjson.dumps(event), "application/cloudevents+json", {}))
    attributes = {"specversion": "1.0", "id": "order-1-r1", "source": "/shop", "type": "order.placed",
                  "subject": "order-1", "revision": 1}
    out.append((orjson.dumps(data), "application/json",
                {f"cloudEvents_{k}": v for k, v in {**attributes, "time": 1796205600123}.items()}))
    out.append((orjson.dumps(data), "application/json",
                {f"ce-{k}": str(v) for k, v in {**attributes, "time": "2026-12-02T10:00:00.123000Z"}.items()}))
    return out


def test_a_cloudevent_received_before_the_upgrade_is_a_duplicate_after_it(before_one_time: Path,
                                                                         tmp_path: Path) -> None:
    """Each message of a CloudEvent, parsed by the release that kept time verbatim, had a fingerprint its receipt
    holds: the same message parsed now answers that receipt (its fingerprint, or the previous release's that it
    carries); and a database that release filled from a file of structured CloudEvents answers each again
    duplicate, not event-id-reused."""
    script = (
        "import sys, orjson\n"
        "import orders_consumer\n"
        "from delivery_consumer.cloudevents import parse_message\n"
        "for body, content_type, headers in orjson.loads(sys.stdin.buffer.read()):\n"
        "    env = parse_message(body.encode(), content_type=content_type, headers=headers,"
        " types=orders_consumer.TYPES)\n"
        "    print(env.fingerprint)\n"
    )
    messages = _cloudevent_messages()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                          input=orjson.dumps([(b.decode(), c, h) for b, c, h in messages]),
                          env=subprocess_env(PYTHONPATH=f"{before_one_time}{os.pathsep}{REPO / 'tests'}"))
    assert done.returncode == 0, done.stderr.decode()
    old = done.stdout.decode().split()
    assert len(set(old)) > 1  # the previous release gave one event several fingerprints
    now = [parse_message(body, content_type=content_type, headers=headers, types=orders_consumer.TYPES)
           for body, content_type, headers in messages]
    for (body, _, _), fingerprint, env in zip(messages, old, now, strict=True):
        assert fingerprint in (env.fingerprint, *env.earlier_fingerprints), body
    assert len({env.fingerprint for env in now if env.occurred_at.endswith(".123Z")}) == 1  # one spelling now

    structured = tmp_path / "events.ndjson"
    structured.write_bytes(b"".join(body.replace(b"order-1", f"order-x{i}".encode()) + b"\n"
                                    for i, (body, content_type, _) in enumerate(messages)
                                    if content_type == "application/cloudevents+json"))
    db_path = tmp_path / "orders.db"
    made = subprocess.run([sys.executable, "-m", "delivery_consumer", "replay", "--consumer", "orders", "--db",
                           str(db_path), "--json", str(structured)], capture_output=True, timeout=120,
                          cwd=before_one_time, env=subprocess_env(
                              PYTHONPATH=f"{before_one_time}{os.pathsep}{REPO / 'tests'}",
                              DELIVERY_PLUGINS="orders_consumer"))
    assert made.returncode == 0, made.stderr.decode()
    assert {"updated"} == {line["result"] for line in json_lines(made.stdout.decode())}
    with open_db(db_path, "orders") as db:
        again = [outcome.status for _, outcome in replay(db, read([str(structured)]))]
    assert ["duplicate:updated"] * 4 == again
