"""The README's two commands and .ci/run stay in step."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
