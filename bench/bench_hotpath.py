"""The hot path's goals in one run: each ratio paired, repeated, median.

    python bench/bench_hotpath.py [--repeat 3] [--only replay,declared,growth,run] [--receipts 5000000]

* ``replay --batch 1`` (10k events) against ``bench/raw_limit.py --batch 1``,
  and ``--batch 100`` (50k events) against the raw loop at 100 per commit:
  whole processes, start-up included, each on a fresh database, ours and the
  limit alternating (goal >= 0.9);
* declared: the same two ratios for a declared event type of the material
  types' size (``_declared.py``: ``item.*`` keyed by ``itemId``, consumed by
  a plugin consumer on ``state.RevisionTable``), the raw loop reading the
  same events (goal >= 0.9);
* growth: ``replay --batch 100`` of 50k events into a database already
  holding ``--receipts`` receipts against the same into an empty one
  (goal >= 0.9). The full database is made once with raw SQL (receipts
  received in the past) and copied before each run;
  ``--curve 0,1000000,...`` prints the whole curve, ours and the raw loop.
  ``--ids v4,v7`` runs it for each kind of eventId, in the receipts already
  there and in the events replayed: random (``v4``, what any producer may
  send) and time-ordered (``v7``, what the toolkit's producers send);
  ``v4:v7`` means random receipts already there and time-ordered events
  replayed (a deployment whose producers switched);
* ``run`` (default options: prefetch 500, batch 250) against a bare pika
  consumer acking ``multiple`` every batch at the same prefetch, 20k
  messages on a quorum queue (goal >= 0.7), with the peak RSS of ``run``
  (connection process + worker process, VmHWM of each, summed); and, in the
  same rounds, the bare consumer that also applies each batch with the raw
  loop's SQL and commits it before the ack (``bench_run.bare_sql``): what
  the job itself costs on this machine.

The ratio of each pair is taken from the medians. Every run is printed. The
machine may be shared: a busy machine only adds time, so look at the spread.
Beside each replay ratio, ``CPU`` is the same ratio by CPU time (user +
system, every thread): the work, which the wall clock hides where the disk's
syncs or a second core overlap it. ``TMPDIR=/dev/shm`` puts the databases on
a tmpfs, where a sync costs nothing: the wall-clock ratio then falls
towards the CPU ratio.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import _stream
import bench_replay

HERE = Path(__file__).resolve().parent
RAW = HERE / "raw_limit.py"
GOALS = {"replay1": 0.9, "replay100": 0.9, "growth": 0.9, "run": 0.7}
_KIND = {"v4": "random", "v7": "time-ordered"}


def _medians(label: str, repeat: int, timed: dict[str, Callable[[], float]]) -> list[float]:
    """Run the timed callables in turn *repeat* times (the order reversed every
    other round); print every run; their medians, in the order given."""
    runs: dict[str, list[float]] = {name: [] for name in timed}
    for i in range(repeat):
        order = list(timed.items())
        for name, fn in order if i % 2 == 0 else order[::-1]:
            runs[name].append(fn())
    print(f"  {label}: " + " | ".join(f"{name} " + " ".join(f"{x:,.0f}" for x in values)
                                      for name, values in runs.items()), flush=True)
    return [statistics.median(values) for values in runs.values()]


def _median_pair(label: str, repeat: int, first: Callable[[], float], second: Callable[[], float],
                 names: tuple[str, str]) -> tuple[float, float]:
    """Alternate two timed callables *repeat* times; print every run; medians."""
    a, b = _medians(label, repeat, {names[0]: first, names[1]: second})
    return a, b


def _wall(argv: list[str], out: Path, cpu: list[float] | None = None) -> float:
    """The wall-clock seconds of *argv*; its CPU seconds (user + system, all
    threads) appended to *cpu* when given."""
    runs = bench_replay.Runs()
    bench_replay._timed(argv, out, runs)
    if cpu is not None:
        cpu.append(runs.cpu[0])
    return runs.wall[0]


class Replay:
    """Times replay and the raw loop over the same NDJSON file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.command = bench_replay._command()
        #: CPU seconds of each timed run, by side (``ours``, ``raw``), since :meth:`reset_cpu`.
        self.cpu: dict[str, list[float]] = {"ours": [], "raw": []}

    def reset_cpu(self) -> None:
        """Forget the CPU seconds recorded so far (the warm-up's)."""
        self.cpu = {"ours": [], "raw": []}

    def cpu_ratio(self) -> float:
        """The raw loop's median CPU seconds over ours: events per CPU second, ours over the limit's."""
        return statistics.median(self.cpu["raw"]) / statistics.median(self.cpu["ours"])

    def ours(self, source: Path, batch: int, template: Path | None = None,
             consumer: str = "catalog") -> Callable[[], float]:
        db = self.tmp / "ours.db"
        lines = source.read_bytes().count(b"\n")

        def timed() -> float:
            bench_replay._fresh(db)
            _copy_at_rest(template, db)
            argv = [self.command, "replay", "--consumer", consumer, "--batch", str(batch), "--db", str(db),
                    str(source)]
            wall = _wall(argv, self.tmp / "stdout.txt", self.cpu["ours"])
            return lines / wall

        return timed

    def raw(self, source: Path, batch: int, template: Path | None = None,
            extra: Sequence[str] = ()) -> Callable[[], float]:
        db = self.tmp / "raw.db"
        lines = source.read_bytes().count(b"\n")

        def timed() -> float:
            bench_replay._fresh(db)
            _copy_at_rest(template, db)
            wall = _wall([sys.executable, str(RAW), "--batch", str(batch), "--db", str(db), *extra, str(source)],
                         self.tmp / "stdout.txt", self.cpu["raw"])
            return lines / wall

        return timed


def _copy_at_rest(template: Path | None, db: Path) -> None:
    """Copy *template* (if any) to *db*, then wait until the disk is idle.

    A database in service is at rest on disk. A copy made just before the
    run is not: its pages are dirty in the kernel's cache, and the run's
    first fsync of the file would write them all back inside the timed run.
    Both sides of a pair wait the same way.
    """
    if template is not None:
        shutil.copyfile(template, db)
    os.sync()


def _stream_file(tmp: Path, name: str, count: int, seed: int, ids: str = "v4") -> Path:
    path = tmp / name
    path.write_bytes(_stream.ndjson(_stream.envelopes(count, seed=seed, ids=ids)))
    return path


def prefill_store(command: str, path: Path, count: int, ids: str = "v4") -> None:
    """A catalog database holding *count* receipts, made with raw SQL."""
    bench_replay._fresh(path)
    subprocess.run([command, "init", "--consumer", "catalog", "--db", str(path)], check=True,
                   stdout=subprocess.DEVNULL, env=bench_replay.ENV)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA cache_size = -1000000")
    start, step = _stream.past_span(count)  # received before the stream, in rowid order
    event_id = _stream.past_ids(ids, start, step)
    done = 0
    while done < count:
        n = min(200_000, count - done)
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO inbox (event_id, fingerprint, result, event_type, received_at) VALUES (?, ?, ?, ?, ?)",
            ((event_id(done + i), "0" * 64, "updated", "material.published", _iso(start + (done + i) * step))
             for i in range(n)))
        conn.execute("COMMIT")
        done += n
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    os.sync()  # written with synchronous=OFF: on disk before anything is timed


def _iso(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when % 1 * 1000):03d}Z"


def prefill_raw(path: Path, count: int, ids: str = "v4") -> None:
    bench_replay._fresh(path)
    subprocess.run([sys.executable, str(RAW), "--db", str(path), "--prefill", str(count), "--ids", ids], check=True)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    os.sync()


def bench_replay_ratios(tmp: Path, repeat: int, rows: list[str]) -> None:
    r = Replay(tmp)
    for batch, events in ((1, 10_000), (100, 50_000)):
        source = _stream_file(tmp, f"stream-{events}.ndjson", events, 42)
        r.ours(source, batch)()  # warm-up: bytecode cache, file cache
        r.raw(source, batch)()
        r.reset_cpu()
        ours, limit = _median_pair(f"replay --batch {batch}, {events:,} events, ev/s", repeat,
                                   r.ours(source, batch), r.raw(source, batch), ("ours", "raw"))
        goal = GOALS[f"replay{batch}"]
        rows.append(f"| `replay --batch {batch}`, {events // 1000}k events | {ours:,.0f}/s | raw loop: "
                    f"{limit:,.0f}/s | **{ours / limit:.2f}** (CPU {r.cpu_ratio():.2f}) | ≥ {goal} |")


def bench_declared_ratios(tmp: Path, repeat: int, rows: list[str]) -> None:
    """The replay ratios for a declared type of the material types' size (``_declared.py``: ``item.*``
    keyed by itemId, its consumer a plugin on RevisionTable) against the raw loop on the same events."""
    import _declared

    saved = dict(bench_replay.ENV)
    bench_replay.ENV.update(DELIVERY_PLUGINS="_declared", PYTHONPATH=os.pathsep.join(
        filter(None, [str(HERE), saved.get("PYTHONPATH", "")])))
    extra = ("--key", "itemId", "--published", _declared.PUBLISHED)
    r = Replay(tmp)
    try:
        for batch, events in ((1, 10_000), (100, 50_000)):
            source = tmp / f"declared-{events}.ndjson"
            source.write_bytes(_stream.ndjson([_declared.declared(e) for e in _stream.envelopes(events, seed=42)]))
            r.ours(source, batch, consumer="items")()  # warm-up
            r.raw(source, batch, extra=extra)()
            r.reset_cpu()
            ours, limit = _median_pair(f"replay --batch {batch}, declared type, {events:,} events, ev/s", repeat,
                                       r.ours(source, batch, consumer="items"), r.raw(source, batch, extra=extra),
                                       ("ours", "raw"))
            goal = GOALS[f"replay{batch}"]
            rows.append(f"| `replay --batch {batch}`, declared type, {events // 1000}k events | {ours:,.0f}/s | "
                        f"raw loop: {limit:,.0f}/s | **{ours / limit:.2f}** (CPU {r.cpu_ratio():.2f}) | ≥ {goal} |")
    finally:
        bench_replay.ENV.clear()
        bench_replay.ENV.update(saved)


def bench_growth(tmp: Path, repeat: int, receipts: int, curve: list[int], rows: list[str], ids: str) -> None:
    r = Replay(tmp)
    past, _, new = ids.partition(":")
    new = new or past
    source = _stream_file(tmp, f"chunk-{new}.ndjson", 50_000, 43, new)
    counts = sorted(set(curve) | {receipts})
    empty_ours = empty_raw = 0.0
    for n in counts:
        if n == 0:
            continue
        print(f"  prefilling {n:,} receipts, {ids} eventIds ...", flush=True)
        template = tmp / f"full-{n}.db"
        started = time.perf_counter()
        prefill_store(r.command, template, n, past)
        print(f"  made in {time.perf_counter() - started:.0f} s, {template.stat().st_size / 1e6:,.0f} MB", flush=True)
        empty, full = _median_pair(f"replay --batch 100 of 50k, {ids} ids: empty vs {n:,} receipts, ev/s", repeat,
                                   r.ours(source, 100), r.ours(source, 100, template), ("empty", "full"))
        empty_ours = empty_ours or empty
        line = f"  curve {ids} {n:>10,}: ours {full:,.0f}/s ({full / empty:.2f} of empty)"
        if n in curve:
            raw_template = tmp / f"raw-full-{n}.db"
            prefill_raw(raw_template, n, past)
            raw_empty, raw_full = _median_pair(f"raw loop, {ids} ids: empty vs {n:,} receipts, ev/s", repeat,
                                               r.raw(source, 100), r.raw(source, 100, raw_template),
                                               ("empty", "full"))
            empty_raw = empty_raw or raw_empty
            line += f"; raw loop {raw_full:,.0f}/s ({raw_full / raw_empty:.2f} of empty)"
            raw_template.unlink()
        print(line, flush=True)
        if n == receipts:
            named = f"{_KIND[past]} ({past}) eventIds" if past == new else \
                f"{_KIND[past]} ({past}) eventIds there, {_KIND[new]} ({new}) replayed"
            rows.append(f"| `replay --batch 100`, 50k events into {n / 1e6:g}M receipts, {named} | "
                        f"{full:,.0f}/s | "
                        f"the same into an empty database: {empty:,.0f}/s | **{full / empty:.2f}** | "
                        f"≥ {GOALS['growth']} |")
        template.unlink()


RUN_RATE = re.compile(r"first delivery to last ack [0-9.]+s, [0-9.]+s busy \(([0-9]+)/s\)")


def _tree_hwm(pid: int, peaks: dict[int, int]) -> None:
    """Record VmHWM (peak RSS, KiB) of *pid* and its children."""
    pids = [pid]
    with_children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        pids += [int(p) for p in with_children.read_text().split()]
    except OSError:
        return
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[p] = max(peaks.get(p, 0), int(line.split()[1]))
        except OSError:
            pass


def _broker_pid() -> str | None:
    """The pid of the local RabbitMQ (beam.smp), if any."""
    found = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True, check=False).stdout.split()
    return found[0] if found else None


def _cpu_of(pid: str | None) -> float:
    """CPU seconds used so far by process *pid*, 0 if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_ours(url: str, topo: object, workdir: Path, rss: list[float]) -> float:
    db = workdir / f"bench-{uuid.uuid4().hex[:8]}.db"
    argv = [str(Path(bench_replay._command())), "run", "--consumer", "catalog", "--db", str(db),
            "--amqp-url", url, "--exchange", topo.exchange, "--queue-prefix", topo.prefix,  # type: ignore[attr-defined]
            "--exit-when-idle", "1", "--log-level", "info"]
    err = workdir / "run.err"
    peaks: dict[int, int] = {}
    with err.open("wb") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, env=bench_replay.ENV)
        while proc.poll() is None:
            _tree_hwm(proc.pid, peaks)
            time.sleep(0.05)
    text = err.read_text(errors="replace")
    match = RUN_RATE.search(text)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"run failed (exit {proc.returncode}):\n{text[-2000:]}")
    rss.append(sum(peaks.values()) / 1024)
    return float(match.group(1))


def bench_run_ratio(repeat: int, url: str, rows: list[str]) -> None:
    import bench_run

    from delivery_consumer.amqp.topology import Topology
    from delivery_consumer.service.settings import RunConfig

    prefetch, batch, messages = RunConfig.prefetch, RunConfig.batch, 20_000
    bodies = {ids: bench_run.make_events(messages, ids) for ids in ("v4", "v7")}
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    topo = Topology(consumer="catalog", binding_keys=("material.*",), exchange=f"{prefix}.events", prefix=prefix)
    rss: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:

            cpu: dict[str, list[tuple[float, float]]] = {}
            broker_pid = _broker_pid()

            def seeded(fn: Callable[[], float], name: str, ids: str = "v4") -> Callable[[], float]:
                def go() -> float:
                    bench_run.delete_queues(url, topo)
                    bench_run.seed(url, topo, bodies[ids])
                    before, broker = resource.getrusage(resource.RUSAGE_CHILDREN), _cpu_of(broker_pid)
                    rate = fn()
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                    cpu.setdefault(name, []).append((used, _cpu_of(broker_pid) - broker))
                    return rate
                return go

            def least(threaded: bool, ids: str = "v4") -> Callable[[], float]:
                return seeded(lambda: bench_run.bare_sql(url, topo, messages, prefetch, batch, Path(tmp),
                                                         threaded=threaded),
                              f"bare+sql{' thread' if threaded else ''}{' v7' if ids == 'v7' else ''}", ids)

            ours, ours7, bare, inline, threaded, inline7 = _medians(
                f"run (prefetch {prefetch}, batch {batch}) with random and time-ordered eventIds, bare pika,"
                f" bare pika + raw SQL (inline, in a thread; inline with time-ordered ids), {messages:,} msgs, msg/s",
                repeat,
                {"run": seeded(lambda: run_ours(url, topo, Path(tmp), rss), "run"),
                 "run v7": seeded(lambda: run_ours(url, topo, Path(tmp), rss), "run v7", "v7"),
                 "bare": seeded(lambda: bench_run.bare(url, topo, messages, prefetch, batch), "bare"),
                 "bare+sql": least(False), "bare+sql thread": least(True), "bare+sql v7": least(False, "v7")})
    finally:
        bench_run.delete_queues(url, topo)
    print(f"  run peak RSS (both processes), MiB: {' '.join(f'{x:.0f}' for x in rss)}")
    print("  CPU per round, s, consumer (its start-up included) / broker: " + " | ".join(
        f"{name} " + " ".join(f"{used:.2f}/{broker:.2f}" for used, broker in rounds)
        for name, rounds in cpu.items()), flush=True)
    rows.append(f"| `run` (prefetch {prefetch}, batch {batch}), quorum queue, {messages // 1000}k messages | "
                f"{ours:,.0f}/s | bare pika acking `multiple` every {batch}: {bare:,.0f}/s | **{ours / bare:.2f}** | "
                f"≥ {GOALS['run']} |")
    least_rate = max(inline, threaded)
    rows.append(f"| bare pika + the raw loop's SQL committed before each ack (inline / in a thread) | "
                f"{inline:,.0f} / {threaded:,.0f}/s | bare pika: {bare:,.0f}/s | {least_rate / bare:.2f} | |")
    rows.append(f"| `run` against the better of those (the least work the job needs) | {ours:,.0f}/s | "
                f"{least_rate:,.0f}/s | **{ours / least_rate:.2f}** | |")
    rows.append(f"| `run`, time-ordered (v7) eventIds, against bare pika | {ours7:,.0f}/s | bare pika: {bare:,.0f}/s | "
                f"**{ours7 / bare:.2f}** | ≥ {GOALS['run']} |")
    rows.append(f"| `run`, v7 eventIds, against bare pika + raw SQL with v7 eventIds (inline) | {ours7:,.0f}/s | "
                f"{inline7:,.0f}/s | {ours7 / inline7:.2f} | |")
    rows.append(f"| peak RSS of `run` (both processes), prefetch {prefetch} | {statistics.median(rss):.0f} MiB | | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="replay,declared,growth,run")
    parser.add_argument("--receipts", type=int, default=5_000_000)
    parser.add_argument("--curve", default="", help="comma-separated receipt counts (ours and the raw loop)")
    parser.add_argument("--ids", default="v4,v7", help="the growth pair's eventIds: v4 (random), v7 (time-ordered)")
    parser.add_argument("--amqp-url", default=os.environ.get("DELIVERY_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"))
    args = parser.parse_args()
    only = set(args.only.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="dc-hotpath-"))
    bench_replay.ENV = bench_replay._env(tmp)
    load = os.getloadavg()[0]
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, {platform.machine()}, "
          f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, WAL + synchronous=FULL, "
          f"load average {load:.1f} at start", flush=True)
    rows = ["| what | ours | limit | ratio | goal |", "|---|---:|---:|---:|---:|"]
    try:
        if "replay" in only:
            bench_replay_ratios(tmp, args.repeat, rows)
        if "declared" in only:
            bench_declared_ratios(tmp, args.repeat, rows)
        if "growth" in only:
            curve = [int(float(x)) for x in args.curve.split(",") if x]
            for ids in args.ids.split(","):
                bench_growth(tmp, args.repeat, args.receipts, curve, rows, ids)
        if "run" in only:
            bench_run_ratio(args.repeat, args.amqp_url, rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
