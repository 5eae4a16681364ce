"""`zerodram bench decode`: one MoE layer's decode step, FP2 KV + fused dispatch vs BF16 KV + host path.

    zerodram bench decode [--json]          # GPU: seed-700b, B 1/8/64 x L 8k/32k/128k; CPU: small
    zerodram bench decode --model mixtral-8x7b --batches 8,64 --contexts 131072

Shape legend: B sequences (one new token each), L context tokens per sequence, D hidden, Hq / Hkv
heads, Dh head dim, E experts, K top-k, F expert FFN, P page size.

One decoder layer of a named configuration (random bf16 weights, all experts on this one rank)
runs the decode step of B sequences whose KV already holds L tokens each, in four timed stages:

    attention        RMSNorm, q/k/v projections, RoPE, attention over the KV, o projection
    router+dispatch  RMSNorm, gate logits, top-k, rows to the experts' receive buffer
    experts          SwiGLU over the packed rows (+ the shared expert, if any), on the path the
                     runtime picks for the step (runtime/moe/experts.py; GPU decode: the kernel)
    combine          rows back to their tokens, weighted sum

Two paths, each on its own KV and communicator, the same weights and inputs:

    fp2-fused  KV as FP2 pages (2-bit codes, e4m3 scales per 64 channels, 32 bf16 tail tokens + 4
               sinks) read by the fused decode kernel (on CPU: its torch reference);
               router and dispatch in one NVSHMEM kernel (`--fused-backend`, GPU with nvshmem4py;
               otherwise the host path, and the output says so in `dispatch`)
    bf16-host  KV as contiguous bf16 [B, Hkv, L, Dh] read by SDPA (no paging: a generous
               baseline); router in torch, then the host-driven dispatch (counts exchange, host
               sync, all_to_all_single)

The attention stage includes the new token's K/V write, as the engine does it: fp2-fused writes
into an `Fp2KVCache` of the engine's default format (`DEFAULT_FP2`: bf16 window, one token
flushed per step with error feedback; a random feedback factor, since the values do not change
the work) through its fixed-shape decode write (`write_decode_static`, what the engine's CUDA
graph captures; the host plan runs before the pass); bf16-host stores the row into its
contiguous cache. `kv_write_ms` is the write alone (median of isolated writes, device time).
Timing: on a GPU, CUDA events between the stages of one pass (no sync inside it), a 256 MB L2
flush before each pass, warm-up, median per stage; on CPU, perf_counter (ops are synchronous).
Physical floor, per stage and in total: bytes that must move over their bandwidth:
    attention  q/k/v/o weights + the KV bytes of the format          / HBM bandwidth
    experts    router, plus gate/up/down of the distinct experts routed to / HBM bandwidth
    dispatch, combine  B*K rows of D bf16 each way / link bandwidth (one rank: every row is a
               local copy, so the device copy bandwidth per direction)
HBM bandwidth is the measured device copy rate (bytes read + written per second). tok/s is B over
the layer step times the model's layer count: a projection from one layer to compare cases, not a
served rate. One JSON line per (path, B, L), a table, and the per-stage breakdown at the largest
context next to its floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from typing import Any

from zerodram.launch.bench_cmd import load_sibling
from zerodram.runtime.argtypes import int_at_least, int_list

kv_paths = load_sibling(__file__, "decode_kv")  # the two paths' KV: Fp2PathKV, Bf16PathKV
report = load_sibling(__file__, "decode_report")  # the tables

PATHS = ("fp2-fused", "bf16-host")
STAGES = report.STAGES
GPU = {"model": "seed-700b", "batches": (1, 8, 64), "contexts": (8192, 32768, 131072)}
# CPU: a small MoE layer the FP2 kernels' shape rules accept (head dim 64, <= 8 q heads per kv head)
CPU = {"model": "small", "batches": (1, 4), "contexts": (256, 1024)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print only the JSON lines (one per case)")
    p.add_argument("--model", default=None, help="named config (default: seed-700b on GPU, 'small' on CPU)")
    p.add_argument("--batches", type=int_list, help="comma list of B (default GPU 1,8,64; CPU 1,4)")
    p.add_argument("--contexts", type=int_list, help="comma list of L (default GPU 8k,32k,128k; CPU 256,1k)")
    p.add_argument("--paths", default=",".join(PATHS), help="comma list of fp2-fused,bf16-host")
    p.add_argument("--fused-backend", default="auto", help="EP backend of fp2-fused: auto | nvshmem | torch")
    p.add_argument("--iters", type=int_at_least(1), help="timed passes per case (GPU 20, CPU 5)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed passes per case")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is visible")
    p.add_argument(
        "--profile",
        action="store_true",
        help="GPU: also print the device time of each kernel in the replayed graph (torch.profiler)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from zerodram.runtime.context import RankContext

    gpu = torch.cuda.is_available() and not args.cpu
    grid = GPU if gpu else CPU
    model = args.model or grid["model"]
    batches, contexts = args.batches or grid["batches"], args.contexts or grid["contexts"]
    paths = [p for p in args.paths.split(",") if p]
    if bad := [p for p in paths if p not in PATHS]:
        print(f"unknown path(s) {bad}; paths: {', '.join(PATHS)}", file=sys.stderr)
        return 2
    iters = args.iters or (20 if gpu else 5)
    ctx = RankContext.single_process("cuda" if gpu else "cpu")
    try:
        bench = LayerBench(ctx, model, max(batches), args.fused_backend)
        bench.profile = args.profile
        rows = []
        cases = [(path, B, L) for B in batches for L in contexts for path in paths]
        from rich.console import Console

        from zerodram.launch.progress import progress_bar

        # progress on stderr: stdout carries only the table and the JSON lines
        with progress_bar(len(cases), "bench decode", console=Console(stderr=True)) as bar:
            for path, B, L in cases:
                rows.append(bench.case(path, B, L, iters, args.warmup))
                if args.json:  # as cases finish: a run cut short keeps them
                    print(json.dumps(rows[-1]), flush=True)
                bar.advance(note=f"{path} B={B} L={L}")
        if not args.json:
            report.print_tables(rows, bench)
            for row in rows:
                print(json.dumps(row))
        bench.close()
    finally:
        ctx.close()
    return 0


def layer_config(name: str) -> Any:
    """The named config cut to its first MoE layer (plus any dense layers before it)."""
    from zerodram.runtime.model.named import named_config

    if name == "small":
        cfg = dataclasses.replace(
            named_config("tiny-moe"), hidden_size=256, head_dim=64, num_heads=4, num_kv_heads=2,
            intermediate_size=512, moe_intermediate_size=512, max_position_embeddings=1 << 20,
        )  # fmt: skip
    else:
        cfg = named_config(name)
    first_moe = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    return cfg, first_moe


class LayerBench:
    """One MoE layer's weights, its two communicators and the timing of one case at a time."""

    profile = False  # print per-kernel device times of the replayed graph

    def __init__(self, ctx: Any, model: str, max_batch: int, fused_backend: str) -> None:
        import torch

        from zerodram.runtime.comm import EpLayout, ExpertPlacement, create_communicator
        from zerodram.runtime.loading.random_init import random_weights
        from zerodram.runtime.metrics.devtime import Clock, copy_bandwidth
        from zerodram.runtime.model.rope import Rope
        from zerodram.runtime.moe.experts import ExpertShard
        from zerodram.runtime.moe.router import RouterConfig

        self.ctx, self.dev, self.model = ctx, ctx.device, model
        self.full_cfg, self.idx = layer_config(model)
        cfg = self.cfg = dataclasses.replace(self.full_cfg, num_layers=self.idx + 1)
        w = random_weights(cfg, None, 0, dtype=torch.bfloat16, device=self.dev)
        p = f"layers.{self.idx}."
        self.w = {k[len(p) :]: v for k, v in w.items() if k.startswith(p)}
        del w
        self.shard = ExpertShard(
            tuple(range(cfg.num_experts)), self.w["experts.gate"], self.w["experts.up"], self.w["experts.down"]
        )
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, self.dev)
        E, K, D = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
        layout = EpLayout(ExpertPlacement.contiguous(0, 1, E), D, K, max_batch, "bf16")
        router = RouterConfig(E, K, renormalize=cfg.norm_topk_prob)
        self.comms = {"bf16-host": create_communicator(ctx, layout, router, "torch")}
        backend = fused_backend
        if backend == "auto":
            from zerodram.runtime.comm import _nvshmem_importable

            backend = "nvshmem" if self.dev.type == "cuda" and _nvshmem_importable() else "torch"
            if backend == "torch":
                print(
                    "bench decode: no NVSHMEM here (needs a GPU and nvshmem4py): fp2-fused dispatches "
                    "through the host path; its 'dispatch' field says so",
                    file=sys.stderr,
                )
        self.comms["fp2-fused"] = create_communicator(ctx, layout, router, backend)
        self.backends = {"bf16-host": "torch", "fp2-fused": backend}
        self.copy_bw = copy_bandwidth(device=self.dev)  # bytes read + written per second
        self.clock = Clock(self.dev)
        self.flush = torch.zeros(64 << 20, dtype=torch.float32, device=self.dev) if self.dev.type == "cuda" else None
        self.device_name = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu"

    def close(self) -> None:
        """Close both communicators (symmetric memory before the context goes)."""
        for comm in self.comms.values():
            comm.close()

    # ---- one case ----

    def case(self, path: str, B: int, L: int, iters: int, warmup: int) -> dict:
        """Time `path` at batch B, context L; returns the JSON row."""
        import torch

        from zerodram.kernels.experts import DEFAULT_CONFIG
        from zerodram.runtime.moe.experts import choose_experts_path

        gen = torch.Generator(device=self.dev).manual_seed(1000 * B + L)
        cfg = self.cfg
        x = torch.randn(B, cfg.hidden_size, device=self.dev, generator=gen).to(torch.bfloat16)  # [B, D]
        kv = (kv_paths.Fp2PathKV if path == "fp2-fused" else kv_paths.Bf16PathKV)(cfg, self.dev, B, L, gen)
        comm = self.comms[path]
        positions = torch.full((B,), L, device=self.dev, dtype=torch.int64)
        samples: dict[str, list[float]] = {s: [] for s in (*STAGES, "total")}
        topk_idx = None
        for i in range(warmup + iters):
            if self.flush is not None:
                self.flush.sum()  # read-only: a write leaves dirty L2 lines for the timed pass
            marks = [self.clock.mark()]
            h = self._attention(x, positions, kv)
            marks.append(self.clock.mark())
            h2, out = self._dispatch(path, h, comm)
            marks.append(self.clock.mark())
            y, y_shared = self._experts(h2, out)
            marks.append(self.clock.mark())
            y = comm.combine(y, out)  # [B, D]
            marks.append(self.clock.mark())
            _ = h + y if y_shared is None else h + y + y_shared
            ms = [self.clock.between_ms(a, b) for a, b in itertools.pairwise(marks)]
            if i >= warmup:
                for s, v in zip(STAGES, ms, strict=True):
                    samples[s].append(v)
                samples["total"].append(sum(ms))
            topk_idx = out.topk_idx
        comm.check()
        med = {s: statistics.median(v) for s, v in samples.items()}
        graph_ms = self._graph_total(path, x, positions, kv, comm, iters) if path == "fp2-fused" else None
        write_ms = self._write_ms(kv, B, iters)
        floors = self._floors(kv, B, topk_idx)
        keys, kv_write_format = kv.keys, kv.name
        experts_path = choose_experts_path(h2, self.shard, out.topk_idx.numel())
        del kv
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return {
            "bench": "decode",
            "model": self.model,
            "layer": self.idx,
            "path": path,
            "dispatch": self.backends[path],
            "B": B,
            "L": L,
            **{f"{s}_ms": round(med[s], 4) for s in (*STAGES, "total")},
            **{f"{s}_floor_ms": round(floors[s], 4) for s in (*STAGES, "total")},
            "floor_ratio": round(med["total"] / floors["total"], 3),
            "kv_write_ms": round(write_ms, 4),  # inside attention_ms; see the module docstring
            "kv_write_format": kv_write_format,
            # the whole pass replayed from one CUDA graph (device time; None: not capturable here,
            # e.g. the host path, which syncs the host inside dispatch)
            "total_graph_ms": None if graph_ms is None else round(graph_ms, 4),
            "graph_floor_ratio": None if graph_ms is None else round(graph_ms / floors["total"], 3),
            "tok_s_projected": round(B / (med["total"] * 1e-3 * self.full_cfg.num_layers), 2),
            "kv_bytes": floors["kv_bytes"],
            "weight_bytes": floors["weight_bytes"],
            "experts_touched": floors["experts_touched"],
            "experts_path": experts_path,
            "experts_kernel_config": str(DEFAULT_CONFIG) if experts_path == "kernel" else None,
            "attention_keys": keys,
            "hbm_bytes_per_s": round(self.copy_bw),
            "device": self.device_name,
            "iters": iters,
            "date": time.strftime("%Y-%m-%d"),
        }

    def _graph_total(self, path: str, x: Any, positions: Any, kv: Any, comm: Any, iters: int) -> float | None:
        """Median ms of one whole pass captured in a CUDA graph and replayed (GPU; else None).

        The staged timing above launches eagerly from Python, so the GPU waits on the host between
        stages; a served decode step runs from a graph, and this is what the device alone takes.
        """
        import torch

        if self.dev.type != "cuda":
            return None

        def one_pass() -> None:
            h = self._attention(x, positions, kv)
            h2, out = self._dispatch(path, h, comm)
            y, y_shared = self._experts(h2, out)
            y = comm.combine(y, out)
            _ = h + y if y_shared is None else h + y + y_shared

        try:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                one_pass()
        except Exception as err:  # a host sync or an allocation the capture refuses
            print(f"bench decode: {path} not capturable in one graph: {err}", file=sys.stderr)
            torch.cuda.synchronize()
            return None
        times = []
        for i in range(iters + 3):
            self.flush.sum()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b))
        comm.check()
        if self.profile:
            report.print_kernel_times(graph, self.flush, f"{path} B={x.shape[0]} L={int(positions[0])}")
        return statistics.median(times)

    def _attention(self, x: Any, positions: Any, kv: Any) -> Any:
        """x [B, D] -> x + attention over `kv` (which takes the new token's K/V first)."""
        import torch.nn.functional as F

        from zerodram.runtime.model.transformer import rms_norm

        cfg, w = self.cfg, self.w
        B, Hq, Hkv, Dh = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        q = F.linear(h, w["q"], w.get("q_bias")).view(B, Hq, Dh)  # [B, Hq, Dh]
        k = F.linear(h, w["k"], w.get("k_bias")).view(B, Hkv, Dh)  # [B, Hkv, Dh]
        v = F.linear(h, w["v"], w.get("v_bias")).view(B, Hkv, Dh)
        if "q_norm" in w:
            q, k = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q, k = self.rope.apply(q, k, self.rope.cos_sin(positions, q.dtype))
        kv.write(k, v)
        o = kv.attend(q)  # [B, Hq, Dh]
        return x + F.linear(o.reshape(B, Hq * Dh).to(x.dtype), w["o"])

    def _write_ms(self, kv: Any, B: int, iters: int) -> float:
        """Median device ms of the K/V write alone (after a warm-up)."""
        import torch

        cfg = self.cfg
        k = torch.randn(B, cfg.num_kv_heads, cfg.head_dim, device=self.dev).to(torch.bfloat16)
        times = []
        for i in range(iters + 3):
            a = self.clock.mark()
            kv.write(k, k)
            b = self.clock.mark()
            if i >= 3:
                times.append(self.clock.between_ms(a, b))
        return statistics.median(times)

    def _dispatch(self, path: str, h: Any, comm: Any) -> tuple:
        from zerodram.runtime.model.transformer import rms_norm

        h2 = rms_norm(h, self.w["ffn_norm"], self.cfg.rms_norm_eps)
        # fp2-fused on NVSHMEM: the gate projection, top-k and the sends are one kernel; the
        # torch backend computes the same router in torch first (route_on_host), then dispatches.
        return h2, comm.dispatch(h2, gate_weight=self.w["router"])

    def _experts(self, h2: Any, out: Any) -> tuple[Any, Any]:
        """(routed outputs [N, D] in packed order, the shared expert's [B, D] or None)."""
        from zerodram.runtime.model.moe import SharedExpert
        from zerodram.runtime.moe.experts import grouped_swiglu

        # both paths: the runtime's choice for this step size (the decode kernel on a GPU), so that
        # the comparison isolates the KV format and the dispatch
        y = grouped_swiglu(out.recv_x, out.recv_expert_offsets, self.shard, sent_rows=out.topk_idx.numel())  # [N, D]
        w = self.w
        if "shared.gate" not in w:
            return y, None
        shared = SharedExpert(w["shared.gate"], w["shared.up"], w["shared.down"], w.get("shared.sigmoid_gate"))
        return y, shared(h2)

    def _floors(self, kv: Any, B: int, topk_idx: Any) -> dict:
        cfg = self.cfg
        D, Hq, Hkv, Dh, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts_per_tok
        attn_w = 2 * D * (Hq + 2 * Hkv) * Dh + 2 * Hq * Dh * D  # bf16 q, k, v, o
        kv_bytes = kv.kv_bytes
        touched = len(set(topk_idx.flatten().tolist()))
        F_ = cfg.moe_intermediate_size
        expert_w = 2 * cfg.num_experts * D + touched * 3 * F_ * D * 2  # router + gate/up/down
        expert_w += 3 * cfg.shared_expert_intermediate_size * D * 2
        row_bytes = B * K * D * 2
        link = self.copy_bw / 2  # one rank: a local copy, per direction
        f = {
            "attention": (attn_w + kv_bytes) / self.copy_bw * 1e3,
            "dispatch": row_bytes / link * 1e3,
            "experts": expert_w / self.copy_bw * 1e3,
            "combine": row_bytes / link * 1e3,
        }
        f["total"] = sum(f.values())
        return {**f, "kv_bytes": kv_bytes, "weight_bytes": attn_w + expert_w, "experts_touched": touched}


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
