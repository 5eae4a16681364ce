"""Build a measured split table (runtime/attention/split_table.py) from split sweeps.

    python benchmarks/attention.py --json --no-fp16 --no-defer --batches 1,2,4,8,16,32 \\
        --lengths 4096,8192,16384,32768,65536,131072 --splits 0,wave,1,2,3,4,6,8,11,12,16,23,24,32,48 > r1.jsonl
    (two or more such rounds, the --splits order reversed in every other)
    python benchmarks/split_table.py r1.jsonl r2.jsonl ... --measured "2026-12-06, H100, tree abc1234" [--write]
    zerodram bench split-table ...

Per (B, L) and forced count (`fp2_ms_*-s<count>`: the counts a sweep timed with their repetitions
interleaved), the median over the rounds; the table takes the fastest count, or the fewest splits
among those within `--margin` of it (fewer CTAs to merge where the timings cannot tell them apart).
The rows must come from one GPU model and one kernel build (`device`, `split_key`, `Hkv`) and cover
a full grid of B and L. Prints each grid point against the wave model's count (`wave_splits`,
where the sweep timed `wave`); `--write` merges the table into the package's file for the GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict

PAGE = 64  # the page size of rows that do not record one (benchmarks/attention.py's default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rounds", nargs="+", help="JSON-line files of benchmarks/attention.py --json sweeps")
    p.add_argument("--margin", type=float, default=0.01, help="counts within this fraction of the fastest tie")
    p.add_argument("--measured", required=True, help="date, machine, tree and command, kept in the table")
    p.add_argument("--write", action="store_true", help="merge the table into the package's tables (or --dir)")
    p.add_argument("--dir", default=None, help="the tables' folder (default: runtime/attention/split_tables/)")
    p.add_argument(
        "--kernel", default=None,
        help="the kernel build's split key, for rows that lack `split_key` (sweeps from before it was recorded)",
    )  # fmt: skip


def best_counts(rows: list[dict], margin: float) -> dict[tuple[int, int], tuple[int, float, dict[int, float]]]:
    """{(B, L): (count, its median ms, {count: median ms})} over the rows (rounds) of each case."""
    times: dict[tuple[int, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for k, v in r.items():
            if m := re.fullmatch(r"fp2_ms_(.*)-s(\d+)", k):
                times[(r["B"], r["L"])][int(m.group(2))].append(v)
    out = {}
    for case, by_count in times.items():
        med = {s: statistics.median(v) for s, v in by_count.items()}
        fastest = min(med.values())
        count = min(s for s, ms in med.items() if ms <= fastest * (1 + margin))
        out[case] = (count, med[count], med)
    return out


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from zerodram.runtime.attention.split_table import TABLE_DIR, SplitTable, merge_table

    rows = []
    for path in args.rounds:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.startswith("{")]
    if args.kernel:
        if any(r.get("split_key", args.kernel) != args.kernel for r in rows):
            print("split-table: --kernel differs from the rows' own split_key", file=sys.stderr)
            return 2
        rows = [r | {"split_key": args.kernel} for r in rows]
    if args.margin < 0:
        print(f"split-table: --margin must be >= 0, got {args.margin}", file=sys.stderr)
        return 2
    variants = {m.group(1) for r in rows for k in r if (m := re.fullmatch(r"fp2_ms_(.*)-s\d+", k))}
    if len(variants) != 1:
        # a row records one split_key: a sweep over several --configs / --v-layouts mixes builds
        print(f"split-table: the rows must time one kernel variant, got {sorted(variants)}", file=sys.stderr)
        return 2
    # rows from before the page size was recorded timed pages of PAGE tokens
    builds = {(r.get("device"), r.get("split_key"), r.get("Hkv"), r.get("P", PAGE)) for r in rows}
    if len(builds) != 1 or None in next(iter(builds)):
        print(f"split-table: the rows must come from one GPU, kernel build, Hkv and page size, got "
              f"{sorted(map(str, builds))}", file=sys.stderr)  # fmt: skip
        return 2
    device, key, hkv, page = next(iter(builds))
    best = best_counts(rows, args.margin)
    batches, lengths = sorted({b for b, _ in best}), sorted({n for _, n in best})
    missing = [(b, n) for b in batches for n in lengths if (b, n) not in best]
    if missing:
        print(f"split-table: no forced counts timed at (B, L) {missing}: the grid must be full", file=sys.stderr)
        return 2
    wave: dict[tuple[int, int], tuple[int | None, list[float]]] = {}  # the wave model's count, its times
    for r in rows:
        w = wave.setdefault((r["B"], r["L"]), (r.get("wave_splits"), []))
        for k, v in r.items():
            # the "-wave" count, or the plan's own (untagged) where the wave model made it
            plan_was_wave = r.get("plan_source", "wave") == "wave" and not re.search(r"-(s\d+|wave)$", k)
            if k.startswith("fp2_ms_") and (k.endswith("-wave") or plan_was_wave):
                w[1].append(v)
    print(f"# {device}, {key}, Hkv {hkv}, page {page}: {len(rows)} rows")
    print(f"{'B':>3} {'L':>7} {'count':>5} {'us':>7} {'wave':>5} {'us':>7} {'wave/table':>10}")
    for b, n in sorted(best):
        count, ms, med = best[(b, n)]
        w, wtimes = wave[(b, n)]
        wms = statistics.median(wtimes) if wtimes else med.get(w, float("nan"))
        print(f"{b:>3} {n:>7} {count:>5} {1e3 * ms:>7.1f} {w or '-':>5} {1e3 * wms:>7.1f} {wms / ms:>9.3f}x")
    table = SplitTable(device, key, hkv, page, args.measured, {b: {n: best[(b, n)][0] for n in lengths} for b in batches})
    if args.write:
        print(f"written: {merge_table(table, Path(args.dir) if args.dir else TABLE_DIR)}")
    return 0


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
