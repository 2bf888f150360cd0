"""Start and takeover times of ``run`` on a multi-GB database, its page cache cold.

    python bench/bench_bigfile.py [--size-mb 2500] [--dir DIR] [--repeat 3] [--python PATH ...]

Builds partition 0's catalog database with a ballast of blobs (every page is
read by the integrity check, as receipts would be) on DIR (default: the temp
directory, a real disk: the page cache can be emptied for the file with
``posix_fadvise(DONTNEED)``, which needs no privilege), then for each
interpreter given (each with its own install of delivery-consumer, e.g. a
checkout of main and this one):

* start: a fresh ``run --partition 0`` on the cold file, from its start to
  its ``consuming`` line (the time before it serves its queue);
* takeover: an active run and its standby on the file, the cache emptied,
  ``kill -9`` of the active's main PID, to the standby's ``consuming`` line.

Prints every run and the medians. Needs RabbitMQ (``DELIVERY_AMQP_URL``); its
queues are deleted after. Not a test: the figures depend on the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def build(db: Path, megabytes: int, python: str) -> None:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, 'tests');"
            "from test_big_file import build_big; from delivery_consumer.amqp.partitions import Identity;"
            f"build_big(Path({str(db)!r}), {megabytes}, Identity(0, 2))")
    subprocess.run([python, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent,
                   env={**os.environ, "PYTHONPATH": "tests/broker:tests"})


def cold(db: Path) -> None:
    """Empty the page cache of the database's files (no privilege needed)."""
    for name in (db, Path(f"{db}-wal")):
        if name.exists():
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Run:
    def __init__(self, python: str, workdir: Path, env: dict[str, str]) -> None:
        self.started = time.monotonic()
        self.log = workdir / f"run-{uuid.uuid4().hex[:6]}.log"
        self.file = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([python, "-m", "delivery_consumer", "run", "--consumer", "catalog",
                                      "--partition", "0", "--partitions", "2"], cwd=workdir, env=env,
                                     stdout=subprocess.DEVNULL, stderr=self.file, start_new_session=True)

    def wait_for(self, text: str, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log.read_text(errors="replace"):
                return time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(f"run exited {self.proc.returncode}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        raise RuntimeError(f"no {text!r} within {timeout}s:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.file.close()


def measure(python: str, workdir: Path, db: Path, env: dict[str, str], repeat: int) -> tuple[list[float], list[float]]:
    starts, takeovers = [], []
    for _ in range(repeat):
        cold(db)
        run = Run(python, workdir, env)
        try:
            starts.append(run.wait_for("consuming ") - run.started)
        finally:
            run.stop()
        active = Run(python, workdir, env)
        active.wait_for("consuming ")
        standby = Run(python, workdir, env)
        try:
            standby.wait_for("standby: waiting")
            with contextlib.suppress(RuntimeError):
                standby.wait_for("checked whole in", timeout=60)  # a release that checks while it waits
            cold(db)
            killed = time.monotonic()
            os.kill(active.proc.pid, signal.SIGKILL)
            takeovers.append(standby.wait_for("consuming ") - killed)
        finally:
            active.stop()
            standby.stop()
    return starts, takeovers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=2500)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--python", action="append", help="an interpreter with delivery-consumer installed")
    args = parser.parse_args()
    pythons = args.python or [sys.executable]
    url = os.environ.get("DELIVERY_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    workdir = Path(tempfile.mkdtemp(prefix="bigfile-", dir=args.dir))
    env = {**os.environ, "DELIVERY_AMQP_URL": url, "DELIVERY_QUEUE_PREFIX": prefix,
           "DELIVERY_EXCHANGE": f"{prefix}.events"}
    db = workdir / "state" / "catalog" / "p0" / "inbox.db"
    db.parent.mkdir(parents=True)
    try:
        subprocess.run([pythons[0], "-m", "delivery_consumer", "topology", "declare", "--consumer", "catalog",
                        "--partitions", "2"], cwd=workdir, env=env, check=True, capture_output=True)
        build(db, args.size_mb, sys.executable)
        print(f"{db}: {db.stat().st_size / 2**30:.2f} GiB, page cache emptied before each measure")
        for python in pythons:
            for f in (Path(f"{db}.acked"), Path(f"{db}.lock")):
                f.unlink(missing_ok=True)
            starts, takeovers = measure(python, workdir, db, env, args.repeat)
            print(f"{python}\n  start to consuming, s: {' '.join(f'{s:.2f}' for s in starts)}"
                  f" (median {statistics.median(starts):.2f})\n  kill -9 of the active to the standby consuming, s: "
                  f"{' '.join(f'{s:.2f}' for s in takeovers)} (median {statistics.median(takeovers):.2f})")
    finally:
        from brokerkit import Namespace
        from partitionkit import Cluster

        Cluster(Namespace(url, prefix, workdir), "catalog", 2).delete()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
