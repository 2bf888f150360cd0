"""The README's two commands and .ci/run stay in step; the manual's table of rejection codes is the registry's."""

from __future__ import annotations

import re
from pathlib import Path

from delivery_consumer.model.errors import REJECTIONS

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text("utf-8")
    return re.findall(r"```sh\n(.+?)\n```", text.split("---", 1)[0])


def test_readme_starts_with_the_main_job_and_the_test_command() -> None:
    """The README opens with exactly two commands: set up + replay the samples, set up + test."""
    main_job, tests = readme_commands()
    assert "pip install -q ." in main_job and "replay --consumer catalog sample_events/" in main_job
    assert "pytest" in tests and "ruff check" in tests and "mypy" in tests


def test_ci_runs_exactly_the_readme_test_command() -> None:
    """.ci/run runs the README's test command verbatim (and sets DELIVERY_REQUIRE_BROKER)."""
    _, tests = readme_commands()
    script = (REPO / ".ci" / "run").read_text("utf-8")
    assert tests in script.splitlines()
    assert "export DELIVERY_REQUIRE_BROKER=1" in script
    assert "rabbitmq-server -detached" in script


def readme_rejection_codes() -> list[str]:
    """The codes of docs/envelope.md's table headed ``| rejection code | when |``, in its order."""
    lines = (REPO / "docs" / "envelope.md").read_text("utf-8").splitlines()
    start = lines.index("| rejection code | when |") + 2  # past the header and its rule
    codes: list[str] = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        codes += re.findall(r"`([a-z-]+)`", line.split("|")[1])
    return codes


def test_the_readme_lists_every_rejection_code_once_and_no_other() -> None:
    """The manual's table of rejection codes (docs/envelope.md) names each code of errors.REJECTIONS
    exactly once, and nothing else."""
    codes = readme_rejection_codes()
    assert len(codes) == len(set(codes))
    assert set(REJECTIONS) == set(codes)
