"""Parsing cost of declared event types: the material types against a declared type of the same size.

    python bench/bench_types.py [--events 20000] [--repeat 7] [--previous REV]

Parses the benchmark stream (``_stream.py``, material envelopes) and the same
stream turned into a declared type (``order.placed`` keyed by ``orderId``,
``data`` of the same fields and limits), in separate processes, and reports
the CPU time of ``envelope.parse`` per event (best of ``--repeat`` passes:
a busy machine only adds time). ``--previous REV`` also times the material
stream with the package of git revision REV (``git archive`` into a
temporary directory), the code before event types were declared.

Ratios printed as figure / limit: the declared type against the material
types (goal >= 0.9: the per-type dispatch is a dict lookup, and each type's
quick check is generated for its shape), and this checkout's material
parsing against the previous revision's (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import _stream
import orjson

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

_TIMER = """
import sys, time
from pathlib import Path
lines = Path(sys.argv[1]).read_bytes().splitlines()
repeat = int(sys.argv[2])
kind = sys.argv[3]
from delivery_consumer.model.envelope import parse
kwargs = {}
if kind == "declared":
    from delivery_consumer.model.envelope import load_schema
    from delivery_consumer.model.event_types import EventType, EventTypes
    data = load_schema()["properties"]["data"]
    kwargs["types"] = EventTypes([EventType("order.placed", key="orderId", data=data),
                                  EventType("order.changed", key="orderId", data=data)])
elif kind == "material-types":
    from delivery_consumer.model.event_types import MATERIAL
    kwargs["types"] = MATERIAL
for line in lines[:100]:
    parse(line, **kwargs)
best = float("inf")
for _ in range(repeat):
    start = time.process_time()
    for line in lines:
        parse(line, **kwargs)
    best = min(best, time.process_time() - start)
print(best / len(lines) * 1e6)
"""


def _declared(env: dict[str, object]) -> dict[str, object]:
    """The same envelope as a declared order type of the same size."""
    out = dict(env)
    out["type"] = "order.placed" if env["type"] == "material.published" else "order.changed"
    out["orderId"] = out.pop("articleId")
    return out


def _time(path: Path, repeat: int, kind: str, pythonpath: str | None = None) -> float:
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", _TIMER, str(path), str(repeat), kind], env=env,
                          capture_output=True, text=True, check=True, cwd=pythonpath or REPO)
    return float(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--previous", help="a git revision to time the material stream with")
    args = parser.parse_args()
    envelopes = _stream.envelopes(args.events)
    with tempfile.TemporaryDirectory() as tmp:
        material = Path(tmp, "material.ndjson")
        material.write_bytes(b"\n".join(orjson.dumps(e) for e in envelopes))
        declared = Path(tmp, "declared.ndjson")
        declared.write_bytes(b"\n".join(orjson.dumps(_declared(e)) for e in envelopes))
        ours = _time(material, args.repeat, "material-types")
        theirs = _time(declared, args.repeat, "declared")
        print(f"parse, µs/event (CPU, best of {args.repeat}): material {ours:.2f}, declared order type {theirs:.2f}")
        print(f"declared type vs material: {ours / theirs:.2f} (goal >= 0.9)")
        if args.previous:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.previous, "delivery_consumer",
                                      "schemas"], capture_output=True, check=True).stdout
            old = Path(tmp, "previous")
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(old, filter="data")
            before = _time(material, args.repeat, "default", str(old))
            print(f"material, previous {args.previous[:12]}: {before:.2f} µs/event; "
                  f"this checkout vs previous: {before / ours:.2f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
