"""The console's status page on a consumer database with a million receipts.

    python bench/bench_console.py [--receipts 1000000] [--window 3h] [--repeat 5]

Builds a catalog database whose receipts are spread evenly over the chart's
window (the worst case: every receipt is drawn), plus a few thousand
rejections, and a deployment file naming it (the broker's queues under a
fresh prefix, so the page also asks the broker, as it does in production).
Then it serves the console in this process and times ``GET /`` over HTTP:

* cold: a new console each time (the minute cache empty: the whole window is read);
* warm: the same console again (settled minutes come from memory);

beside the least work the page needs (the limit):

* for cold, the bare chart query: one ``GROUP BY minute, result`` over the
  window's receipts, through the ``received_at`` index;
* for warm, the status queries alone: receipts in the last minute and hour,
  the newest receipt, unresolved rejections (what ``status`` reads).

Each figure is the median of ``--repeat`` runs, ours and the limit
alternating; every run is printed. The machine may be shared: read the ratios.

With ``--load`` it measures the console under load instead, against the
broker (``DELIVERY_AMQP_URL``, else guest on 127.0.0.1:5672) under a fresh
prefix, with ``delivery-consumer console`` as a real process and a few dead
letters in the catalog's dead queue (so every page reads a dead queue):

* page: ``--clients`` concurrent ``GET /`` (released together), the time of
  each answer, against one ``GET /`` on the idle console (the ratio of the
  median; every request must be answered);
* consumer: ``run`` drains ``--events`` events (its exit line's rate) with
  the console idle, then with ``--hammer`` threads asking for ``--rate``
  pages a second together (0: each as fast as it is answered); the ratio
  loaded / idle, median of ``--repeat`` rounds (limit: >= 0.8, a consumer
  sharing the host keeps most of its throughput while a crowd of dashboards
  reloads the page).

    python bench/bench_console.py --load [--clients 200] [--hammer 16] [--rate 100] [--events 5000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from delivery_consumer.console import Console, make_server
from delivery_consumer.consumers import open_db
from delivery_consumer.inbox import counters
from delivery_consumer.model import durations
from delivery_consumer.ops.deployment import parse_file
from delivery_consumer.store.sqlite import now_iso


def build(path: Path, receipts: int, window_s: float) -> None:
    now = time.time()
    step = window_s / receipts
    results = ["updated"] * 18 + ["duplicate:updated", "stale"]
    with open_db(path, "catalog", create=True) as db:
        db.conn.execute("BEGIN IMMEDIATE")
        db.conn.executemany(
            "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)",
            ((f"{i:032x}", "f" * 64, results[i % 20], "material.published", now_iso(now - window_s + i * step))
             for i in range(receipts)))
        db.conn.executemany(
            "INSERT INTO rejected (code, reason, event_id, rejected_at, resolved_at) VALUES (?, ?, ?, ?, ?)",
            (("revision-conflict", "bench", f"r{i}", now_iso(now - window_s + i * 3), now_iso(now))
             for i in range(receipts // 500)))
        counters.rebuild(db.conn)  # what the writers keep, counted once for the receipts written here
        db.conn.execute("COMMIT")


def get(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as answer:
        assert answer.status == 200
        answer.read()
    return time.perf_counter() - started


def chart_floor(path: Path, window_s: float) -> float:
    started = time.perf_counter()
    with open_db(path, "catalog", readonly=True) as db:
        db.conn.execute("SELECT substr(received_at, 1, 16), result, count(*) FROM inbox WHERE received_at >= ?"
                        " GROUP BY 1, 2", (now_iso(time.time() - window_s),)).fetchall()
    return time.perf_counter() - started


def status_floor(path: Path) -> float:
    now = time.time()
    started = time.perf_counter()
    with open_db(path, "catalog", readonly=True) as db:
        db.conn.execute("SELECT count(*) FILTER (WHERE received_at >= ?), count(*) FROM inbox WHERE received_at >= ?",
                        (now_iso(now - 60), now_iso(now - 3600))).fetchall()
        db.conn.execute("SELECT max(received_at) FROM inbox").fetchall()
        db.conn.execute("SELECT code, count(*) FROM rejected WHERE resolved_at IS NULL GROUP BY code").fetchall()
    return time.perf_counter() - started


def serve(console: Console) -> tuple[str, object]:
    server = make_server(console, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{console.address}/", server


#: The consumer's throughput under a hammered console, as a share of its throughput beside an idle one.
LOAD_LIMIT = 0.8
RUN_RATE = re.compile(r"first delivery to last ack [0-9.]+s, [0-9.]+s busy \(([0-9]+)/s\)")


def cpu_s(pid: int) -> float:
    """CPU time (user + system) of process *pid* so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hammer(page: str, stop: threading.Event, served: list[int], every_s: float) -> None:
    """Fetch the page every *every_s* seconds (0: without pause) until *stop*; count the pages served."""
    due = time.monotonic()
    while not stop.is_set():
        try:
            get(page)
            served[0] += 1
        except Exception:  # counted as not served
            pass
        due += every_s
        stop.wait(max(0.0, due - time.monotonic()))


def load(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_run import delete_queues, make_events, seed

    from delivery_consumer import consumers
    from delivery_consumer.amqp.publisher import Publisher
    from delivery_consumer.amqp.topology import DEFAULT_URL, Topology
    from delivery_consumer.model.deliveries import OutMessage

    url = os.environ.get("DELIVERY_AMQP_URL", DEFAULT_URL)
    tag = uuid.uuid4().hex[:8]
    topo = Topology(consumer="catalog", binding_keys=tuple(consumers.get("catalog").binding_keys),
                    exchange=f"bench-console-{tag}", prefix=f"bench-console-{tag}")
    with tempfile.TemporaryDirectory(prefix="bench-console-load-") as tmp:
        directory = Path(tmp)
        config = directory / "delivery.toml"
        config.write_text(f'amqp_url = "{url}"\nexchange = "{topo.exchange}"\nqueue_prefix = "{topo.prefix}"\n'
                          '[consumers.catalog]\ndb = "state/catalog/inbox.db"\n')
        env = {**os.environ, "DELIVERY_CONFIG": str(config)}
        cli = [sys.executable, "-m", "delivery_consumer"]

        def drain() -> float:
            done = subprocess.run([*cli, "run", "--consumer", "catalog", "--exit-when-idle", "1"], cwd=directory,
                                  env=env, capture_output=True, text=True, timeout=900)
            match = RUN_RATE.search(done.stderr)
            if done.returncode != 0 or match is None:
                raise SystemExit(f"run exited {done.returncode}:\n{done.stderr[-2000:]}")
            return float(match.group(1))

        console = None
        try:
            with Publisher(url, topologies=[topo]) as pub:  # a few dead letters: every page reads the dead queue
                pub.publish([OutMessage(routing_key="material.published", body=b"{not json", exchange=topo.exchange,
                                        message_id=str(uuid.uuid4())) for _ in range(20)])
            drain()
            console = subprocess.Popen([*cli, "console", "--port", "0"], cwd=directory, env=env,
                                       stderr=subprocess.PIPE, text=True)
            assert console.stderr is not None
            first = console.stderr.readline()
            found = re.search(r"console on (http://\S+/)", first)
            if found is None:
                raise SystemExit(f"the console did not start: {first}{console.stderr.read()}")
            page = found.group(1)
            threading.Thread(target=console.stderr.read, daemon=True).start()  # keep its pipe drained
            get(page)  # the first page: the warm-up
            idle = [get(page) for _ in range(5)]
            times: list[float] = []
            failures: list[str] = []
            start = threading.Barrier(args.clients)

            def client() -> None:
                start.wait()
                try:
                    times.append(get(page))
                except Exception as exc:  # counted, and named below
                    failures.append(f"{type(exc).__name__}: {exc}")

            clients = [threading.Thread(target=client) for _ in range(args.clients)]
            started = time.perf_counter()
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join()
            wall = time.perf_counter() - started
            times.sort()
            print(f"page, idle console: {' '.join(f'{t * 1000:.0f}' for t in idle)} ms")
            print(f"page, {args.clients} at once: {len(times)} answered, {len(failures)} not"
                  f"{' (' + failures[0] + ')' if failures else ''}; median {statistics.median(times) * 1000:.0f} ms, "
                  f"slowest {times[-1] * 1000:.0f} ms, all in {wall:.1f}s")
            print(f"{'':>8} {'ours ms':>9} {'idle ms':>9} {'ratio':>6}")
            print(f"{'page':>8} {statistics.median(times) * 1000:9.0f} {statistics.median(idle) * 1000:9.0f} "
                  f"{statistics.median(times) / statistics.median(idle):6.2f}")

            ratios = []
            for round_ in range(args.repeat):
                seed(url, topo, make_events(args.events, "v7"))
                quiet = drain()
                seed(url, topo, make_events(args.events, "v7"))
                stop = threading.Event()
                served = [0]
                every_s = args.hammer / args.rate if args.rate else 0.0
                hammers = [threading.Thread(target=hammer, args=(page, stop, served, every_s))
                           for _ in range(args.hammer)]
                began, console_cpu = time.perf_counter(), cpu_s(console.pid)
                for thread in hammers:
                    thread.start()
                loaded = drain()
                took = time.perf_counter() - began
                pace, console_cpu = served[0] / took, cpu_s(console.pid) - console_cpu
                stop.set()
                for thread in hammers:
                    thread.join()
                ratios.append(loaded / quiet)
                print(f"round {round_ + 1}: run {quiet:.0f}/s beside an idle console, {loaded:.0f}/s while "
                      f"{args.hammer} clients fetched {served[0]} pages ({pace:.0f}/s; the console used "
                      f"{console_cpu / took:.0%} of a core, {console_cpu * 1000 / max(served[0], 1):.2f} ms a page): "
                      f"{loaded / quiet:.2f}")
            ratio = statistics.median(ratios)
            print(f"\nconsumer throughput, console hammered / idle: {ratio:.2f} (limit >= {LOAD_LIMIT}: "
                  f"{'met' if ratio >= LOAD_LIMIT else 'NOT met'})")
        finally:
            if console is not None:
                console.terminate()
                console.wait(30)
            delete_queues(url, topo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receipts", type=int, default=1_000_000)
    parser.add_argument("--window", type=durations.parse, default="3h", help="The chart's window (e.g. 90m, 12h).")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--load", action="store_true", help="The console under load, and a consumer beside it.")
    parser.add_argument("--clients", type=int, default=200, help="--load: concurrent page requests.")
    parser.add_argument("--hammer", type=int, default=16, help="--load: clients fetching pages during a run.")
    parser.add_argument("--rate", type=float, default=100.0,
                        help="--load: pages per second they ask for together (0: as fast as answered).")
    parser.add_argument("--events", type=int, default=5000, help="--load: events per run.")
    args = parser.parse_args()
    if args.load:
        load(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-console-") as tmp:
        directory = Path(tmp)
        db = directory / "state" / "catalog" / "inbox.db"
        started = time.perf_counter()
        build(db, args.receipts, args.window)
        print(f"built {args.receipts:,} receipts over {durations.format(args.window)} "
              f"in {time.perf_counter() - started:.1f}s ({db.stat().st_size / 1e6:.0f} MB)")
        config = directory / "delivery.toml"
        config.write_text(f'queue_prefix = "bench-{uuid.uuid4().hex[:8]}"\n[consumers.catalog]\n'
                          'db = "state/catalog/inbox.db"\n')
        dep = parse_file(config)
        warm = Console(dep, window_s=args.window)
        warm_url, warm_server = serve(warm)
        get(warm_url)  # fills the warm console's cache, and the OS page cache
        runs: dict[str, list[float]] = {"cold": [], "chart floor": [], "warm": [], "status floor": []}
        for _ in range(args.repeat):
            cold = Console(dep, window_s=args.window)
            url, server = serve(cold)
            runs["cold"].append(get(url))
            server.shutdown()  # type: ignore[attr-defined]
            runs["chart floor"].append(chart_floor(db, args.window))
            warm.status.forget()  # a page built now, not the one shared for a few seconds
            runs["warm"].append(get(warm_url))
            runs["status floor"].append(status_floor(db))
        warm_server.shutdown()  # type: ignore[attr-defined]
    for name, values in runs.items():
        print(f"{name:>12}: " + " ".join(f"{v * 1000:.0f}" for v in values) + " ms")
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(f"\n{'page':>6} {'ours ms':>9} {'limit ms':>9} {'ratio':>6}")
    for ours, limit in (("cold", "chart floor"), ("warm", "status floor")):
        print(f"{ours:>6} {median[ours] * 1000:9.0f} {median[limit] * 1000:9.0f} {median[ours] / median[limit]:6.2f}")


if __name__ == "__main__":
    main()
