"""Routed SwiGLU experts at decode sizes: the expert kernel vs `torch._grouped_mm` vs a per-expert loop.

    python benchmarks/experts.py [--json] [--batches 1,8,64,256] [--model seed-700b]
    zerodram bench experts ...

Shape legend: B tokens, K top-k, N = B * K packed rows, D hidden, F expert FFN, E experts (all on
this one GPU).

Each case routes B random tokens to K of E experts (uniform, a fixed seed), packs the rows
expert-major as a dispatch does, and times the three paths of `grouped_swiglu` on the same rows and
weights: `kernel` (kernels/cuda/moe_experts.cu) and `grouped` replayed from a CUDA graph, `loop`
(one cuBLAS SwiGLU per active expert, the reference; it reads the counts on the host) launched
eagerly. CUDA events around each repetition, a 256 MB L2 flush (a read) before each, warm-up,
medians. The floor is the bytes of the distinct experts routed to (gate, up, down) over the
measured copy bandwidth (read + write counted: reads alone run a little faster, so a path can come
in just under it).
"""

from __future__ import annotations

import argparse
import json
import sys

from zerodram.runtime.argtypes import int_list

PATHS = ("kernel", "grouped", "loop")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="seed-700b", help="named configuration whose expert shape is used")
    p.add_argument("--batches", type=int_list, default="1,8,64,256")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--configs",
        default="",
        help="also time these kernel variants GATE_UP/DOWN (each ROW_TILESxKSPLITxUNROLL), comma separated (a sweep: "
        "the table's kernel column is always the runtime's default)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per case")


def run(args: argparse.Namespace) -> int:
    import torch

    from zerodram.kernels.experts import DEFAULT_CONFIG, ExpertsConfig, swiglu_experts_cuda
    from zerodram.runtime.metrics.devtime import copy_bandwidth, median_ms
    from zerodram.runtime.model.named import named_config
    from zerodram.runtime.moe.experts import ExpertShard, grouped_swiglu, has_grouped_mm

    if not torch.cuda.is_available():
        print("experts benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = named_config(args.model)
    E, K, D, F_ = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, fan_in: int) -> torch.Tensor:
        return (
            torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16) / fan_in**0.5
        ).contiguous()

    shard = ExpertShard(
        tuple(range(E)), rnd(E, F_, D, fan_in=D), rnd(E, F_, D, fan_in=D), rnd(E, D, F_, fan_in=F_)
    )
    flush = torch.zeros(64 << 20, dtype=torch.float32, device=dev)
    copy_bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    expert_bytes = 3 * F_ * D * 2
    print(
        f"# {name}, {args.model} experts: E={E} top-{K} D={D} F={F_} ({expert_bytes / 1e6:.0f} MB each), "
        f"copy bandwidth {copy_bw / 1e12:.2f} TB/s",
        flush=True,
    )
    paths = [p for p in PATHS if p != "grouped" or has_grouped_mm("cuda", torch.bfloat16)]
    rows = []
    for B in args.batches:
        g = torch.Generator().manual_seed(B)
        topk = torch.rand(B, E, generator=g).topk(K, dim=1).indices  # [B, K] distinct experts per token
        counts = torch.bincount(topk.flatten(), minlength=E)  # [E]
        N = B * K
        x = torch.randn(N, D, device=dev, generator=gen, dtype=torch.bfloat16)  # [N, D] packed rows
        ends = counts.cumsum(0).to(device=dev, dtype=torch.int32)
        touched = int((counts > 0).sum())
        floor = touched * expert_bytes / copy_bw * 1e3
        row = {"bench": "experts", "model": args.model, "B": B, "rows": N, "experts_touched": touched,
               "max_rows_per_expert": int(counts.max()), "weight_bytes": touched * expert_bytes,
               "floor_ms": round(floor, 4)}  # fmt: skip
        ref = grouped_swiglu(x, ends, shard, "loop")
        for path in paths:
            out = grouped_swiglu(x, ends, shard, path)
            err = float((out[:N].float() - ref[:N].float()).abs().max())
            ms = median_ms(
                lambda p=path, x=x, ends=ends: grouped_swiglu(x, ends, shard, p),
                args.reps,
                flush,
                graph=path != "loop",
            )
            row[f"{path}_ms"] = round(ms, 4)
            row[f"{path}_floor_ratio"] = round(ms / floor, 3)
            row[f"{path}_max_err_vs_loop"] = round(err, 5)
        sweep = {}
        for c in (ExpertsConfig.parse(t) for t in args.configs.split(",") if t):

            def fn(c=c, x=x, ends=ends):
                return swiglu_experts_cuda(x, ends, shard.w_gate, shard.w_up, shard.w_down, c)

            sweep[str(c)] = round(median_ms(fn, args.reps, flush, graph=True), 4)
        if sweep:
            row["kernel_default_config"] = str(DEFAULT_CONFIG)
            row["kernel_sweep_ms"] = sweep
            print(f"# B={B} sweep (ms): {sweep}", flush=True)
        if "grouped_ms" in row:
            row["kernel_speedup_vs_grouped"] = round(row["grouped_ms"] / row["kernel_ms"], 3)
        row["kernel_speedup_vs_loop"] = round(row["loop_ms"] / row["kernel_ms"], 3)
        rows.append(row)
        if args.json:
            print(json.dumps({**row, "device": name, "copy_bw": round(copy_bw)}), flush=True)
    print(
        f"\n{'B':>4} {'rows':>5} {'experts':>7} {'max/exp':>7} {'floor ms':>8} "
        + " ".join(f"{p + ' ms':>13}" for p in paths)
    )
    for r in rows:
        cells = " ".join(f"{r[p + '_ms']:>7.3f} ({r[p + '_floor_ratio']:.2f}x)" for p in paths)
        print(
            f"{r['B']:>4} {r['rows']:>5} {r['experts_touched']:>7} {r['max_rows_per_expert']:>7} {r['floor_ms']:>8.3f} {cells}"
        )
    print("(x): time over the floor, the touched experts' weight bytes at the copy bandwidth")
    return 0



if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
