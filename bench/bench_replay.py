"""``delivery-consumer replay`` against the store's practical limit.

    python bench/bench_replay.py [--events 20000] [--repeat 3] [--consumer catalog|audit|both]

Generates a realistic stream (``_stream.py``: several thousand articles,
increasing revisions, ~3 % redeliveries, ~3 % late (stale) events, a few
same-state re-announcements) into an NDJSON file in a temporary directory.
Then, for ``--batch 1`` and ``--batch 100``, it times WHOLE PROCESSES, start-up
included, each on a fresh database:

* ours: ``delivery-consumer replay --consumer C --batch N --db DB FILE``,
  stdout to a file (the per-event lines are part of the command's work);
* limit: ``bench/baseline_loop.py``, the same pragmas, tables and SQL
  statements without validation or anything else (see its docstring).

Each measurement is repeated ``--repeat`` times, ours and the limit
alternating. The table gives events/s and the ratio from the MEDIAN wall
times, and the ratio of the BEST runs too (a busy machine only ever adds
time, so the best runs are the least disturbed); every run is printed.
Finally it checks that both wrote the same effect table and the same inbox
receipts (all columns but the receipt time).

Bytecode: both processes may cache compiled modules, as any installed package
does (pip writes the .pyc files at install time). This matters because a
development shell may set ``PYTHONDONTWRITEBYTECODE=1``, and then an editable
install recompiles the whole package from source at every start (~20 ms
here). The benchmark runs both commands without that variable and with
``PYTHONPYCACHEPREFIX`` pointing into its temporary directory (nothing is
written next to the sources), after one untimed warm-up run of each. It also
reports the start-up cost alone: a process replaying an empty file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _stream

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "baseline_loop.py"
BATCHES = (1, 100)
GOALS = {1: 0.9, 100: 0.75}
EFFECT_TABLES = {"catalog": "catalog", "audit": "audit"}


@dataclass
class Runs:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def median(self) -> float:
        return statistics.median(self.wall)

    def best(self) -> float:
        return min(self.wall)


def _command() -> str:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("delivery-consumer", path=path)
    if found is None:
        sys.exit("delivery-consumer not found: pip install -e . first")
    return found


def _fresh(db: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)


def _env(tmp: Path) -> dict[str, str]:
    """The environment of the timed processes: bytecode cached in *tmp*."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    return env


ENV: dict[str, str] = dict(os.environ)


def _timed(argv: list[str], stdout: Path, runs: Runs) -> None:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with stdout.open("wb") as out:
        start = time.perf_counter()
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, env=ENV, check=False)
        wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')}")
    runs.wall.append(wall)
    runs.cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


def _schema(tmp: Path, command: str, consumer: str) -> Path:
    """The CREATE statements of a database the store made, for the baseline."""
    db = tmp / f"schema-{consumer}.db"
    subprocess.run([command, "init", "--consumer", consumer, "--db", str(db)], check=True,
                   stdout=subprocess.DEVNULL, env=ENV)
    with sqlite3.connect(db) as conn:
        sql = [r[0] for r in conn.execute("SELECT sql FROM sqlite_schema WHERE sql IS NOT NULL ORDER BY rowid")]
    conn.close()
    path = tmp / f"schema-{consumer}.sql"
    path.write_text(";\n".join(sql) + ";\n", encoding="utf-8")
    return path


def _contents(db: Path, consumer: str) -> dict[str, list[tuple[object, ...]]]:
    table = EFFECT_TABLES[consumer]
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall(),
            "inbox": conn.execute(
                "SELECT event_id, fingerprint, result, event_type FROM inbox ORDER BY event_id"
            ).fetchall(),
            "rejected": conn.execute("SELECT code, reason FROM rejected").fetchall(),
        }
    finally:
        conn.close()


def _results(db: Path) -> str:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT result, count(*) FROM inbox GROUP BY 1 ORDER BY 1").fetchall()
    finally:
        conn.close()
    return ", ".join(f"{n} {r}" for r, n in rows)


def _argvs(command: str, consumer: str, batch: int, source: Path, schema: Path, ours_db: Path,
           base_db: Path) -> tuple[list[str], list[str]]:
    ours = [command, "replay", "--consumer", consumer, "--batch", str(batch), "--db", str(ours_db), str(source)]
    base = [sys.executable, str(BASELINE), "--consumer", consumer, "--batch", str(batch),
            "--db", str(base_db), "--schema", str(schema), str(source)]
    return ours, base


def _startup(command: str, consumer: str, schema: Path, tmp: Path, repeat: int) -> str:
    """Median wall time of each process on an empty file (after a warm-up)."""
    empty = tmp / "empty.ndjson"
    empty.write_bytes(b"")
    ours_db, base_db = tmp / "startup-ours.db", tmp / "startup-base.db"
    ours_argv, base_argv = _argvs(command, consumer, 1, empty, schema, ours_db, base_db)
    ours, base = Runs(), Runs()
    for i in range(repeat + 1):
        for argv, db, runs in ((ours_argv, ours_db, ours), (base_argv, base_db, base)):
            _fresh(db)
            _timed(argv, tmp / "stdout.txt", runs if i else Runs())  # run 0: warm-up (bytecode)
    return f"start-up alone (empty file, fresh database): ours {ours.median() * 1000:.0f} ms, " \
           f"limit {base.median() * 1000:.0f} ms"


def bench(consumer: str, source: Path, events: int, repeat: int, tmp: Path, command: str,
          batches: tuple[int, ...] = BATCHES) -> list[str]:
    schema = _schema(tmp, command, consumer)
    rows = []
    print(f"\n== consumer {consumer}, {events} events, {repeat} runs each (wall, start-up included)")
    print(f"  {_startup(command, consumer, schema, tmp, max(repeat, 5))}")
    for batch in batches:
        ours_db, base_db = tmp / f"ours-{consumer}-{batch}.db", tmp / f"base-{consumer}-{batch}.db"
        ours_argv, base_argv = _argvs(command, consumer, batch, source, schema, ours_db, base_db)
        ours, base = Runs(), Runs()
        for i in range(repeat):
            # Alternate which goes first, so that drift in the VM hits both.
            order = [(ours_argv, ours_db, ours), (base_argv, base_db, base)]
            for argv, db, runs in order if i % 2 == 0 else order[::-1]:
                _fresh(db)
                _timed(argv, tmp / "stdout.txt", runs)
                if runs is ours:
                    lines = (tmp / "stdout.txt").read_bytes().count(b"\n")
                    if lines != events + 1:
                        sys.exit(f"ours printed {lines} lines, expected {events} + summary")
        a, b = _contents(ours_db, consumer), _contents(base_db, consumer)
        same = a == b
        ratio = base.median() / ours.median()
        for name, runs in (("ours", ours), ("limit", base)):
            walls = " ".join(f"{w:.3f}" for w in runs.wall)
            cpus = " ".join(f"{c:.3f}" for c in runs.cpu)
            print(f"  batch {batch:>3} {name:<5} wall s: {walls}   cpu s: {cpus}")
        print(f"  batch {batch:>3} results: {_results(ours_db)}")
        print(f"  batch {batch:>3} final databases equal ({consumer}, inbox, rejected): {'yes' if same else 'NO'}"
              f" ({len(a[consumer])} {consumer} rows, {len(a['inbox'])} receipts, {len(a['rejected'])} rejected)")
        if not same:
            for key in a:
                if a[key] != b[key]:
                    print(f"    {key} differs: ours {len(a[key])} rows, limit {len(b[key])} rows")
        best_ratio = base.best() / ours.best()
        goal = GOALS.get(batch)
        verdict = "" if goal is None else f"{'>=' if ratio >= goal else '<'} {goal}"
        rows.append(
            f"| {consumer} `--batch {batch}` | {events / ours.median():,.0f} | {events / base.median():,.0f} "
            f"| {ratio:.2f} | {best_ratio:.2f} | {verdict} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--consumer", choices=("catalog", "audit", "both"), default="catalog")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        help="comma-separated batch sizes (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()

    global ENV
    command = _command()
    tmp = Path(tempfile.mkdtemp(prefix="dc-bench-"))
    ENV = _env(tmp)
    try:
        source = tmp / "events.ndjson"
        source.write_bytes(_stream.ndjson(_stream.envelopes(args.events, seed=args.seed)))
        print(f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, {platform.machine()}, "
              f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
              f"WAL + synchronous=FULL; stream: {source} ({source.stat().st_size:,} bytes)")
        consumers = ("catalog", "audit") if args.consumer == "both" else (args.consumer,)
        table = [
            "| mode | ours ev/s | limit ev/s | ratio ours/limit | ratio, best runs | goal (on the median) |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for consumer in consumers:
            batches = tuple(int(b) for b in args.batches.split(","))
            table += bench(consumer, source, args.events, args.repeat, tmp, command, batches)
        print()
        print("\n".join(table))
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
