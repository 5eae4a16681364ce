"""`zerodram bench dispatch`: dispatch and combine latency, NVSHMEM path vs host-driven path.

Shape legend: T tokens per rank, D hidden, E experts, K top-k.

Both paths run in the same process on the same inputs (uniform random routing, identity experts:
the combine sends the received rows back). `--route gate` routes from a random gate weight [E, D]
instead: on the NVSHMEM path the fused router (`gate_logits`' GEMM, then the top-k and weights
inside the dispatch kernel) is timed beside its baseline in the same case, torch's router
(`gate_logits`, `route`) then the same dispatch from the precomputed choices (`unfused_*`); the host
path routes in torch. Per case, GPU, with warm-up, an L2 flush before every timed iteration, and
medians of `--iters`:

    graph   (NVSHMEM) dispatch captured in one CUDA graph, combine in another; replays alternate in
            the protocol's order, CUDA events around each, all enqueued behind a sleep kernel so
            the GPU never waits for the host: device time. `graph_host_bound` says if the host fell
            behind anyway (then the figure includes host gaps).
    eager   one call from Python, events around it, the device idle before it: what a caller
            without a graph pays, host launches included. The host-driven path syncs the host
            inside dispatch, so eager is all it has; `host_stages_us` splits one of its calls.

CPU: perf_counter, host-driven only, a tiny grid (a smoke run). Beside every figure: bytes this
rank moves and the floor = bytes / link bandwidth (the topology's slowest peer link; for one rank
the measured device copy bandwidth, since every row is then a local copy). One JSON line per case.

Runs as one rank by itself, or under torchrun as a collective (every rank runs every case, rank 0
prints). Several PEs on one GPU time-slice it, so their figures are no speed figures: that run
checks that the multi-rank path runs and stays live, on a small grid, with a generous device
timeout; each rank reports the wait that expired, and a host-side watchdog ends a stuck rank:

    ZERODRAM_TOPOLOGY=h200-1x4pe torchrun --nproc-per-node 4 benchmarks/dispatch.py --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from zerodram.launch.bench_cmd import load_sibling
from zerodram.runtime.argtypes import int_at_least, int_list

if TYPE_CHECKING:
    from zerodram.launch.watchdog import StageWatchdog
    from zerodram.runtime.context import RankContext


report = load_sibling(__file__, "dispatch_report")  # CaseResult and the tables
CaseResult, SHARED_NOTE = report.CaseResult, report.SHARED_NOTE


@dataclass(frozen=True)
class Grid:
    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    experts: tuple[int, ...]
    topk: tuple[int, ...]


GPU_GRID = Grid(tokens=(1, 8, 32, 128, 512), hidden=(4096, 7168), experts=(32, 256), topk=(2, 8))
SHARED_GPU_GRID = Grid(tokens=(1, 128), hidden=(7168,), experts=(256,), topk=(8,))  # the decode anchor
CPU_GRID = Grid(tokens=(1, 8, 32), hidden=(256,), experts=(8,), topk=(2,))
SLEEP_CYCLES = 10_000_000  # ~5 ms at H200 clocks: far longer than enqueuing one case's replays
FLUSH_BYTES = 256 << 20  # > H200's L2 (50 MB)
ROUTES = ("given", "gate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", help="stdout: only the JSON lines (the summary goes to stderr)"
    )
    p.add_argument("--quick", action="store_true", help="the CPU grid even on a GPU (smoke run)")
    p.add_argument(
        "--iters", type=int_at_least(1), default=20, help="timed iterations per case (median reported)"
    )
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed iterations per case")
    p.add_argument("--paths", default="auto", help="comma list of nvshmem,torch (auto: both where possible)")
    p.add_argument("--tokens", type=int_list, help="override the tokens-per-rank list, e.g. 1,128")
    p.add_argument("--hidden", type=int_list, help="override the hidden sizes, e.g. 7168")
    p.add_argument("--experts", type=int_list, help="override the expert counts, e.g. 256")
    p.add_argument("--topk", type=int_list, help="override the top-k list, e.g. 8")
    p.add_argument("--wires", default="bf16,fp8", help="wire formats to run")
    p.add_argument("--no-flush", action="store_true", help="no L2 flush between timed iterations")
    p.add_argument(
        "--route",
        choices=ROUTES,
        default="given",
        help="given: the choices precomputed (dispatch alone); gate: routed from a gate weight, by the "
        "fused router on the NVSHMEM path (timed beside torch's router then the same dispatch) and "
        "by torch's router on the host path",
    )
    p.add_argument(
        "--device-timeout",
        type=float,
        default=None,
        help="bound on each device-side wait, s (default 10; 60 with PEs sharing a GPU)",
    )


def run(args: argparse.Namespace) -> int:
    from zerodram.launch.watchdog import StageWatchdog
    from zerodram.runtime.errors import ConfigError, RankTimeoutError

    ctx, own = _context()
    say = _Say(ctx.rank)
    dog = StageWatchdog(f"rank {ctx.rank}/{ctx.world_size}")
    try:
        gpu, shared = ctx.device.type == "cuda", _shares_gpu(ctx)
        grid = CPU_GRID if args.quick or not gpu else SHARED_GPU_GRID if shared else GPU_GRID
        for name in ("tokens", "hidden", "experts", "topk"):
            if getattr(args, name):
                grid = replace(grid, **{name: getattr(args, name)})
        # NCCL refuses ranks sharing a GPU, and gloo cannot move CUDA tensors: no host path there
        paths = ["nvshmem"] if shared else ["nvshmem", "torch"] if gpu else ["torch"]
        if args.paths != "auto":
            paths = [p for p in args.paths.split(",") if p]
        if shared and "torch" in paths:
            raise ConfigError(
                "the host-driven path needs NCCL (a GPU per rank) or CPU ranks; PEs share a GPU"
            )
        if not gpu and "nvshmem" in paths:
            raise ConfigError(f"the NVSHMEM path needs a GPU; rank {ctx.rank} runs on {ctx.device}")
        wires = tuple(w for w in args.wires.split(",") if w)
        timeout_s = args.device_timeout or (60.0 if shared else 10.0)
        say(
            f"{ctx.world_size} rank(s) on {ctx.device}, paths {','.join(paths)}, device wait bound {timeout_s:g}s"
        )
        if shared:
            say(SHARED_NOTE)
        out = sys.stderr if args.json else sys.stdout

        def emit(r: CaseResult) -> None:  # JSON lines as cases finish: a cut-short run keeps them
            if ctx.rank == 0:
                print(json.dumps(asdict(r)), flush=True)

        bench = _Bench(ctx, grid, paths, wires, args, timeout_s, shared, say, dog)
        try:
            results = bench.run_all(emit)
        except RankTimeoutError as err:
            # Every rank names what it waited for. No collective teardown after this: it would
            # wait on the silent peer forever; torchrun stops the others when this process ends.
            print(f"rank {ctx.rank}/{ctx.world_size}: {bench.current}: {err}", file=sys.stderr, flush=True)
            os._exit(3)
        if ctx.rank == 0:
            if not args.json:
                report.print_table(results, out)
            report.print_summary(results, out)
    finally:
        dog.close()
        if own:
            ctx.close()
    return 0


def _context() -> tuple[RankContext, bool]:
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


def _shares_gpu(ctx: RankContext) -> bool:
    """Whether other ranks compute on this rank's GPU (they time-slice it: no speed figures)."""
    if ctx.device.type != "cuda" or ctx.world_size == 1:
        return False
    topo = ctx.topology
    if topo is None:
        return ctx.backend == "gloo"  # RankContext picks gloo for GPU ranks only when they share one
    me = topo.rank_spec(ctx.rank)
    return sum(r.node_idx == me.node_idx and r.gpu_idx == me.gpu_idx for r in topo.ranks) > 1


class _Say:
    """Rank 0's progress lines on stderr, with the time since start (stdout stays for results)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.t0 = rank, time.monotonic()

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[bench dispatch {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class _Bench:
    """The grid's cases on this rank; `current` names the one running (for error messages)."""

    def __init__(
        self,
        ctx: RankContext,
        grid: Grid,
        paths: list[str],
        wires: tuple[str, ...],
        args: argparse.Namespace,
        timeout_s: float,
        shared: bool,
        say: _Say,
        dog: StageWatchdog,
    ) -> None:
        self.ctx, self.grid, self.paths, self.wires, self.args = ctx, grid, paths, wires, args
        self.timeout_s, self.shared, self.say, self.dog = timeout_s, shared, say, dog
        self.current = "start"
        self.case_limit_s = 2 * timeout_s + 60  # a case's waits are bounded by timeout_s on the device

    def run_all(self, emit: Any) -> list[CaseResult]:
        import torch

        from zerodram.launch.progress import progress_bar
        from zerodram.runtime.comm import EpLayout, ExpertPlacement
        from zerodram.runtime.comm.nvshmem_comm import heap_bytes
        from zerodram.runtime.metrics.devtime import Clock, copy_bandwidth

        ctx, g = self.ctx, self.grid
        dev = ctx.device
        self.copy_bw = copy_bandwidth(device=dev)
        self.link_bw, self.basis = _floor_basis(ctx, self.copy_bw)
        self.clock = Clock(dev, 0 if self.args.no_flush or self.shared else FLUSH_BYTES)
        self.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        configs = list(itertools.product(g.experts, g.hidden, g.topk, self.wires))
        t_max = max(g.tokens)
        session = None
        if "nvshmem" in self.paths:
            from zerodram.kernels.dispatch import DispatchKernels
            from zerodram.runtime.comm.nvshmem_session import NvshmemSession

            heap = max(
                heap_bytes(EpLayout(ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E), D, K, t_max, w))
                for E, D, K, w in configs
            )
            self._enter("NVSHMEM init", 300)
            session = NvshmemSession.create(ctx, heap_bytes=heap)
            self.say(f"NVSHMEM up on {ctx.world_size} PE(s), heap {heap / 2**30:.2f} GiB")
            self._enter("kernel compile/load (one rank compiles, the others wait on its file lock)", 900)
            DispatchKernels()
            self.say("dispatch kernels loaded")
        total = len(configs) * len(self.paths) * len(g.tokens)
        results: list[CaseResult] = []
        try:
            with progress_bar(
                total, "bench dispatch", console=_stderr_console(), enabled=ctx.rank == 0
            ) as bar:
                for E, D, K, wire in configs:
                    layout = EpLayout(
                        ExpertPlacement.contiguous(ctx.rank, ctx.world_size, E), D, K, t_max, wire
                    )
                    for path in self.paths:
                        self._enter(f"{path} {wire} D={D} E={E} K={K}: communicator setup", 300)
                        comm = self._communicator(path, layout, session)
                        for T in g.tokens:
                            name = f"{path} {wire} T={T} D={D} E={E} K={K}"
                            self._enter(f"case {len(results) + 1}/{total} ({name})", self.case_limit_s)
                            results.append(self._case(comm, path, layout, T))
                            emit(results[-1])
                            bar.advance(note=name)
                        self._enter(f"{path} {wire} D={D} E={E} K={K}: communicator close", 300)
                        comm.close()
        finally:
            if session is not None:
                self._enter("NVSHMEM finalize", 300)
                session.close()
        self._enter("done", float("inf"))
        return results

    def _enter(self, what: str, limit_s: float) -> None:
        self.current = what
        self.dog.stage(what, limit_s)

    def _communicator(self, path: str, layout: Any, session: Any) -> Any:
        from zerodram.runtime.comm import create_communicator
        from zerodram.runtime.moe.router import RouterConfig

        router = RouterConfig(layout.num_experts, layout.top_k)  # softmax, renormalised: Mixtral's
        if path == "nvshmem":
            from zerodram.runtime.comm.nvshmem_comm import NvshmemComm

            return NvshmemComm.create(self.ctx, layout, router, session=session, timeout_s=self.timeout_s)
        return create_communicator(self.ctx, layout, router, backend="torch")

    def _case(self, comm: Any, path: str, layout: Any, T: int) -> CaseResult:
        import torch

        from zerodram.runtime.moe.router import gate_logits, route

        ctx, args, dev = self.ctx, self.args, self.ctx.device
        E, D, K = layout.num_experts, layout.hidden, layout.top_k
        gen = torch.Generator().manual_seed(T * 7 + E + 1000 * ctx.rank)
        x = torch.randn(T, D, generator=gen).to(dtype=torch.bfloat16, device=dev)  # [T, D]
        idx = torch.rand(T, E, generator=gen).argsort(1)[:, :K].to(dev)  # [T, K] distinct experts
        w = torch.rand(T, K, generator=gen).to(dev)  # [T, K]
        gate = None  # [E, D], drawn after x, idx, w (so those stay the same under either route)
        if args.route == "gate":
            gate = (torch.randn(E, D, generator=gen) / D**0.5).to(dtype=torch.bfloat16, device=dev)

        def given() -> Any:
            return comm.dispatch(x, topk_idx=idx, topk_weight=w)

        def fused() -> Any:  # NVSHMEM: the logits' GEMM, then the top-k in the send kernel; host: torch's
            return comm.dispatch(x, gate_weight=gate)

        def unfused() -> Any:  # the fused router's baseline: torch's router, then the same dispatch
            i, wt = route(gate_logits(x, gate), comm.router)
            return comm.dispatch(x, topk_idx=i, topk_weight=wt)

        send = fused if args.route == "gate" else given
        d_eager, c_eager = self._eager(comm, send)
        comm.check()
        d_graph = c_graph = host_bound = stages = u_graph = u_eager = None
        if path == "nvshmem":
            d_graph, c_graph, host_bound = self._graph(comm, send)
            comm.check()
            if args.route == "gate":
                u_eager = self._eager(comm, unfused)[0]
                u_graph, _, u_host_bound = self._graph(comm, unfused)
                host_bound = host_bound or u_host_bound
                comm.check()
        else:
            stages = self._host_stages(comm, send)
        d_bytes, c_bytes = T * K * layout.msg_bytes, T * K * D * 2
        return CaseResult(
            path, layout.wire, T, D, E, K, ctx.world_size,
            _r2(d_graph), _r2(c_graph), _r2(d_eager), _r2(c_eager), host_bound, stages,
            d_bytes, c_bytes, round(d_bytes / self.link_bw * 1e6, 3), round(c_bytes / self.link_bw * 1e6, 3),
            self.basis, args.iters, args.warmup, self.shared, SHARED_NOTE if self.shared else "",
            self.device_name, time.strftime("%Y-%m-%d"), args.route, _r2(u_graph), _r2(u_eager),
        )  # fmt: skip

    def _eager(self, comm: Any, send: Callable[[], Any]) -> tuple[float, float]:
        clock, d_times, c_times = self.clock, [], []
        for i in range(self.args.warmup + self.args.iters):
            clock.idle()
            a = clock.mark()
            out = send()
            d = clock.between_ms(a, clock.mark()) * 1e3
            clock.idle()  # idle again: the combine's launches may not hide behind the dispatch
            a = clock.mark()
            comm.combine(out.recv_x, out)
            c = clock.between_ms(a, clock.mark()) * 1e3
            if i >= self.args.warmup:
                d_times.append(d)
                c_times.append(c)
        return statistics.median(d_times), statistics.median(c_times)

    def _graph(self, comm: Any, send: Callable[[], Any]) -> tuple[float, float, bool]:
        """Dispatch and combine each captured once, replayed alternately (dispatch n+1 of a phase may
        start only after combine n: that is what orders the protocol's flags across ranks)."""
        import torch

        torch.cuda.synchronize()
        g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_dispatch):
            out = send()
        with torch.cuda.graph(g_combine):
            comm.combine(out.recv_x, out)
        for _ in range(self.args.warmup):
            g_dispatch.replay()
            g_combine.replay()
        torch.cuda.synchronize()
        n = self.args.iters
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        torch.cuda._sleep(SLEEP_CYCLES)  # holds the stream while the host enqueues every replay
        s1.record()
        t0 = time.perf_counter()
        for i in range(n):
            self.clock.evict()
            ev[i][0].record()
            g_dispatch.replay()
            ev[i][1].record()
            g_combine.replay()
            ev[i][2].record()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        host_bound = enqueue_ms > s0.elapsed_time(s1)
        d = statistics.median(a.elapsed_time(b) * 1e3 for a, b, _ in ev)
        c = statistics.median(b.elapsed_time(c) * 1e3 for _, b, c in ev)
        del g_dispatch, g_combine, out  # before the communicator's buffers go
        return d, c, host_bound

    def _host_stages(self, comm: Any, send: Callable[[], Any]) -> dict[str, float]:
        """One more host-path call, its stages marked (CUDA events on a GPU: wall-like, since the
        path waits on the host in the middle)."""
        clock, marks = self.clock, []
        clock.idle()
        start = clock.mark()
        comm.on_stage = lambda name: marks.append((f"dispatch.{name}", clock.mark()))
        out = send()
        comm.on_stage = lambda name: marks.append((f"combine.{name}", clock.mark()))
        comm.combine(out.recv_x, out)
        comm.on_stage = lambda name: None
        stages, prev = {}, start
        for name, m in marks:
            stages[name] = round(clock.between_ms(prev, m) * 1e3, 2)
            prev = m
        return stages


def _r2(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _floor_basis(ctx: RankContext, copy_bw: float) -> tuple[float, str]:
    """(bytes/s per direction, description) of the slowest link this rank sends over."""
    topo = getattr(ctx, "topology", None)
    if ctx.world_size > 1 and topo is not None:
        gbps = min(topo.link_bandwidth_gbps(ctx.rank, r) for r in range(ctx.world_size) if r != ctx.rank)
        return gbps / 8 * 1e9, f"topology link {gbps:g} Gb/s"
    if ctx.world_size == 1:
        return copy_bw / 2, f"local copy {copy_bw / 1e12:.2f} TB/s r+w"
    return float("nan"), "no topology: no link bandwidth"


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
