"""Benchmark: the first 1,000 messages after a graceful restart against steady state.

A SIGTERM stops ``run`` after its current batch; the rest of its prefetch
window comes back ``redelivered`` (on a quorum queue, at the back of the
queue). Only a delivery whose key a dead process left open can be poison, so
those redeliveries must go through the normal batch path: the restart must
not be much slower than steady state.

Per round, on a fresh queue of the consumer (catalog by default):

1. ``--warmup`` + ``--window`` events are seeded; ``run`` A consumes until
   ``--warmup`` are acked, then gets SIGTERM (exit 0; its unacked window goes
   back to the queue, redelivered);
2. ``run`` B (the restart) drains what is left -- about ``--window``
   messages, up to a prefetch window of them redelivered;
3. ``--window`` new events are seeded and ``run`` C (steady state, same
   database, nothing redelivered) drains them.

Each rate is what ``run`` prints at exit (over the time it had deliveries in hand, so the
start-up is not counted). The ratio B / C, median of ``--repeat`` rounds, is
printed beside its goal (>= 0.5).

    python bench/bench_restart.py [--warmup 3000] [--window 1000] [--repeat 3]
    python bench/bench_restart.py --consumer webhook --warmup 300 --window 100   # endpoint 50 ms slow

With ``--consumer webhook`` the endpoint is ``tests/webhook_server.py`` in its
own process, every answer ``--endpoint-delay`` late, and run uses ``--batch 20
--prefetch 100``.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_run import bench_topology, broker_parser, delete_queues, make_events, seed

from delivery_consumer.amqp.topology import Topology

GOAL = 0.5
BATCH_LINE = re.compile(r"batch (\d+)-(\d+) acked")
RUN_RATE = re.compile(r"(\d+) deliver(?:y|ies) acked .* first delivery to last ack [0-9.]+s, [0-9.]+s busy "
                      r"\(([0-9]+)/s\)")


def acked(log: str) -> int:
    """Messages acked so far, from the batch lines of a run's log."""
    return sum(int(last) - int(first) + 1 for first, last in BATCH_LINE.findall(log))


SERVER = Path(__file__).resolve().parent.parent / "tests" / "webhook_server.py"
#: Extra options of run (the webhook's URL).
RUN_OPTIONS: list[str] = []


def command(url: str, topo: Topology, db: Path, *extra: str) -> list[str]:
    return ["delivery-consumer", "run", "--consumer", topo.consumer, "--db", str(db), "--amqp-url", url,
            "--exchange", topo.exchange, "--queue-prefix", topo.prefix, *RUN_OPTIONS, *extra]


def drain(url: str, topo: Topology, db: Path) -> tuple[int, float]:
    """Run until idle; (messages acked, their rate) from the exit line."""
    done = subprocess.run(command(url, topo, db, "--exit-when-idle", "1"), capture_output=True, text=True,
                          timeout=600)
    match = RUN_RATE.search(done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"run exited {done.returncode}:\n{done.stderr[-2000:]}")
    return int(match.group(1)), float(match.group(2))


def redelivered(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM deliveries WHERE redeliveries > 0").fetchone()[0])
    finally:
        conn.close()


def one_round(url: str, topo: Topology, warmup: int, window: int, workdir: Path) -> tuple[float, float, int, int]:
    """(steady rate, restart rate, messages after the restart, of which redelivered) of one round."""
    delete_queues(url, topo)
    seed(url, topo, make_events(warmup + window))
    db = workdir / f"restart-{uuid.uuid4().hex[:8]}.db"
    logs = workdir / "a.log"
    with open(logs, "w") as sink:
        first = subprocess.Popen(command(url, topo, db), stdout=subprocess.DEVNULL, stderr=sink)
        try:
            deadline = time.monotonic() + 300
            while acked(logs.read_text()) < warmup:
                if time.monotonic() > deadline or first.poll() is not None:
                    raise SystemExit(f"run A did not reach {warmup} messages:\n{logs.read_text()[-2000:]}")
                time.sleep(0.005)
            first.send_signal(signal.SIGTERM)
            if first.wait(60) != 0:
                raise SystemExit(f"run A exited {first.returncode}:\n{logs.read_text()[-2000:]}")
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    after, restart = drain(url, topo, db)
    again = redelivered(db)
    # new articles, so that steady state does the same work (no stale revision, no fence already done)
    seed(url, topo, [b.replace(b'"articleId":"article-', b'"articleId":"steady-') for b in make_events(window)])
    _, steady = drain(url, topo, db)
    return steady, restart, after, again


def main() -> None:
    parser = broker_parser(__doc__, messages=None)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--consumer", choices=["catalog", "webhook"], default="catalog")
    parser.add_argument("--endpoint-delay", type=float, default=0.05, help="webhook: seconds per answer")
    args = parser.parse_args()
    topo = bench_topology(consumer=args.consumer)
    ratios = []
    server = None
    if args.consumer == "webhook":
        server = subprocess.Popen([sys.executable, str(SERVER), "0", str(args.endpoint_delay)], stdout=subprocess.PIPE,
                                  text=True)
        assert server.stdout is not None
        RUN_OPTIONS.extend(["--webhook-url", f"http://127.0.0.1:{int(server.stdout.readline())}/notify",
                            "--batch", "20", "--prefetch", "100"])  # a batch of 250 calls would take 12 s
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeat):
                steady, restart, after, again = one_round(args.amqp_url, topo, args.warmup, args.window, Path(tmp))
                ratios.append(restart / steady)
                print(f"  steady {steady:>7.0f} msg/s   after the restart {restart:>7.0f} msg/s ({after} messages, "
                      f"{again} redelivered)   ratio {restart / steady:.2f}", flush=True)
    finally:
        delete_queues(args.amqp_url, topo)
        if server is not None:
            server.terminate()
            server.wait()
    ratio = statistics.median(ratios)
    print(f"\n{dt.date.today()} · {os.cpu_count()} cores · load {os.getloadavg()[0]:.1f} · {args.consumer} · "
          f"default --prefetch/--batch · median of {args.repeat}")
    print(f"restart / steady: {ratio:.2f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})")


if __name__ == "__main__":
    main()
