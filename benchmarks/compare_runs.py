"""Summarise recipe runs side by side from their metrics.jsonl files (a markdown table).

python -m benchmarks.compare_runs ddp=outputs/ddp fsdp2=outputs/fsdp2 --skip 2 --baseline ddp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def load(path: str) -> list[dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="label=output_dir")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the step-time median")
    p.add_argument("--baseline", default=None, help="label whose step time and first loss are the reference")
    p.add_argument("--title", default="Runs")
    args = p.parse_args(argv)
    runs = {}
    for item in args.runs:
        label, _, path = item.partition("=")
        runs[label] = load(path)
    base = args.baseline or next(iter(runs))
    med = {k: statistics.median(r["step_time_s"] for r in v[args.skip :] or v) for k, v in runs.items()}
    lines = [
        f"### {args.title}",
        "",
        "| run | steps | first-step loss | vs baseline | last loss | median step time (s) | speedup vs baseline "
        "| attention imbalance before -> after | MiB sent per rank per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, recs in runs.items():
        first = recs[0]["loss"]
        ref = runs[base][0]["loss"]
        imb_b = statistics.mean(r["imbalance_before"] for r in recs)
        imb_a = statistics.mean(r["imbalance_after"] for r in recs)
        mib = statistics.mean(statistics.mean(r["bytes_sent"]) for r in recs) / 2**20
        lines.append(
            f"| {label} | {len(recs)} | {first:.5f} | {(first - ref) / abs(ref):+.2e} | {recs[-1]['loss']:.4f} | "
            f"{med[label]:.3f} | {med[base] / med[label]:.2f}x | {imb_b:.2f} -> {imb_a:.2f} | {mib:.1f} |"
        )
    print("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
