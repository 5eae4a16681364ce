"""What `zerodram bench decode` (benchmarks/decode.py) prints besides its JSON lines: the table of
cases against their floors and the bf16 baseline, the per-stage breakdown at the largest context,
and (--profile) the device time of each kernel in a replayed graph. Everything goes to stdout except
the kernel times, which go to stderr.
"""

from __future__ import annotations

import sys
from typing import Any

STAGES = ("attention", "dispatch", "experts", "combine")


def print_kernel_times(graph: Any, flush: Any, label: str, reps: int = 5) -> None:
    """Device time per kernel of one replay of `graph` (CUPTI sees the kernels inside it), on stderr."""
    from zerodram.runtime.metrics.devtime import device_activity

    def one() -> None:
        flush.sum()
        graph.replay()

    rows = device_activity(one, reps)
    total = sum(us for _, us, _ in rows)
    print(
        f"# kernels of one {label} replay: {total / 1e3:.3f} ms of kernel time, including one 256 MB "
        "L2-flush reduction (about 0.06 ms) that is not part of the step",
        file=sys.stderr,
    )
    for name, us, n in rows[:14]:
        print(f"#   {us / 1e3:8.3f} ms  x{n:<3.0f} {name[:100]}", file=sys.stderr)


def print_tables(rows: list[dict], bench: Any) -> None:
    cfg = bench.cfg
    print(
        f"\n# {bench.device_name}: one MoE layer (index {bench.idx}) of {bench.model} "
        f"(D {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}, "
        f"{cfg.num_experts} experts of {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}); "
        f"memory bandwidth {bench.copy_bw / 1e12:.2f} TB/s (copy, r+w); dispatch: "
        + ", ".join(f"{p} {b}" for p, b in bench.backends.items())
    )
    by = {(r["path"], r["B"], r["L"]): r for r in rows}
    print(f"\n{'B':>4} {'L':>7} | {'path':9} {'step ms':>9} {'floor ms':>9} {'x floor':>7} {'tok/s*':>9}"
          f" | {'speedup':>7} {'floor ratio':>11}")  # fmt: skip
    for r in rows:
        other = by.get(("bf16-host", r["B"], r["L"]))
        speed = ratio = ""
        if r["path"] == "fp2-fused" and other is not None:
            speed = f"{other['total_ms'] / r['total_ms']:.2f}x"
            ratio = f"{other['total_floor_ms'] / r['total_floor_ms']:.2f}x"
        print(
            f"{r['B']:>4} {r['L']:>7} | {r['path']:9} {r['total_ms']:>9.3f} {r['total_floor_ms']:>9.3f} "
            f"{r['floor_ratio']:>6.2f}x {r['tok_s_projected']:>9.1f} | {speed:>7} {ratio:>11}"
        )
    print("tok/s* = B / (layer step x its model's layers): a projection from one layer")
    for r in rows:
        if r.get("total_graph_ms") is not None:
            print(
                f"{r['path']} B={r['B']} L={r['L']}: whole pass from one CUDA graph "
                f"{r['total_graph_ms']:.3f} ms = {r['graph_floor_ratio']:.2f}x floor"
            )
    L = max(r["L"] for r in rows)
    print(f"\nbreakdown at L = {L}: measured ms (floor ms)")
    print(f"{'path':9} {'B':>4} | " + " | ".join(f"{s:>17}" for s in (*STAGES, "total")))
    for r in (r for r in rows if r["L"] == L):
        cells = " | ".join(f"{r[s + '_ms']:>8.3f} ({r[s + '_floor_ms']:>6.3f})" for s in (*STAGES, "total"))
        print(f"{r['path']:9} {r['B']:>4} | {cells} | K/V write alone {r['kv_write_ms']:.3f}")
    print("floors: attention = (q/k/v/o weights + KV) / bandwidth; experts = (router + routed experts) / "
          "bandwidth; dispatch, combine = B*K bf16 rows / (copy bandwidth / 2), one rank")  # fmt: skip
