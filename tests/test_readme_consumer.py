"""The README's "Adding a consumer" example, exactly as printed, works through
the CLI once pip-installed: its entry point registers it, and its view gives
it list, show and its article in trace."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from support import subprocess_env

REPO = Path(__file__).resolve().parent.parent
LAST_OF_101 = "96214b82-ee25-40da-a164-1cc2b2d6451d"  # sample 10: article-101's only event


def section() -> str:
    text = (REPO / "README.md").read_text("utf-8")
    return text.split("## Adding a consumer\n", 1)[1].split("\n## ", 1)[0]


def example_files() -> dict[str, str]:
    """File name -> content of each code block introduced by its name in backquotes."""
    return dict(re.findall(r"`([\w.]+)`:?\n\n```\w+\n(.*?)```", section(), re.S))


def transcript() -> list[tuple[str, str]]:
    """(command, expected stdout) of each ``$ delivery-consumer`` line of the example's session."""
    (session,) = re.findall(r"```\n(\$ delivery-consumer .*?)```", section(), re.S)
    return [(step.split("\n", 1)[0], step.split("\n", 1)[1] if "\n" in step else "")
            for step in re.split(r"^\$ ", session, flags=re.M) if step]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The example pip-installed (entry point included) into a fresh venv that sees the test venv."""
    root = tmp_path_factory.mktemp("readme_consumer")
    package = root / "delivery-revisions"
    package.mkdir()
    for name, content in example_files().items():
        (package / name).write_text(content, "utf-8")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    # --system-site-packages of a venv made from a venv sees the base Python, not the test venv: add it.
    Path(purelib, "_test_venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                    str(package)], check=True, timeout=300, env=subprocess_env())
    yield python


def run(python: Path, cwd: Path, command: str, code: int = 0) -> str:
    args = command.split()
    assert args[0] == "delivery-consumer"
    done = subprocess.run([str(python), "-m", "delivery_consumer", *args[1:]], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert code == done.returncode, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def test_the_example_has_a_module_and_its_entry_point() -> None:
    """The section shows the module and a pyproject.toml whose entry point names it."""
    files = example_files()
    assert {"delivery_revisions.py", "pyproject.toml"} == set(files)
    assert '[project.entry-points."delivery_consumer.consumers"]\nrevisions = "delivery_revisions"' in (
        files["pyproject.toml"])


def test_the_installed_example_works_through_the_cli(installed: Path, tmp_path: Path) -> None:
    """replay, the transcript's list and show (output exactly as printed) and trace work for the
    installed example, found by its entry point alone (no DELIVERY_PLUGINS)."""
    (tmp_path / "sample_events").symlink_to(REPO / "sample_events")
    replay = run(installed, tmp_path, "delivery-consumer replay --consumer revisions sample_events/", code=1)
    assert "12 events: 10 counted, 1 duplicate:counted, 1 rejected (1 event-id-reused)" == replay.splitlines()[-1]

    steps = [(command, expected) for command, expected in transcript() if "replay" not in command]
    assert [c for c, _ in steps] == ["delivery-consumer revisions list", "delivery-consumer revisions show article-42"]
    for command, expected in steps:
        assert expected == run(installed, tmp_path, command), command

    trace = f"delivery-consumer trace --consumer revisions --json {LAST_OF_101}"
    traced = orjson.loads(run(installed, tmp_path, trace))
    assert ("applied", "counted") == (traced["status"], traced["receipt"]["result"])
    assert {"articleId": "article-101", "events": 1, "maxRevision": 1, "lastEventId": LAST_OF_101,
            "currentEvent": True} == traced["article"]
    missing = subprocess.run([str(installed), "-m", "delivery_consumer", "revisions", "show", "article-0"],
                             cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert (1, "") == (missing.returncode, missing.stdout)
    assert "articleId article-0 not found" in missing.stderr
