"""Draw one trace as an SVG waterfall from spans written as JSON lines.

    python bench/render_trace.py SPANS.jsonl OUT.svg|OUT.png [--trace TRACE_ID]

*SPANS.jsonl*: the SDK's ``span.to_json()`` one a line, what
``OTEL_TRACES_EXPORTER=jsonl`` writes (``TRACING_TEST_KEEP=path`` keeps the
file of tests/broker/test_tracing_broker.py). The trace is the one of the earliest
root span (or ``--trace``). Rows: every span of the trace in start order,
each event's apply followed by the batch it is linked to (another trace,
drawn hatched) and that batch's phases. One linear time axis from the
trace's start; a bar is at least 3 px wide and says its duration. A
``.png`` is drawn with matplotlib (not a dependency: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

import orjson

ROW, LEFT, WIDTH, TOP = 22, 430, 760, 40
COLOURS = {"producer": "#4e79a7", "updated": "#59a14f", "recorded": "#59a14f", "transient": "#e15759",
           "batch": "#bab0ac", "phase": "#d4cfcb", "other": "#f28e2b"}


def _ns(text: str) -> int:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int(when.timestamp() * 1_000_000_000)


def load(path: Path) -> list[dict[str, Any]]:
    spans = [orjson.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    for span in spans:
        span["start"], span["end"] = _ns(span["start_time"]), _ns(span["end_time"])
    return spans


def rows_of(spans: list[dict[str, Any]], trace_id: str | None) -> list[tuple[int, dict[str, Any], str]]:
    """(indent, span, colour) rows of one trace with the batches its spans link to."""
    if trace_id is None:
        roots = sorted((s for s in spans if s["parent_id"] is None and " batch" not in s["name"]
                        and not s["links"]), key=lambda s: s["start"])
        trace_id = roots[0]["context"]["trace_id"]
    by_id = {s["context"]["span_id"]: s for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if span["parent_id"] is not None:
            children.setdefault(span["parent_id"], []).append(span)
    rows: list[tuple[int, dict[str, Any], str]] = []
    shown: set[str] = set()

    def colour(span: dict[str, Any]) -> str:
        result = str(span["attributes"].get("delivery_consumer.result", ""))
        if result.startswith("transient"):
            return COLOURS["transient"]
        return COLOURS.get(result, COLOURS["other"] if result else COLOURS["producer"])

    def visit(span: dict[str, Any], depth: int) -> None:
        rows.append((depth, span, colour(span)))
        for link in span["links"]:
            batch = by_id.get(link["context"]["span_id"])
            if batch is None or batch["context"]["span_id"] in shown:
                continue
            shown.add(batch["context"]["span_id"])
            rows.append((depth + 1, batch, COLOURS["batch"]))
            for phase in sorted(children.get(batch["context"]["span_id"], []), key=lambda s: s["start"]):
                rows.append((depth + 2, phase, COLOURS["phase"]))
        for child in sorted(children.get(span["context"]["span_id"], []), key=lambda s: (s["start"], s["name"])):
            visit(child, depth + 1)

    for root in sorted((s for s in spans if s["context"]["trace_id"] == trace_id and s["parent_id"] not in by_id),
                       key=lambda s: s["start"]):
        visit(root, 0)
    return rows


def svg(rows: list[tuple[int, dict[str, Any], str]]) -> str:
    start = min(span["start"] for _, span, _ in rows)
    end = max(span["end"] for _, span, _ in rows)
    scale = WIDTH / max(end - start, 1)
    height = TOP + ROW * len(rows) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 110}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           '<defs><pattern id="h" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
           '<rect width="3" height="6" fill="#bab0ac"/></pattern></defs>',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="8" y="20" font-weight="bold">one trace: {(end - start) / 1e9:.2f} s from the producer\'s '
           'request to the last apply (hatched: the batch an event is linked to, its own trace)</text>']
    for second in range(int((end - start) / 1e9) + 1):
        x = LEFT + second * 1e9 * scale
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{height - 24}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{height - 10}" fill="#888" text-anchor="middle">{second}s</text>')
    for i, (depth, span, fill) in enumerate(rows):
        y = TOP + i * ROW
        attributes = span["attributes"]
        label = span["name"]
        if "delivery_consumer.result" in attributes and " apply" in label:
            label += f" #{attributes.get('delivery_consumer.attempt', '?')}: {attributes['delivery_consumer.result']}"
        out.append(f'<text x="{8 + 14 * depth}" y="{y + 14}">{escape(label)}</text>')
        x = LEFT + (span["start"] - start) * scale
        w = max(3.0, (span["end"] - span["start"]) * scale)
        pattern = "url(#h)" if fill == COLOURS["batch"] else fill
        out.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW - 6}" fill="{pattern}" rx="2"/>')
        ms = (span["end"] - span["start"]) / 1e6
        out.append(f'<text x="{x + w + 4:.1f}" y="{y + 14}" fill="#555">{ms:.1f} ms</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def png(rows: list[tuple[int, dict[str, Any], str]], out: Path) -> None:
    """The same waterfall drawn with matplotlib (``pip install matplotlib``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(span["start"] for _, span, _ in rows)
    end = max(span["end"] for _, span, _ in rows)
    fig, ax = plt.subplots(figsize=(13, 0.28 * len(rows) + 1.2), dpi=110)
    floor = (end - start) / 1e9 / 400  # the shortest bar drawn: a 400th of the axis
    labels = []
    for i, (depth, span, fill) in enumerate(rows):
        attributes = span["attributes"]
        label = span["name"]
        if "delivery_consumer.result" in attributes and " apply" in label:
            label += f" #{attributes.get('delivery_consumer.attempt', '?')}: {attributes['delivery_consumer.result']}"
        labels.append("    " * depth + label)
        left, width = (span["start"] - start) / 1e9, (span["end"] - span["start"]) / 1e9
        batch = fill == COLOURS["batch"]
        ax.barh(i, max(width, floor), left=left, height=0.6, color="white" if batch else fill,
                edgecolor=fill if batch else "none", hatch="////" if batch else None)
        ax.text(left + max(width, floor) + floor, i, f"{width * 1000:.1f} ms", va="center", fontsize=7, color="#555")
    ax.set_yticks(range(len(rows)), labels, fontsize=8, family="monospace")
    ax.tick_params(axis="y", pad=4.9 * max(len(label) for label in labels), length=0)
    for tick in ax.get_yticklabels():
        tick.set_horizontalalignment("left")  # the indentation shows the parents
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the producer's request began")
    ax.set_title(f"one trace: {(end - start) / 1e9:.2f} s from the producer's request to the last apply "
                 "(hatched: the batch an event is linked to, in its own trace)", fontsize=9)
    ax.grid(axis="x", color="#eee")
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spans", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--trace", help="trace id as the file writes it (0x...)")
    args = parser.parse_args()
    rows = rows_of(load(args.spans), args.trace)
    if args.out.suffix == ".png":
        png(rows, args.out)
    else:
        args.out.write_text(svg(rows), "utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
