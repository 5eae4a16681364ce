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
import math
import statistics
import sys
import time
from typing import Any

PATHS = ("fp2-fused", "bf16-host")
STAGES = ("attention", "dispatch", "experts", "combine")
GPU = {"model": "seed-700b", "batches": "1,8,64", "contexts": "8192,32768,131072"}
# CPU: a small MoE layer the FP2 kernels' shape rules accept (head dim 64, <= 8 q heads per kv head)
CPU = {"model": "small", "batches": "1,4", "contexts": "256,1024"}
PAGE, NUM_SINKS, TAIL = 64, 4, 32  # FP2 layout: 4 sinks + up to 32 tail tokens in bf16 (HP = 36)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print only the JSON lines (one per case)")
    p.add_argument("--model", default=None, help="named config (default: seed-700b on GPU, 'small' on CPU)")
    p.add_argument("--batches", default=None, help="comma list of B (default GPU 1,8,64; CPU 1,4)")
    p.add_argument("--contexts", default=None, help="comma list of L (default GPU 8k,32k,128k; CPU 256,1024)")
    p.add_argument("--paths", default=",".join(PATHS), help="comma list of fp2-fused,bf16-host")
    p.add_argument("--fused-backend", default="auto", help="EP backend of fp2-fused: auto | nvshmem | torch")
    p.add_argument("--iters", type=int, default=None, help="timed passes per case (GPU 20, CPU 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes per case")
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
    batches = [int(b) for b in (args.batches or grid["batches"]).split(",")]
    contexts = [int(n) for n in (args.contexts or grid["contexts"]).split(",")]
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
            _print_tables(rows, bench)
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
        kv = self._fp2_kv(B, L, gen) if path == "fp2-fused" else self._bf16_kv(B, L, gen)
        comm = self.comms[path]
        positions = torch.full((B,), L, device=self.dev, dtype=torch.int64)
        samples: dict[str, list[float]] = {s: [] for s in (*STAGES, "total")}
        topk_idx = None
        for i in range(warmup + iters):
            if self.flush is not None:
                self.flush.sum()  # read-only: a write leaves dirty L2 lines for the timed pass
            marks = [self.clock.mark()]
            h = self._attention(path, x, positions, kv)
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
        write_ms = self._write_ms(path, kv, B, iters)
        floors = self._floors(path, B, L, topk_idx)
        # which attention kernel variant ran (fp2 path: kv = (Fp2DecodeAttention, ...))
        keys = ("int8" if kv[0].key_s8 else "fp16") if path == "fp2-fused" and kv[0].on_gpu else None
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
            "kv_write_format": "DEFAULT_FP2 static write" if path == "fp2-fused" else "bf16 row store",
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

    def _graph_total(self, path: str, x: Any, positions: Any, kv: tuple, comm: Any, iters: int) -> float | None:
        """Median ms of one whole pass captured in a CUDA graph and replayed (GPU; else None).

        The staged timing above launches eagerly from Python, so the GPU waits on the host between
        stages; a served decode step runs from a graph, and this is what the device alone takes.
        """
        import torch

        if self.dev.type != "cuda":
            return None

        def one_pass() -> None:
            h = self._attention(path, x, positions, kv)
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
            _print_kernel_times(graph, self.flush, f"{path} B={x.shape[0]} L={int(positions[0])}")
        return statistics.median(times)

    def _fp2_kv(self, B: int, L: int, gen: Any) -> tuple:
        """FP2 pages for B sequences of L tokens (L - 36 FP2 tokens + 36 bf16), its kernel, rotations."""
        import torch

        from zerodram.runtime.attention import Fp2DecodeAttention, random_decode_batch, random_fp2_layer

        cfg = self.cfg
        hp = min(L, NUM_SINKS + TAIL)
        n_fp2 = L - hp
        pages = max(1, B * math.ceil(n_fp2 / PAGE))
        writer = self._fp2_writer(B, L, gen)
        v_layout = writer[0].v.layout  # the value layout the engine's cache stores (and its kernel reads)
        layer = random_fp2_layer(
            pages, cfg.num_kv_heads, PAGE, cfg.head_dim, device=self.dev, generator=gen, v_layout=v_layout
        )
        batch = random_decode_batch(
            [n_fp2] * B, [hp] * B, pages, cfg.num_kv_heads, PAGE, cfg.head_dim, hp_max=NUM_SINKS + TAIL,
            device=self.dev, generator=gen,
        )  # fmt: skip
        attn = Fp2DecodeAttention(
            num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=PAGE,
            max_batch=B, max_fp2_tokens=max(n_fp2, 1), device=self.dev, v_layout=v_layout,
        )  # fmt: skip
        # The cache's stored space: a random rotation per side and unit anchors (values don't matter).
        rot = torch.linalg.qr(torch.randn(2, cfg.head_dim, cfg.head_dim, device=self.dev, generator=gen))[0]
        anchor = torch.ones(cfg.num_kv_heads, cfg.head_dim, device=self.dev)
        return attn, layer, batch, rot, anchor, n_fp2, writer

    def _fp2_writer(self, B: int, L: int, gen: Any) -> tuple:
        """(cache, static index) for the engine's decode write of B sequences that hold L tokens:
        an `Fp2KVCache` of `DEFAULT_FP2` whose block tables name one page per FP2 page of the
        sequence (the write touches only the current one), positioned at L."""
        import torch

        from zerodram.runtime.kv.cache import make_kv_cache
        from zerodram.runtime.kv.decode_index import StaticDecodeIndex
        from zerodram.runtime.kv.format import DEFAULT_FP2

        H, D = self.cfg.num_kv_heads, self.cfg.head_dim
        cache = make_kv_cache(
            DEFAULT_FP2, num_pages=3 * B + 1, page_size=PAGE, num_kv_heads=H, head_dim=D, max_seqs=B,
            max_pages_per_seq=L // PAGE + 2, device=self.dev,
        )  # fmt: skip
        factor = torch.eye(D, device=self.dev) + 0.1 * torch.randn(H, D, D, device=self.dev, generator=gen).tril(-1)
        cache.params = tuple(
            dataclasses.replace(p, feedback=factor) if side.feedback else p
            for p, side in zip(cache.params, (cache.spec.k, cache.spec.v), strict=True)
        )
        for _ in range(B):
            sid = cache.new_sequence()
            page = cache.allocator.allocate(1)[0]
            cache.tables.pages[sid] = [page] * cache._pages_needed(L, 0)
            cache.tables.lens[sid] = L
        ix = StaticDecodeIndex.allocate(B, self.dev)
        ix.fill(cache.plan_decode_static(range(B)), cache.scratch_slot, cache.scratch_page)
        return cache, ix

    def _bf16_kv(self, B: int, L: int, gen: Any) -> tuple:
        import torch

        cfg = self.cfg
        shape = (B, cfg.num_kv_heads, L, cfg.head_dim)  # [B, Hkv, L, Dh]
        k = torch.randn(shape, device=self.dev, generator=gen, dtype=torch.bfloat16)
        return k, torch.randn(shape, device=self.dev, generator=gen, dtype=torch.bfloat16)

    def _attention(self, path: str, x: Any, positions: Any, kv: tuple) -> Any:
        import torch.nn.functional as F

        from zerodram.runtime.attention import finish_output, prepare_query
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
        self._write(path, kv, k, v)
        if path == "fp2-fused":
            attn, layer, batch, rot, anchor, n_fp2, _ = kv
            G = Hq // Hkv
            o = attn(prepare_query(q, rot[0], anchor, G), layer, batch, max_len=max(n_fp2, 1))  # [B, Hq, Dh]
            o = finish_output(o, rot[1], anchor, G)
        else:
            k_cache, v_cache = kv
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], k_cache, v_cache, enable_gqa=True
            )[:, :, 0, :]  # [B, Hq, Dh]
        return x + F.linear(o.reshape(B, Hq * Dh).to(x.dtype), w["o"])

    def _write(self, path: str, kv: tuple, k: Any, v: Any) -> None:
        """The new token's K/V into the path's cache (k, v [B, Hkv, Dh]; see the module docstring)."""
        if path == "fp2-fused":
            cache, ix = kv[-1]
            cache.write_decode_static(k, v, ix)  # the same row every pass: the work is what counts
        else:
            k_cache, v_cache = kv
            k_cache[:, :, -1] = k
            v_cache[:, :, -1] = v

    def _write_ms(self, path: str, kv: tuple, B: int, iters: int) -> float:
        """Median device ms of the K/V write alone (after a warm-up)."""
        import torch

        cfg = self.cfg
        k = torch.randn(B, cfg.num_kv_heads, cfg.head_dim, device=self.dev).to(torch.bfloat16)
        times = []
        for i in range(iters + 3):
            a = self.clock.mark()
            self._write(path, kv, k, k)
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

    def _floors(self, path: str, B: int, L: int, topk_idx: Any) -> dict:
        cfg = self.cfg
        D, Hq, Hkv, Dh, K = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts_per_tok
        attn_w = 2 * D * (Hq + 2 * Hkv) * Dh + 2 * Hq * Dh * D  # bf16 q, k, v, o
        if path == "fp2-fused":
            hp = min(L, NUM_SINKS + TAIL)
            # per token and kv head: D/4 code bytes + D/64 e4m3 scale bytes, for K and V; bf16 tail
            kv_bytes = B * Hkv * ((L - hp) * 2 * (Dh // 4 + Dh // 64) + hp * Dh * 2 * 2)
        else:
            kv_bytes = B * Hkv * L * Dh * 2 * 2
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


def _print_kernel_times(graph: Any, flush: Any, label: str, reps: int = 5) -> None:
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


def _print_tables(rows: list[dict], bench: LayerBench) -> None:
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



if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
