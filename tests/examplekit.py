"""The manual's example consumer (docs/adding-a-consumer.md) as printed: its files taken from the page, and the
distribution pip-installed into a fresh venv that sees the test venv, for the tests that run it as a user would."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from support import subprocess_env

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "adding-a-consumer.md"


def section() -> str:
    return PAGE.read_text("utf-8")


def example_files() -> dict[str, str]:
    """File name -> content of each code block introduced by its name in backquotes."""
    return dict(re.findall(r"`([\w.]+)`:?\n\n```\w+\n(.*?)```", section(), re.S))


def install_example(root: Path) -> tuple[Path, Path]:
    """The example's files written under *root* exactly as printed and pip-installed (entry points included)
    into a fresh venv beside them that sees the test venv: (that venv's python, the package's directory)."""
    package = root / "delivery-payments"
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
    return python, package
