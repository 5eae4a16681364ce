"""The table of a same-run A/B (`benchmarks/ab.sh`'s ab.jsonl): one row per case, one column per
variant, each cell the range of a metric over the rounds.

    python benchmarks/ab_report.py OUT/ab.jsonl [--metrics fp2_ms,write1_added_ms] [--keys B,L]
    zerodram bench ab-report ...

ab.sh tags every JSON line a variant's command printed with "variant" and "round". A case is the
line's values of `--keys` (default B and L, the attention benchmark's); cells are "lo-hi" (or one
number where the rounds agree) in the metric's unit times `--scale` (default 1000: ms as us).
Variants appear in the order they first ran (the first is the baseline the others are read
against); a case a variant did not print shows "-". Reads the file only: no GPU, no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("jsonl", help="ab.sh's OUT/ab.jsonl")
    p.add_argument("--metrics", default="fp2_ms", help="comma separated JSON fields, one table each")
    p.add_argument("--keys", default="B,L", help="comma separated JSON fields that name a case")
    p.add_argument("--scale", type=float, default=1000.0, help="multiply the metric (default: ms -> us)")


def tables(lines: list[dict], metrics: list[str], keys: list[str], scale: float) -> dict[str, list[list[str]]]:
    """metric -> rows of cells: a header row ("case", variants...), then one row per case."""
    variants = list(dict.fromkeys(line["variant"] for line in lines))
    out = {}
    for metric in metrics:
        values: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for line in lines:
            if metric in line:
                values[tuple(line.get(k) for k in keys)][line["variant"]].append(float(line[metric]) * scale)
        rows = [["case", *variants]]
        for case in sorted(values, key=lambda c: [(v is None, v) for v in c]):
            cells = [" ".join(f"{k}={v}" for k, v in zip(keys, case, strict=True))]
            for v in variants:
                got = values[case].get(v)
                if not got:
                    cells.append("-")
                    continue
                lo, hi = f"{min(got):.1f}", f"{max(got):.1f}"
                cells.append(lo if lo == hi else f"{lo}-{hi}")
            rows.append(cells)
        out[metric] = rows
    return out


def run(args: argparse.Namespace) -> int:
    path = Path(args.jsonl)
    if not path.is_file():
        print(f"ab-report: no file {path}", file=sys.stderr)
        return 2
    lines = []
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            print(f"ab-report: {path}:{i}: not JSON ({e.msg})", file=sys.stderr)
            return 2
        if "variant" not in line:
            print(f"ab-report: {path}:{i}: no 'variant' field (not ab.sh's output)", file=sys.stderr)
            return 2
        lines.append(line)
    for metric, rows in tables(lines, args.metrics.split(","), args.keys.split(","), args.scale).items():
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        print(f"\n{metric} x {args.scale:g}, range over rounds ({path})")
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    return 0


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
