"""Benchmark: how long consumption stops when something happens to a three-node RabbitMQ cluster.

Starts the cluster of private nodes of the tests (tests/clusterkit.py: three nodes
on free ports, never the shared broker), then plays each scenario of
``tests/cluster/test_cluster_scenarios.py`` ``--repeat`` times, each in a fresh
namespace: a producer's outbox dispatched by ``dispatch``, the catalog and counter
consumers' ``run`` processes, every process given the three addresses, and the
fault (a node killed, the queue's leader killed, quorum lost for a few seconds,
rolling restarts with and without drain, a partitioned consumer with standbys
during a node kill). Every play checks its ledger like the test does.

Printed per scenario (min / median / max over the repeats):

* **gap**: the longest pause between two receipts of one consumer from the fault
  on (the worse of the two consumers): the consumption the fault cost, end to
  end (the producer's failover included);
* **resumed**: from the fault (for the quorum loss: from the moment both nodes
  were back) to the first receipt after it.

A failed play is reported with its reason and left out of the figures. Say what
else ran on the machine beside any figure you quote.

    python bench/bench_cluster.py [--repeat 3] [--scenarios kill-clients-node,kill-leader]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from brokerkit import rabbitmq_sbin  # noqa: E402  (the test kits live in tests/)
from clusterkit import SCENARIOS, ClusterNamespace, Outcome, RabbitCluster, play  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--failures", type=Path, help="append each failed play's whole message (its logs) here")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    args = parser.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    sbin = rabbitmq_sbin()
    if sbin is None:
        print("rabbitmq-server is not installed (set DELIVERY_RABBITMQ_SBIN)", file=sys.stderr)
        return 2
    results: dict[str, list[Outcome]] = {n: [] for n in names}
    failures: dict[str, list[str]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        cluster = RabbitCluster(sbin, Path(tmp) / "cluster")
        try:
            began = time.monotonic()
            cluster.start()
            print(f"cluster up in {time.monotonic() - began:.1f}s", flush=True)
            for round_ in range(args.repeat):
                for name in names:
                    work = Path(tmp) / f"{name}-{round_}"
                    work.mkdir()
                    ns = ClusterNamespace(cluster.nodes[0].url, f"b{uuid.uuid4().hex[:10]}", work, cluster=cluster)
                    began = time.monotonic()
                    try:
                        outcome = play(cluster, ns, name)
                    except (AssertionError, OSError) as exc:
                        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else repr(exc)
                        failures[name].append(reason)
                        if args.failures:
                            with args.failures.open("a") as out:
                                out.write(f"=== {name} #{round_ + 1}\n{exc}\n")
                        print(f"{name} #{round_ + 1}: FAILED ({time.monotonic() - began:.0f}s): {reason}", flush=True)
                        continue
                    finally:
                        ns.delete()
                    results[name].append(outcome)
                    print(f"#{round_ + 1} {outcome.line()} ({time.monotonic() - began:.0f}s)", flush=True)
        finally:
            cluster.stop()
    print()
    print("| scenario | plays | gap min / median / max (s) | resumed min / median / max (s) | failed |")
    print("|---|---|---|---|---|")
    for name in names:
        outs = results[name]
        gaps = [max(o.gap.values()) for o in outs]
        resumed = [max(o.resumed.values()) for o in outs]
        print(f"| {name} | {len(outs)} | {_spread(gaps)} | {_spread(resumed)} | {len(failures[name])} |")
    for name, reasons in failures.items():
        for reason in reasons:
            print(f"failed {name}: {reason}")
    return 1 if any(failures.values()) else 0


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


if __name__ == "__main__":
    sys.exit(main())
