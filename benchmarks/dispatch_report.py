"""One case of `zerodram bench dispatch` (benchmarks/dispatch.py) as its JSON line holds it, and the
table and summary that rank 0 prints of them.

Shape legend: T tokens per rank, D hidden, E experts, K top-k.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

SHARED_NOTE = "PEs share one GPU: correctness/liveness run, not a speed figure"


@dataclass(frozen=True)
class CaseResult:
    path: str
    wire: str
    tokens: int
    hidden: int
    experts: int
    topk: int
    world_size: int
    dispatch_graph_us: float | None  # CUDA-graph replay, device time (NVSHMEM only)
    combine_graph_us: float | None
    dispatch_eager_us: float  # one call from Python, host launch included
    combine_eager_us: float
    graph_host_bound: bool | None  # the host enqueued slower than the device ran: graph figure has gaps
    host_stages_us: dict[str, float] | None  # host path: one call split by stage
    dispatch_bytes: int
    combine_bytes: int
    dispatch_floor_us: float
    combine_floor_us: float
    floor_basis: str
    iters: int
    warmup: int
    shared_gpu: bool
    note: str
    device: str
    date: str
    route: str  # "given": precomputed choices; "gate": routed from a gate weight (`--route`)
    # NVSHMEM with --route gate: the fused router's baseline, torch's router then the same dispatch
    unfused_dispatch_graph_us: float | None
    unfused_dispatch_eager_us: float | None


def _fmt(v: float | None, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.1f}"


def print_table(results: list[CaseResult], out: Any) -> None:
    head = (
        f"{'path':8} {'route':5} {'wire':4} {'T':>4} {'D':>5} {'E':>4} {'K':>2} | {'disp graph':>10} "
        f"{'eager':>8} {'unfused':>8} {'floor':>7} | {'comb graph':>10} {'eager':>8} {'floor':>7} | {'MB':>6}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in results:
        print(
            f"{r.path:8} {r.route:5} {r.wire:4} {r.tokens:>4} {r.hidden:>5} {r.experts:>4} {r.topk:>2} | "
            f"{_fmt(r.dispatch_graph_us, 10)} {r.dispatch_eager_us:>8.1f} {_fmt(r.unfused_dispatch_graph_us, 8)} "
            f"{r.dispatch_floor_us:>7.2f} | "
            f"{_fmt(r.combine_graph_us, 10)} {r.combine_eager_us:>8.1f} {r.combine_floor_us:>7.2f} | "
            f"{r.dispatch_bytes / 1e6:>6.2f}",
            file=out,
        )


def print_summary(results: list[CaseResult], out: Any) -> None:
    """The anchor shape (largest D, E, K of the grid) per T, and medians over the grid; us."""
    if not results:
        return
    r0 = results[0]
    if r0.shared_gpu:
        print(f"NOTE: {SHARED_NOTE}", file=out)
    D, E, K = (max(getattr(r, f) for r in results) for f in ("hidden", "experts", "topk"))
    by = {(r.path, r.wire, r.tokens): r for r in results if (r.hidden, r.experts, r.topk) == (D, E, K)}
    paths = sorted({r.path for r in results})
    print(f"D={D} E={E} K={K}, world size {r0.world_size}, us, medians of {r0.iters}:", file=out)
    cols = " ".join(f"{p + ' ' + c:>16}" for p in paths for c in ("disp g/eager", "comb g/eager"))
    print(f"{'wire':4} {'T':>4} | {cols} | {'floor d/c':>13}", file=out)
    for wire, T in sorted({(w, t) for _, w, t in by}):
        cells = []
        for p in paths:
            r = by.get((p, wire, T))
            if r is None:
                cells += ["", ""]
                continue
            for g, e in (
                (r.dispatch_graph_us, r.dispatch_eager_us),
                (r.combine_graph_us, r.combine_eager_us),
            ):
                cells.append(f"{_fmt(g, 7).strip():>7}/{e:<8.1f}")
        ref = by[next(k for k in by if k[1:] == (wire, T))]
        floor = f"{ref.dispatch_floor_us:.2f}/{ref.combine_floor_us:.2f}"
        print(f"{wire:4} {T:>4} | {' '.join(f'{c:>16}' for c in cells)} | {floor:>13}", file=out)
    for p in paths:
        rs = [r for r in results if r.path == p]
        parts = []
        for f in ("dispatch", "combine"):
            g = [v for r in rs if (v := getattr(r, f + "_graph_us")) is not None]
            e = statistics.median(getattr(r, f + "_eager_us") for r in rs)
            parts.append(f"{f} " + (f"graph {statistics.median(g):.1f} / " if g else "") + f"eager {e:.1f}")
        print(f"median over {len(rs)} {p} cases: " + ", ".join(parts), file=out)
    fused = [r for r in results if r.unfused_dispatch_graph_us is not None and r.dispatch_graph_us]
    if fused:  # --route gate on the NVSHMEM path: the fused router against torch's, same dispatch
        ratio = statistics.median(r.unfused_dispatch_graph_us / r.dispatch_graph_us for r in fused)
        saved = statistics.median(r.unfused_dispatch_graph_us - r.dispatch_graph_us for r in fused)
        print(
            f"fused router + dispatch vs torch's router then dispatch (graph), median over {len(fused)} "
            f"cases: {ratio:.2f}x, {saved:.1f} us saved",
            file=out,
        )
    if any(r.graph_host_bound for r in results):
        print(
            "WARNING: some graph timings were host bound (graph_host_bound): they include host gaps", file=out
        )
    print(f"floor = bytes / ({r0.floor_basis})", file=out)
