"""CPU work of ``replay`` and of the baseline loop, in instructions (callgrind).

    python bench/bench_instructions.py [--events 2000] [--consumer catalog|audit|declared] [--limit raw|store]
                                       [--profile DIR]

The wall-clock benchmark (``bench_replay.py``) is what a user waits for, but
on a shared VM its runs vary by ±20 %, more than most single changes are
worth. This one runs the same two commands under ``valgrind --tool=callgrind``
and reports instructions executed, which do not depend on the machine's
load: start-up (a one-event file) and per event (the rest, divided by the
number of events), at ``--batch 1`` and ``--batch 100``. It does not see
cache misses nor time spent waiting for fsync, so its ratio is not the
goal's; use it to tell whether a change made the hot path cheaper.

The limit is ``raw_limit.py`` (the least work the job needs, catalog only)
unless ``--limit store`` picks ``baseline_loop.py`` (the store's own SQL).
``--consumer declared`` replays the declared event type of ``_declared.py``
(consumer ``items``, loaded as a plugin) against the raw loop on the same
events. ``--profile DIR`` keeps each run's callgrind output there
(``callgrind_annotate --inclusive=yes DIR/ours-100.out`` shows where it goes).

Needs valgrind. Same bytecode-cache setting as bench_replay.py. ~1 minute.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import _declared
import _stream
import bench_replay

BATCHES = (1, 100)
HERE = Path(__file__).resolve().parent
RAW = HERE / "raw_limit.py"


def _instructions(argv: list[str], env: dict[str, str], out: Path | None = None) -> int:
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out or '/dev/null'}", *argv],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False, text=True,
    )
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        sys.exit(f"{' '.join(argv)} failed under valgrind:\n{proc.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--consumer", choices=("catalog", "audit", "declared"), default="catalog")
    parser.add_argument("--limit", choices=("raw", "store"), default="raw")
    parser.add_argument("--profile", type=Path, help="keep the callgrind outputs in this directory")
    args = parser.parse_args()
    if args.limit == "raw" and args.consumer == "audit":
        sys.exit("raw_limit.py knows only the catalog: use --limit store for audit")
    if args.limit == "store" and args.consumer == "declared":
        sys.exit("baseline_loop.py knows only the built-in consumers: use --limit raw for declared")
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found")

    command = bench_replay._command()
    tmp = Path(tempfile.mkdtemp(prefix="dc-instr-"))
    try:
        env = bench_replay._env(tmp)
        bench_replay.ENV = env
        events = _stream.envelopes(args.events)
        consumer, extra = args.consumer, []
        if consumer == "declared":
            events = [_declared.declared(e) for e in events]
            consumer, extra = "items", ["--key", "itemId", "--published", _declared.PUBLISHED]
            env.update(DELIVERY_PLUGINS="_declared", PYTHONPATH=os.pathsep.join(
                filter(None, [str(HERE), env.get("PYTHONPATH", "")])))
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        source, one = tmp / "events.ndjson", tmp / "one.ndjson"
        source.write_bytes(_stream.ndjson(events))
        one.write_bytes(_stream.ndjson(events[:1]))
        schema = bench_replay._schema(tmp, command, args.consumer if consumer != "items" else "catalog")
        print(f"{args.consumer}, {args.events} events, instructions counted by callgrind")
        print("| process | start-up (1 event) | per event, --batch 1 | per event, --batch 100 |")
        print("|---|---:|---:|---:|")
        for name in ("ours", "limit"):
            db = tmp / f"{name}.db"

            def count(src: Path, batch: int, name: str = name, db: Path = db) -> int:
                ours, base = bench_replay._argvs(command, consumer, batch, src, schema, db, db)
                if args.limit == "raw":
                    base = [sys.executable, str(RAW), "--batch", str(batch), "--db", str(db), *extra, str(src)]
                argv = [sys.executable, *ours] if name == "ours" else base  # ours: the console script
                bench_replay._fresh(db)
                out = args.profile / f"{name}-{batch}{'' if src == source else '-one'}.out" if args.profile else None
                return _instructions(argv, env, out)

            count(one, 1)  # warm the bytecode cache
            start = count(one, 1)
            per = {b: (count(source, b) - start) / (args.events - 1) for b in BATCHES}
            print(f"| {name} | {start / 1e6:.0f} M | {per[1] / 1e3:.1f} k | {per[100] / 1e3:.1f} k |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
