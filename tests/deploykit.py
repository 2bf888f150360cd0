"""Helpers for the tests of the deployment file and the system view: write a
``delivery.toml`` for a broker namespace, and run the CLI with it (and only
it: no ``DELIVERY_*`` variable of the test process leaks in)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from brokerkit import TESTS_DIR, Namespace, RunProcess
from support import subprocess_env


def write_deployment(directory: Path, *, ns: Namespace | None = None, webhook_url: str | None = None,
                     consumers: tuple[str, ...] = ("catalog", "audit", "webhook"), extra: str = "",
                     partitions: dict[str, int] | None = None) -> Path:
    """A deployment file in *directory*: relative paths, one producer, *consumers*
    (those in *partitions* partitioned: ``db`` their directory, and their count)."""
    lines = []
    if ns is not None:
        lines += [f'amqp_url = "{ns.url}"', f'exchange = "{ns.exchange}"', f'queue_prefix = "{ns.prefix}"']
    lines.append(extra)
    for name in consumers:
        if name in (partitions or {}):
            lines += [f"[consumers.{name}]", f'db = "state/{name}"', f"partitions = {(partitions or {})[name]}"]
            continue
        lines += [f"[consumers.{name}]", f'db = "state/{name}/inbox.db"']
        if name == "webhook" and webhook_url:
            lines.append(f'webhook_url = "{webhook_url}"')
    lines += ["[producers.material]", 'db = "producer.db"']
    path = directory / "delivery.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def deploy_env(config: Path, **extra: str) -> dict[str, str]:
    return subprocess_env(DELIVERY_CONFIG=str(config), PYTHONPATH=str(TESTS_DIR), **extra)


def dc(config: Path, *args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``delivery-consumer ARGS`` as a real process, with the deployment file *config*."""
    return subprocess.run([sys.executable, "-m", "delivery_consumer", *args], cwd=cwd or config.parent,
                          env=deploy_env(config), capture_output=True, text=True, timeout=timeout)


def run_until_idle(config: Path, consumer: str, *args: str, idle: str = "1.5",
                   timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``run --consumer C`` (database, broker and options from the file) until idle."""
    proc = RunProcess([sys.executable, "-m", "delivery_consumer", "run", "--consumer", consumer,
                       "--exit-when-idle", idle, *args], cwd=config.parent, env=deploy_env(config))
    return proc.until_idle(timeout)
