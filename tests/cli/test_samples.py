"""sample_events/ gives exactly the results its README documents.

The expectations are read from the tables of ``sample_events/README.md``, so
the documentation and the behaviour cannot drift apart.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
from support import EVENT_ID, SAMPLES, cli, console_script, json_lines, read_rows, subprocess_env

from delivery_consumer.model import envelope
from delivery_consumer.model.errors import REJECTION_CODES

README = SAMPLES / "README.md"
INVALID = SAMPLES / "invalid"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _status(cell: str) -> str:
    """'`updated`' -> 'updated'; 'rejected `event-id-reused`' -> 'event-id-reused'."""
    match = re.fullmatch(r"(?:rejected )?`([^`]+)`", cell)
    assert match, f"unexpected cell in {README}: {cell!r}"
    return match.group(1)


@cache
def readme_tables() -> dict[str, list[list[str]]]:
    """The rows of each table of the README, by the heading above it."""
    tables: dict[str, list[list[str]]] = {}
    heading = ""
    for line in README.read_text("utf-8").splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
        elif line.startswith("| ") and not line.startswith("|---"):
            tables.setdefault(heading, []).append(_cells(line))
    return {name: table[1:] for name, table in tables.items()}  # without the header row


def documented_sequence() -> list[tuple[str, str, str]]:
    """(source, catalog status, audit status) for each event of the main folder, in replay order."""
    return [(row[0].strip("`"), _status(row[1]), _status(row[2])) for row in readme_tables()["The sequence"]]


def documented_invalid() -> list[tuple[str, str]]:
    """(source, code) for each file of invalid/."""
    table = next(rows for name, rows in readme_tables().items() if name.startswith("`invalid/`"))
    return [(row[0].strip("`"), _status(row[1])) for row in table]


def replay_locations(folder: Path) -> list[str]:
    """Where each event of *folder* comes from, relative to sample_events/, in replay order."""
    locations = []
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".json", ".ndjson")):
        name = str(path.relative_to(SAMPLES))
        if path.suffix == ".ndjson":
            count = sum(1 for line in path.read_bytes().splitlines() if line.strip())
            locations += [f"{name}:{n}" for n in range(1, count + 1)]
        else:
            locations.append(name)
    return locations


def statuses(stdout: str) -> list[str]:
    return [line.get("result", line.get("rejected")) for line in json_lines(stdout)]


def test_readme_documents_every_sample_in_replay_order() -> None:
    """The README's tables list exactly the sample files (and NDJSON lines), in the order replay reads them."""
    assert replay_locations(SAMPLES) == [source for source, _, _ in documented_sequence()]
    assert replay_locations(INVALID) == [source for source, _ in documented_invalid()]


def test_the_redelivery_is_the_same_envelope_with_keys_reordered() -> None:
    """02 is 01 with its keys in another order: other bytes, same fingerprint; 05 reuses 01's eventId."""
    first = (SAMPLES / "01_published_r1.json").read_bytes()
    again = (SAMPLES / "02_redelivery_same_body.json").read_bytes()
    reused = envelope.parse((SAMPLES / "05_event_id_reused.json").read_bytes())

    assert first != again
    assert envelope.parse(first).fingerprint == envelope.parse(again).fingerprint
    assert EVENT_ID == envelope.parse(first).event_id == reused.event_id
    assert envelope.parse(first).fingerprint != reused.fingerprint


@pytest.mark.parametrize("batch", ["1", "100"])
@pytest.mark.parametrize("consumer", ["catalog", "audit"])
def test_samples_give_the_documented_results(tmp_path: Path, consumer: str, batch: str) -> None:
    """Replaying sample_events/ gives the README's result for every event, at --batch 1 and 100."""
    column = 1 if consumer == "catalog" else 2
    expected = [row[column] for row in documented_sequence()]

    result = cli(["replay", "--consumer", consumer, "--db", str(tmp_path / "db"), "--batch", batch, "--json",
                  str(SAMPLES)])

    assert 1 == result.exit_code
    assert expected == statuses(result.stdout)
    assert [str(SAMPLES / row[0]) for row in documented_sequence() if row[column] in REJECTION_CODES] == [
        line["source"] for line in json_lines(result.stdout) if "rejected" in line
    ]


def test_catalog_afterwards_is_as_documented(tmp_path: Path) -> None:
    """After the replay the catalog holds exactly the README's rows, and the summary line is the documented one."""
    db = tmp_path / "catalog.db"
    result = cli(["replay", "--consumer", "catalog", "--db", str(db), str(SAMPLES)])
    expected = [
        (article.strip("`"), int(revision), title, url, int(published))
        for article, revision, title, url, published in readme_tables()["The catalog afterwards"]
    ]
    summary = re.search(r"Summary line of the catalog replay:\n`([^`]+)`", README.read_text("utf-8"))

    assert expected == read_rows(db, "catalog", "article_id, revision, title, url, published")
    assert summary is not None
    assert summary.group(1) == result.stdout.splitlines()[-1]


@pytest.mark.parametrize("consumer", ["catalog", "audit"])
def test_invalid_samples_give_the_documented_codes(tmp_path: Path, consumer: str) -> None:
    """Every file of invalid/ is rejected with the README's code and nothing but `rejected` changes."""
    db = tmp_path / "db"

    result = cli(["replay", "--consumer", consumer, "--db", str(db), "--json", str(INVALID)])

    assert 1 == result.exit_code
    assert [code for _, code in documented_invalid()] == statuses(result.stdout)
    assert ([], []) == (read_rows(db, "inbox"), read_rows(db, consumer))
    assert len(documented_invalid()) == len(read_rows(db, "rejected"))


def test_console_script_from_another_directory(tmp_path: Path) -> None:
    """The installed delivery-consumer, run from a directory outside the repo, finds its schemas and
    gives the documented results for both folders in one replay."""
    expected = [catalog for _, catalog, _ in documented_sequence()] + [code for _, code in documented_invalid()]

    run = subprocess.run(
        [console_script(), "replay", "--consumer", "catalog", "--batch", "100", "--json", str(SAMPLES), str(INVALID)],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )

    assert 1 == run.returncode, run.stderr
    assert expected == statuses(run.stdout)
    assert (tmp_path / "state" / "catalog" / "inbox.db").is_file()
