"""`zerodram bench dispatch`: dispatch and combine latency, NVSHMEM path vs host-driven path.

Shape legend: T tokens per rank, D hidden, E experts, K top-k.

Both paths run in the same process on the same inputs (uniform random routing, identity experts:
combine sends the received rows back). GPU: CUDA events, warm-up, median of `--iters`; CPU:
perf_counter, host-driven only, a tiny grid. Beside every figure: bytes this rank moves and the
physical floor = bytes / link bandwidth (the topology's slowest peer link; for one rank, the
measured device copy bandwidth, since every row is then a local copy). One JSON line per case.

Runs as one rank by itself, or under torchrun as a collective: every rank runs every case, rank 0
prints. Several PEs on one GPU (correctness of the multi-rank path, not its speed: the processes
time-slice the GPU):

    ZERODRAM_TOPOLOGY=h200-1x4pe torchrun --nproc-per-node 4 benchmarks/dispatch.py --paths nvshmem
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GPU_GRID = {"tokens": (1, 8, 32, 128, 512), "hidden": (4096, 7168), "experts": (32, 256), "topk": (2, 8)}
CPU_GRID = {"tokens": (1, 8, 32), "hidden": (256,), "experts": (8,), "topk": (2,)}
WIRES = ("bf16", "fp8")


@dataclass(frozen=True)
class CaseResult:
    path: str
    wire: str
    tokens: int
    hidden: int
    experts: int
    topk: int
    world_size: int
    dispatch_us: float
    combine_us: float
    dispatch_bytes: int
    combine_bytes: int
    dispatch_floor_us: float
    combine_floor_us: float
    floor_basis: str
    device: str
    date: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print only the JSON lines (one per case)")
    p.add_argument("--quick", action="store_true", help="the CPU grid even on a GPU (smoke run)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per case (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per case")
    p.add_argument("--paths", default="auto", help="comma list of nvshmem,torch (auto: both where possible)")
    p.add_argument("--tokens", default=None, help="override the tokens-per-rank list, e.g. 1,128")
    p.add_argument("--wires", default="bf16,fp8", help="wire formats to run")


def run(args: argparse.Namespace) -> int:
    ctx, own = _context()
    try:
        gpu = ctx.device.type == "cuda"
        grid = dict(CPU_GRID if args.quick or not gpu else GPU_GRID)
        if args.tokens:
            grid["tokens"] = tuple(int(t) for t in args.tokens.split(","))
        paths = ["nvshmem", "torch"] if gpu else ["torch"]
        if args.paths != "auto":
            paths = [p for p in args.paths.split(",") if p]
        wires = tuple(w for w in args.wires.split(",") if w)

        def emit(r: CaseResult) -> None:  # JSON lines as cases finish: a cut-short run keeps them
            if ctx.rank == 0:
                print(json.dumps(asdict(r)), flush=True)

        results = _run_grid(ctx, grid, paths, wires, args.iters, args.warmup, emit)
        if ctx.rank == 0 and not args.json:
            _print_table(results)
    finally:
        if own:
            ctx.close()
    return 0


def _context() -> tuple[Any, bool]:
    """The torchrun rank context, or a one-rank world of this process."""
    import torch

    from zerodram.runtime.context import RankContext
    from zerodram.runtime.envs import ENVS

    if ENVS.RANK.get() is not None:
        # Under torchrun: the topology named by ZERODRAM_TOPOLOGY (if any) maps ranks to GPUs, e.g.
        # h200-1x4pe puts four PEs on one GPU (NVSHMEM path only: NCCL refuses a shared GPU).
        from zerodram.runtime.topology import load_topology, resolve_topology_path

        name = ENVS.TOPOLOGY.get()
        topology = load_topology(resolve_topology_path(name)) if name else None
        device = None if topology else ("cuda" if torch.cuda.is_available() else "cpu")
        return RankContext.create(topology, device=device), True
    return RankContext.single_process(), True


def _copy_bandwidth(dev: torch.device) -> float:
    """Measured bytes/s of a device copy, read + write counted (the one-rank floor's basis)."""
    import torch

    n = (256 << 20) if dev.type == "cuda" else (32 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(5):
        t = _Timer(dev)
        b.copy_(a)
        times.append(t.stop())
    return 2 * n / (min(times) * 1e-6)


class _Timer:
    def __init__(self, dev: torch.device) -> None:
        import torch

        self.dev = dev
        if dev.type == "cuda":
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Microseconds since construction."""
        if self.dev.type == "cuda":
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) * 1e3
        return (time.perf_counter() - self.t0) * 1e6


def _floor_basis(ctx: Any, copy_bw: float) -> tuple[float, str]:
    """(bytes/s per direction, description) of the slowest link this rank sends over."""
    topo = getattr(ctx, "topology", None)
    if ctx.world_size > 1 and topo is not None:
        gbps = min(topo.link_bandwidth_gbps(ctx.rank, r) for r in range(ctx.world_size) if r != ctx.rank)
        return gbps / 8 * 1e9, f"topology link {gbps:g} Gb/s"
    if ctx.world_size == 1:
        return copy_bw / 2, f"local copy {copy_bw / 1e12:.2f} TB/s r+w"
    return float("nan"), "no topology: no link bandwidth"


def _run_grid(
    ctx: Any, grid: dict, paths: list[str], wires: tuple[str, ...], iters: int, warmup: int, emit: Any
) -> list:
    import torch

    from zerodram.runtime.comm import EpLayout, ExpertPlacement, create_communicator

    dev = ctx.device
    copy_bw = _copy_bandwidth(dev)
    link_bw, basis = _floor_basis(ctx, copy_bw)
    dtype = torch.bfloat16
    t_max = max(grid["tokens"])
    session = None
    if "nvshmem" in paths:
        from zerodram.runtime.comm.nvshmem_comm import _heap_hint
        from zerodram.runtime.comm.nvshmem_session import NvshmemSession

        biggest = max(
            _heap_hint(EpLayout(ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E), D, K, t_max, w))
            for E, D, K, w in itertools.product(grid["experts"], grid["hidden"], grid["topk"], wires)
        )
        session = NvshmemSession.create(ctx, heap_bytes=biggest)
    results = []
    date = time.strftime("%Y-%m-%d")
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    try:
        for E, D, K, wire in itertools.product(grid["experts"], grid["hidden"], grid["topk"], wires):
            layout = EpLayout(ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E), D, K, t_max, wire)
            for path in paths:
                if path == "nvshmem":
                    from zerodram.runtime.comm.nvshmem_comm import NvshmemComm

                    comm = NvshmemComm.create(ctx, layout, session=session)
                else:
                    comm = create_communicator(ctx, layout, backend="torch")
                for T in grid["tokens"]:
                    g = torch.Generator().manual_seed(T * 7 + E)
                    x = torch.randn(T, D, generator=g).to(dtype=dtype, device=dev)
                    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
                    w = torch.rand(T, K, generator=g).to(dev)
                    d_us, c_us = _time_case(comm, x, idx, w, iters, warmup, dev)
                    d_bytes, c_bytes = T * K * layout.msg_bytes, T * K * D * 2
                    results.append(
                        CaseResult(
                            path,
                            wire,
                            T,
                            D,
                            E,
                            K,
                            ctx.world_size,
                            round(d_us, 2),
                            round(c_us, 2),
                            d_bytes,
                            c_bytes,
                            round(d_bytes / link_bw * 1e6, 3),
                            round(c_bytes / link_bw * 1e6, 3),
                            basis,
                            device_name,
                            date,
                        )
                    )
                    emit(results[-1])
                comm.close()
    finally:
        if session is not None:
            session.close()
    return results


def _time_case(comm: Any, x, idx, w, iters: int, warmup: int, dev: torch.device) -> tuple[float, float]:
    d_times, c_times = [], []
    for i in range(warmup + iters):
        t = _Timer(dev)
        out = comm.dispatch(x, topk_idx=idx, topk_weight=w)
        d = t.stop()
        t = _Timer(dev)
        comm.combine(out.recv_x, out)
        c = t.stop()
        if i >= warmup:
            d_times.append(d)
            c_times.append(c)
    comm.check()
    return statistics.median(d_times), statistics.median(c_times)


def _print_table(results: list) -> None:
    head = (
        f"{'path':8} {'wire':4} {'T':>4} {'D':>5} {'E':>4} {'K':>2} | {'dispatch us':>11} {'floor':>7} "
        f"{'MB':>6} | {'combine us':>10} {'floor':>7} {'MB':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.path:8} {r.wire:4} {r.tokens:>4} {r.hidden:>5} {r.experts:>4} {r.topk:>2} | "
            f"{r.dispatch_us:>11.1f} {r.dispatch_floor_us:>7.2f} {r.dispatch_bytes / 1e6:>6.2f} | "
            f"{r.combine_us:>10.1f} {r.combine_floor_us:>7.2f} {r.combine_bytes / 1e6:>6.2f}"
        )
    if results:
        print(f"floor = bytes / ({results[0].floor_basis}); world size {results[0].world_size}")
