"""Benchmark: the first 1,000 messages after a graceful restart against steady state.

A SIGTERM stops ``run`` after its current batch; the rest of its prefetch
window comes back ``redelivered``. Only a delivery whose key a dead process
left open can be poison, so those redeliveries must go through the normal
batch path: the restart must not be much slower than steady state.

Per round, on a fresh queue of ``--messages`` catalog events (seeded first):

1. ``run`` A consumes until ``--warmup`` messages are acked, then gets SIGTERM
   (exit 0; its unacked window is redelivered);
2. ``run`` B starts on the same database and drains the queue.

Both rates come from the batch lines the worker logs (one per ack, with a
millisecond timestamp), measured the same way: messages acked between the end
of one batch and the batch where ``--window`` more messages are acked.
*Steady* is A's window starting after its first 1,000 messages; *restart* is
B's window starting at its first batch. The ratio restart / steady, median of
``--repeat`` rounds, is printed beside its goal (>= 0.5).

    python bench/bench_restart.py [--messages 8000] [--warmup 3000] [--window 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_run import delete_queues, make_events, seed

from delivery_consumer.broker import DEFAULT_URL
from delivery_consumer.topology import Topology

GOAL = 0.5
BATCH_LINE = re.compile(r"^\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d),(\d{3}) .*batch (\d+)-(\d+) acked")


def batches(log: str) -> list[tuple[float, int]]:
    """(seconds of the day, messages acked) of every batch line, in order."""
    out = []
    for line in log.splitlines():
        m = BATCH_LINE.search(line)
        if m:
            h, mi, s, ms, first, last = (int(g) for g in m.groups())
            out.append((h * 3600 + mi * 60 + s + ms / 1000, last - first + 1))
    return out


def window_rate(lines: list[tuple[float, int]], skip: int, window: int) -> float:
    """Messages per second over *window* messages, from the end of the batch that
    completes the first *skip* messages (or from the first batch when *skip* is 0)."""
    done, start = 0, None
    for i, (_, n) in enumerate(lines):
        done += n
        if done >= skip:
            start = i
            break
    if start is None:
        raise SystemExit(f"only {done} messages logged, fewer than {skip}")
    counted = 0
    for t, n in lines[start + 1:]:
        counted += n
        if counted >= window:
            return counted / max(t - lines[start][0], 1e-3)
    raise SystemExit(f"only {counted} messages after message {skip}, fewer than {window}")


def command(url: str, topo: Topology, db: Path, *extra: str) -> list[str]:
    return ["delivery-consumer", "run", "--consumer", "catalog", "--db", str(db), "--amqp-url", url,
            "--exchange", topo.exchange, "--queue-prefix", topo.prefix, *extra]


def one_round(url: str, topo: Topology, bodies: list[bytes], warmup: int, window: int,
              workdir: Path) -> tuple[float, float]:
    """(steady rate, restart rate) of one round."""
    delete_queues(url, topo)
    seed(url, topo, bodies)
    db = workdir / f"restart-{uuid.uuid4().hex[:8]}.db"
    logs = workdir / "a.log"
    with open(logs, "w") as sink:
        first = subprocess.Popen(command(url, topo, db), stdout=subprocess.DEVNULL, stderr=sink)
        try:
            deadline = time.monotonic() + 300
            while sum(n for _, n in batches(logs.read_text())) < warmup:
                if time.monotonic() > deadline or first.poll() is not None:
                    raise SystemExit(f"run A did not reach {warmup} messages:\n{logs.read_text()[-2000:]}")
                time.sleep(0.01)
            first.send_signal(signal.SIGTERM)
            if first.wait(60) != 0:
                raise SystemExit(f"run A exited {first.returncode}:\n{logs.read_text()[-2000:]}")
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    a = batches(logs.read_text())
    acked = sum(n for _, n in a)
    second = subprocess.run(command(url, topo, db, "--exit-when-idle", "1"), capture_output=True, text=True,
                            timeout=600)
    if second.returncode != 0:
        raise SystemExit(f"run B exited {second.returncode}:\n{second.stderr[-2000:]}")
    b = batches(second.stderr)
    if acked + sum(n for _, n in b) < len(bodies):
        raise SystemExit(f"lost messages: {acked} + {sum(n for _, n in b)} < {len(bodies)}")
    return window_rate(a, 1000, window), window_rate(b, 0, window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=8000)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--amqp-url", default=os.environ.get("DELIVERY_AMQP_URL", DEFAULT_URL))
    args = parser.parse_args()
    if args.messages < args.warmup + 2 * args.window:
        parser.error("--messages must leave room for the warm-up and two windows")
    bodies = make_events(args.messages)
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    topo = Topology(consumer="catalog", binding_keys=("material.*",), exchange=f"{prefix}.events", prefix=prefix)
    ratios = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeat):
                steady, restart = one_round(args.amqp_url, topo, bodies, args.warmup, args.window, Path(tmp))
                ratios.append(restart / steady)
                print(f"  steady {steady:>8.0f} msg/s   first {args.window} after restart {restart:>8.0f} msg/s"
                      f"   ratio {restart / steady:.2f}", flush=True)
    finally:
        delete_queues(args.amqp_url, topo)
    ratio = statistics.median(ratios)
    print(f"\n{dt.date.today()} · {os.cpu_count()} cores · load {os.getloadavg()[0]:.1f} · catalog · "
          f"default --prefetch/--batch · median of {args.repeat}")
    print(f"restart / steady: {ratio:.2f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})")


if __name__ == "__main__":
    main()
