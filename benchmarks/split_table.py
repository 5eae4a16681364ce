"""Build a measured split table (runtime/attention/split_table.py) from split sweeps.

    zerodram bench split-table --sweep 4 --out DIR [--shape 9x3x64 --page-size 32] [--batches ...]
        [--lengths ...] [--splits ...] [--write]
    python benchmarks/split_table.py r1.jsonl r2.jsonl ... --measured "2026-12-06, H100, tree abc1234" [--write]

`--sweep N` times the rounds first, on this machine's GPU: N runs of `benchmarks/attention.py
--json --no-fp16 --no-defer --reps 20` over the grid and counts given, each in a fresh process,
the B, L and count orders reversed in every other, into DIR/round<i>.jsonl; then builds from them,
with `--measured` composed (date, GPU, driver, tree, the command, DIR) unless given. Without it,
the files named are earlier rounds of that command.

Per (B, L) and forced count (`fp2_ms_*-s<count>`: the counts a sweep timed with their repetitions
interleaved), the median over the rounds; the table takes the fastest count, or the fewest splits
among those within `--margin` of it (fewer CTAs to merge where the timings cannot tell them apart).
The rows must come from one GPU model, kernel build, Hkv and page size (`device`, `split_key`, `Hkv`,
`P`: 64 where a row has none) and cover a full grid of B and L. Prints each grid point against
the wave model's count (`wave_splits`, where the sweep timed `wave`); `--write` merges the table
into the package's file for the GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PAGE = 64  # the page size of rows that do not record one (benchmarks/attention.py's default)
# --sweep's grid and counts by default: the benchmark's shape (the packaged model's lengths: 1024-16384)
GRID_BATCHES = "1,2,4,8,16,32"
GRID_LENGTHS = "4096,8192,16384,32768,65536,131072"
GRID_SPLITS = "0,wave,1,2,3,4,6,8,11,12,16,23,24,32,33,48"  # 33: Hkv 8 x 33 = 264 CTAs, two on each of 132 SMs at B = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("rounds", nargs="*", help="JSON-line files of benchmarks/attention.py --json sweeps")
    p.add_argument("--margin", type=float, default=0.01, help="counts within this fraction of the fastest tie")
    p.add_argument("--measured", default=None, help="date, machine, tree and command, kept in the table")
    p.add_argument("--sweep", type=int, default=0, metavar="N", help="time N rounds on this GPU first (into --out)")
    p.add_argument("--out", default=None, help="--sweep: the folder for the rounds' files")
    p.add_argument("--shape", default=None, metavar="HQxHKVxD", help="--sweep: benchmarks/attention.py's --shape")
    p.add_argument("--page-size", type=int, default=None, help="--sweep: benchmarks/attention.py's --page-size")
    p.add_argument("--batches", default=GRID_BATCHES, help="--sweep: the grid's batch sizes")
    p.add_argument("--lengths", default=GRID_LENGTHS, help="--sweep: the grid's FP2 lengths")
    p.add_argument("--splits", default=GRID_SPLITS, help="--sweep: the counts timed (0: the plan's, wave)")
    p.add_argument("--write", action="store_true", help="merge the table into the package's tables (or --dir)")
    p.add_argument("--dir", default=None, help="the tables' folder (default: runtime/attention/split_tables/)")
    p.add_argument(
        "--replace", action="store_true",
        help="--write: replace the build's whole table even where the new grid drops its batch sizes or lengths",
    )  # fmt: skip
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


def sweep_commands(args: argparse.Namespace) -> list[list[str]]:
    """The --sweep rounds' commands: the grid and counts ascending, then all reversed, in turn."""
    script = str(Path(__file__).with_name("attention.py"))
    base = [sys.executable, script, "--json", "--no-fp16", "--no-defer", "--reps", "20"]
    if args.shape:
        base += ["--shape", args.shape]
    if args.page_size:
        base += ["--page-size", str(args.page_size)]
    cmds = []
    for i in range(args.sweep):
        order = (lambda x: x) if i % 2 == 0 else (lambda x: ",".join(reversed(x.split(","))))
        cmds.append(
            [*base, "--batches", order(args.batches), "--lengths", order(args.lengths), "--splits", order(args.splits)]
        )
    return cmds


def _sweep(args: argparse.Namespace) -> tuple[int, str]:
    """Time the --sweep rounds into --out; (exit status, the composed `measured` text)."""
    import datetime
    import shlex
    import subprocess

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.rounds = []
    for i, cmd in enumerate(sweep_commands(args), 1):
        path = out / f"round{i}.jsonl"
        print(f"# round {i} of {args.sweep}: {shlex.join(cmd[1:])} > {path}", flush=True)
        with open(path, "w") as f:
            rc = subprocess.run(cmd, stdout=f, check=False).returncode
        if rc:
            print(f"split-table: round {i} failed (exit {rc}; {path}): no table built", file=sys.stderr)
            return rc, ""
        args.rounds.append(str(path))

    def ask(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    driver = ask(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[:1]
    tree = ask(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"])
    command = shlex.join(["benchmarks/attention.py", *sweep_commands(args)[0][2:]])
    measured = (
        f"{datetime.date.today()}, {{device}} (driver {driver[0] if driver else 'unknown'}), tree {tree}: "
        f"{args.sweep} rounds (the grid and counts reversed in every other) of {command}; raw {out}"
    )
    return 0, measured


def run(args: argparse.Namespace) -> int:
    from zerodram.runtime.attention.split_table import TABLE_DIR, SplitTable, merge_table
    from zerodram.runtime.errors import ConfigError

    composed = ""  # --sweep's own record, "{device}" filled from the rows (a given --measured wins)
    if args.sweep:
        if args.rounds or not args.out or args.sweep < 2:
            print("split-table: --sweep N (N >= 2) takes --out and no round files", file=sys.stderr)
            return 2
        rc, composed = _sweep(args)
        if rc:
            return rc
    elif not args.rounds or not args.measured:
        print("split-table: give the rounds' files and --measured, or --sweep N --out DIR", file=sys.stderr)
        return 2
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
    counts = {b: {n: best[(b, n)][0] for n in lengths} for b in batches}
    table = SplitTable(device, key, hkv, page, args.measured or composed.replace("{device}", device), counts)
    if args.write:
        try:
            print(f"written: {merge_table(table, Path(args.dir) if args.dir else TABLE_DIR, replace_all=args.replace)}")
        except ConfigError as err:
            print(f"split-table: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
