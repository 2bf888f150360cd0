"""Benchmark: the outbox dispatcher against publishing directly.

In one run, on the same broker and the same quorum queue (deleted and
declared again before every measurement), the same 20,000 events:

* **one confirm per message** -- pika ``BlockingConnection`` with
  ``confirm_delivery()``: each ``basic_publish`` waits for its confirm;
* **pipelined publish** -- ``amqp.publisher.Publisher.publish`` of all the events
  (window 1000), which is what ``delivery-consumer publish`` does once it
  has read and validated its files;
* **dispatch** -- ``outbox.Dispatcher`` draining an outbox of the same
  events: per batch, a lease transaction, a pipelined publish and a mark
  transaction (WAL + synchronous=FULL), for several ``--batch`` sizes with
  two batches in flight (the default), and with one (``--depth 1``: each
  batch settled before the next is sent).

The library figures run in this process on an already open connection and
time only the publishing work. The command figures time whole processes:
``delivery-consumer publish FILE`` (start-up, reading and validating the
file) against ``delivery-consumer dispatch --exit-when-idle`` with its
default batch (start-up, and its idle wait, reported separately). Ratios are to pipelined publish;
the goal is dispatch >= 0.7 of it. Best of ``--repeat`` interleaved rounds,
and the *paired* ratio: the median over rounds of the ratio between figures
measured seconds apart in the same round (the machine is shared: a round
that coincides with someone else's load says little, and load drifts more
slowly than a round). One confirm per message is slow and steady and runs
in the first round only. A measurement disturbed by a broker restart is
done again.

    python bench/bench_dispatch.py [--messages 20000] [--repeat 3] [--batches 100,500,1000,2000]
    python bench/bench_dispatch.py --ab-depth 10   # only depth 1 vs 2 at batch 1000, in adjacent pairs
    python bench/bench_dispatch.py --ab-ref main --pairs 5   # this code against another commit's, same work

``--ab-ref REF`` exports the package at git commit REF (``git archive``) and
times the library dispatcher (batch 1000, depth 2) of both versions on the
same events, each in a fresh process with its own producer database made by
its own code, in adjacent pairs (order alternating): it prints
``this / REF`` throughput per pair and the median. The limit of a change
that adds bookkeeping is 1.0 (no slower), within the noise the pairs show.
With ``--db-only`` the publisher is an in-process stand-in that confirms
every message at once, and the figure is the dispatcher's own **CPU time**
(claim and mark transactions, per-row checks): both versions make the same
commits, so their fsync waits, which the shared disk makes noisy, are left
out.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pika

from delivery_consumer import outbox
from delivery_consumer.amqp.publisher import Publisher, StreamPublisher, properties
from delivery_consumer.amqp.topology import Topology
from delivery_consumer.model.deliveries import OutMessage, PublishResult
from delivery_consumer.model.errors import BrokerError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_run import bench_topology, broker_parser, delete_queues, make_events

IDLE_S = 0.2
DISPATCH_SPAN = re.compile(r"first claim to last mark ([0-9.]+)s")


def messages(bodies: list[bytes], exchange: str) -> list[OutMessage]:
    out = []
    for body in bodies:
        obj = orjson.loads(body)
        out.append(OutMessage(routing_key=obj["type"], body=body, exchange=exchange, message_id=obj["eventId"]))
    return out


def reset(url: str, topo: Topology) -> None:
    """Delete the queues and exchange, then declare them again (an empty queue for each figure)."""
    delete_queues(url, topo)
    with Publisher(url, topologies=[topo]) as pub:
        pub.connect()


def queued(url: str, topo: Topology) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(topo.queue, passive=True).method.message_count)
    finally:
        conn.close()


def one_confirm_each(url: str, msgs: list[OutMessage]) -> float:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    started = time.perf_counter()
    for msg in msgs:
        ch.basic_publish(msg.exchange, msg.routing_key, msg.body, properties(msg), mandatory=True)
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


def pipelined(url: str, msgs: list[OutMessage]) -> float:
    with Publisher(url, window=1000) as pub:
        pub.connect()
        started = time.perf_counter()
        results = pub.publish(msgs)
        elapsed = time.perf_counter() - started
    if not all(r.ok for r in results):
        raise SystemExit("pipelined publish: some messages were not confirmed")
    return elapsed


def _drain(db: Path | str, publisher: Any, config: outbox.DispatchConfig, clock: Callable[[], float]) -> float:
    """Time (by *clock*) the dispatcher takes to publish every row of the outbox at *db* through *publisher*."""
    conn = outbox.open_db(db)
    try:
        dispatcher = outbox.Dispatcher(conn, publisher, config)
        started = clock()
        while dispatcher.step():
            pass
        elapsed = clock() - started
        left = outbox.unpublished(conn)
    finally:
        conn.close()
    if left:
        raise SystemExit(f"dispatch: {left} rows left unpublished")
    return elapsed


def dispatched(url: str, exchange: str, db: Path | str, batch: int, depth: int) -> float:
    """Drain the outbox at *db* (a SQLite file or a PostgreSQL URL) with the dispatcher and the broker."""
    config = outbox.DispatchConfig(exchange=exchange, batch=batch, depth=depth)
    with StreamPublisher(url, window=min(1000, batch), timeout_s=config.publish_timeout_s) as pub:
        pub.connect()
        return _drain(db, pub, config, time.perf_counter)


def command(args: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{args[1]} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed, proc.stderr


class Disturbed(Exception):
    """The broker went away during a measurement (someone restarted it)."""


def measure(url: str, topo: Topology, n: int, name: str, fn: Callable[[], float], tries: int = 3) -> float:
    """One measurement on an empty queue; redone when a broker restart disturbed it
    (the broker is shared; a restart makes a figure meaningless, not wrong)."""
    for attempt in range(1, tries + 1):
        try:
            reset(url, topo)
            seconds = fn()
            got = queued(url, topo)
            if got != n:
                raise Disturbed(f"{got} messages in the queue, expected {n}")
            return seconds
        except (Disturbed, BrokerError, pika.exceptions.AMQPError, SystemExit) as exc:
            if attempt == tries:
                raise
            print(f"  {name}: disturbed ({str(exc)[:80] or type(exc).__name__}); waiting for the broker", flush=True)
            wait_for_broker(url)
    raise AssertionError("unreachable")


def wait_for_broker(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(2)
        try:
            pika.BlockingConnection(pika.URLParameters(url)).close()
            return
        except pika.exceptions.AMQPError:
            if time.monotonic() > deadline:
                raise


def make_outbox(path: Path, bodies: list[bytes]) -> None:
    conn = outbox.connect(path)
    with outbox.transaction(conn):
        for body in bodies:
            outbox.enqueue(conn, body)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def export(ref: str, into: Path) -> Path:
    """The package as it is at git commit *ref*, unpacked under *into*."""
    repo = Path(__file__).resolve().parent.parent
    tar = subprocess.run(["git", "-C", str(repo), "archive", ref, "delivery_consumer", "schemas"],
                         capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into  # envelope.py finds schemas/ beside the package, as in a checkout


def in_process_of(code: Path | None, *args: str) -> str:
    """Run this script's hidden ``--worker`` mode with the package from *code*
    (None: this checkout) first on the path; its stdout."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True, env=env,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"worker {args[0]} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip()


class InstantPublisher:
    """Confirms every message at once (``--db-only``): the dispatcher's own cost alone."""

    def connect(self) -> None:
        pass

    def send(self, messages: list[OutMessage]) -> int:
        return len(messages)

    def wait(self, ticket: int, wake: int) -> bool:
        return True

    def collect(self, ticket: int) -> list[PublishResult]:
        return [PublishResult("confirmed")] * ticket

    def idle(self, seconds: float, wake: int | None = None) -> None:
        pass

    def renew_channel(self) -> None:
        pass


def dispatched_db_only(db: Path) -> float:
    return _drain(db, InstantPublisher(), outbox.DispatchConfig(exchange="x"), time.process_time)


def worker(args: list[str]) -> None:
    """``--worker make DB N`` (an outbox of make_events(N) with this code),
    ``--worker dispatch DB URL EXCHANGE`` (seconds of dispatching it) or
    ``--worker dispatch-db DB`` (the same with :class:`InstantPublisher`)."""
    if args[0] == "make":
        make_outbox(Path(args[1]), make_events(int(args[2])))
    elif args[0] == "dispatch-db":
        print(dispatched_db_only(Path(args[1])))
    else:
        print(dispatched(args[2], args[3], Path(args[1]), 1000, 2))


Side = TypeVar("Side")


def alternating(pairs: int, n: int, order: tuple[Side, Side], new: Side, run: Callable[[Side], float],
                label: Callable[[Side], str]) -> list[float]:
    """*pairs* back-to-back measurements of two sides (*run*: seconds for *n*
    messages), in *order* and then reversed, pair after pair, so that both see
    the same load; prints each pair and returns, per pair, *new*'s rate over
    the other side's."""
    old = order[1] if order[0] == new else order[0]
    first, second = order
    ratios = []
    for i in range(pairs):
        seconds = {side: run(side) for side in (order if i % 2 == 0 else order[::-1])}
        ratios.append(seconds[old] / seconds[new])
        print(f"  pair {i + 1}  {label(first)} {n / seconds[first]:>7.0f} msg/s  {label(second)} "
              f"{n / seconds[second]:>7.0f} msg/s  {label(new)} / {label(old)} {ratios[-1]:.2f}", flush=True)
    return ratios


def ab_ref(url: str, n: int, pairs: int, ref: str, db_only: bool = False) -> None:
    """This code's dispatcher against REF's, measured back to back in fresh processes."""
    topo = bench_topology()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        old = export(ref, work / "ref")
        templates = {"this": work / "this.db", ref: work / "ref.db"}
        in_process_of(None, "make", str(templates["this"]), str(n))
        in_process_of(old, "make", str(templates[ref]), str(n))

        def run(side: str) -> float:
            db = work / f"{uuid.uuid4().hex[:8]}.db"
            shutil.copyfile(templates[side], db)
            code = None if side == "this" else old
            if db_only:
                return float(in_process_of(code, "dispatch-db", str(db)))
            return measure(url, topo, n, side, lambda: float(in_process_of(code, "dispatch", str(db), url,
                                                                            topo.exchange)))

        try:
            ratios = alternating(pairs, n, ("this", ref), "this", run, str)
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError):
                delete_queues(url, topo)
    print(f"\n{dt.datetime.now().isoformat(timespec='minutes')} · {os.cpu_count()} cores · {n} messages · "
          f"batch 1000, depth 2 · {'no broker (instant confirms), CPU time' if db_only else 'quorum queue'} · "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"this / {ref} (limit 1.00): median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
          f"{max(ratios):.2f}, {sum(r >= 1 for r in ratios)} of {pairs} pairs at or above 1")


def ab_depth(url: str, n: int, pairs: int) -> None:
    """depth 2 against depth 1, measured back to back so that both see the same load."""
    topo = bench_topology()
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "outbox-template.db"
        make_outbox(template, make_events(n))

        def run(depth: int) -> float:
            db = Path(tmp) / f"producer-{uuid.uuid4().hex[:8]}.db"
            shutil.copyfile(template, db)
            return measure(url, topo, n, f"depth {depth}", lambda: dispatched(url, topo.exchange, db, 1000, depth))

        try:
            ratios = alternating(pairs, n, (1, 2), 2, run, lambda depth: f"depth {depth}")
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError):
                delete_queues(url, topo)
    print(f"\n{dt.datetime.now().isoformat(timespec='minutes')} · {os.cpu_count()} cores · {n} messages · "
          f"batch 1000 · load average {os.getloadavg()[0]:.1f}")
    print(f"depth 2 / depth 1: median {statistics.median(ratios):.2f}, "
          f"{sum(r > 1 for r in ratios)} of {pairs} pairs in favour of depth 2")


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
        return
    parser = broker_parser(__doc__)
    parser.add_argument("--batches", default="100,500,1000,2000", help="dispatch --batch sizes to measure")
    parser.add_argument("--ab-depth", type=int, default=0, metavar="PAIRS",
                        help="instead: dispatch --depth 1 vs 2 at batch 1000, PAIRS adjacent pairs (order alternating)")
    parser.add_argument("--ab-ref", metavar="REF", help="instead: this code's dispatcher vs git commit REF's")
    parser.add_argument("--pairs", type=int, default=5, help="pairs for --ab-ref")
    parser.add_argument("--db-only", action="store_true", help="--ab-ref without the broker: instant confirms")
    args = parser.parse_args()
    url, n = args.amqp_url, args.messages
    if args.ab_ref:
        ab_ref(url, n, args.pairs, args.ab_ref, args.db_only)
        return
    if args.ab_depth:
        ab_depth(url, n, args.ab_depth)
        return
    batches = [int(b) for b in args.batches.split(",")]
    topo = bench_topology()
    bodies = make_events(n)
    msgs = messages(bodies, topo.exchange)
    cli = [sys.executable, "-m", "delivery_consumer"]
    amqp = ["--amqp-url", url, "--exchange", topo.exchange, "--queue-prefix", topo.prefix]
    best: dict[str, float] = {}  # name -> seconds (lowest)
    rounds: list[dict[str, float]] = []  # per round: name -> seconds
    idle_note = ""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        template = work / "outbox-template.db"
        make_outbox(template, bodies)
        events_file = work / "events.ndjson"
        events_file.write_bytes(b"\n".join(bodies) + b"\n")

        def fresh_db() -> Path:
            db = work / f"producer-{uuid.uuid4().hex[:8]}.db"
            shutil.copyfile(template, db)
            return db

        def dispatch_command() -> float:
            elapsed, err = command([*cli, "dispatch", "--db", str(fresh_db()), *amqp,
                                    "--exit-when-idle", f"{IDLE_S}s", "--poll", "50ms", "--log-level", "info"])
            span = DISPATCH_SPAN.search(err)
            nonlocal idle_note
            if elapsed < best.get("command: dispatch", float("inf")) and span:
                idle_note = f" (in the best run, first claim to last mark took {span.group(1)}s)"
            return elapsed

        modes: list[tuple[str, Callable[[], float]]] = [
            ("one confirm per message (Blocking)", lambda: one_confirm_each(url, msgs)),
            ("pipelined publish (Publisher)", lambda: pipelined(url, msgs)),
            *((f"dispatch --batch {b}", lambda b=b: dispatched(url, topo.exchange, fresh_db(), b, 2))
              for b in batches),
            ("dispatch --batch 1000 --depth 1", lambda: dispatched(url, topo.exchange, fresh_db(), 1000, 1)),
            ("command: publish FILE", lambda: command([*cli, "publish", *amqp, str(events_file)])[0]),
            ("command: dispatch", dispatch_command),
        ]
        try:
            for round_ in range(1, args.repeat + 1):
                rounds.append({})
                for name, fn in modes:
                    if round_ > 1 and name.startswith("one confirm"):
                        continue
                    seconds = measure(url, topo, n, name, fn)
                    best[name] = min(best.get(name, float("inf")), seconds)
                    rounds[-1][name] = seconds
                    print(f"  round {round_}  {name:<36} {n / seconds:>8.0f} msg/s  ({seconds:.2f}s)", flush=True)
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError):
                delete_queues(url, topo)

    def reference(name: str) -> str:
        return "command: publish FILE" if name.startswith("command") else "pipelined publish (Publisher)"

    def paired(name: str) -> float:
        """Median over rounds of (reference's seconds / this mode's seconds) in the same round:
        load on the shared machine drifts slowly, so neighbours in time compare fairly."""
        ratios = [r[reference(name)] / r[name] for r in rounds if name in r and reference(name) in r]
        return statistics.median(ratios) if ratios else float("nan")

    print(f"\n{dt.datetime.now().isoformat(timespec='minutes')} · {os.cpu_count()} cores · {n} messages · "
          f"quorum queue · persistent, mandatory · WAL + synchronous=FULL · {args.repeat} rounds · "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<38} {'best msg/s':>10} {'seconds':>8} {'best ratio':>11} {'paired ratio':>13}")
    for name, _ in modes:
        ratio = best[reference(name)] / best[name]
        print(f"{name:<38} {n / best[name]:>10.0f} {best[name]:>8.2f} {ratio:>11.2f} {paired(name):>13.2f}")
    print(f"ratios: library rows to pipelined publish, command rows to 'command: publish FILE'; paired = median "
          f"over rounds of the ratio within a round. The dispatch command includes {IDLE_S}s of "
          f"--exit-when-idle{idle_note}")


if __name__ == "__main__":
    main()
