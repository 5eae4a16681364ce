"""The engine's whole decode step, eager vs CUDA graphs, FP2 vs BF16 KV (SmolLM2 by default).

    python benchmarks/engine_step.py [--json]                       # GPU: B 1/8/16, 512-token prompts
    python benchmarks/engine_step.py --batches 1,4 --context 64 --steps 4    # CPU smoke (graphs ignored)

Shape legend: B decode sequences, L tokens in the KV per sequence.

For each KV format and graphs off/on, one engine serves B requests of `context` random prompt
tokens; once every request decodes, `Engine.step()` is timed `--steps` times after `--warmup`
untimed steps: scheduling, the forward pass (KV writes, attention, experts), sampling and the
host bookkeeping, i.e. what serving pays per token. No L2 flush: a serving step follows another.
Timing: CUDA events around each step on a GPU (the step's own sampling syncs it), perf_counter on
CPU; median and p90 per case. A table, then one JSON line per case (`--json`). With graphs on,
each `--defer-write` mode is a case of its own (the KV write after the decode, beside the step, or
before it: docs/fp2-kernel.md, "Codes at arrival, and the write after the decode").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from zerodram.runtime.argtypes import int_list
from zerodram.runtime.context import one_process_context
from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
from zerodram.runtime.engine.build import build_engine
from zerodram.runtime.engine.fp2_decode import Fp2FusedDecode
from zerodram.runtime.kv.format import DEFAULT_FP2

PROFILE_STEPS = 3
STEP_TOKENS = 512  # the scheduler's token budget per step
FP2 = "fp2"  # bare fp2: no calibration; flushes 32 tokens at a time, so its graphs are piecewise


def _max_tokens(batch: int, context: int, warmup: int, steps: int) -> int:
    """Each request's token budget, so that every measured step decodes all B sequences: prefill
    is staggered (STEP_TOKENS a step, the first requests decoding meanwhile), then the warm-up,
    timed and profiled steps, and one more."""
    return math.ceil(batch * context / STEP_TOKENS) + warmup + steps + PROFILE_STEPS + 2


def _time_steps(
    engine, batch: int, context: int, warmup: int, steps: int, seed: int, profile: bool = False
) -> list[float]:
    """Milliseconds of each timed decode step of `batch` sequences (`profile`: then print the
    kernels of 3 more steps, GPU only)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    for _ in range(batch):
        rid = engine.new_request_id()
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        params = SamplingParams(max_tokens=_max_tokens(batch, context, warmup, steps), ignore_eos=True)
        engine.add_request(engine.validate(rid, prompt, params))
    sched = engine.scheduler
    while sched.waiting or not all(r.prefill_done for r in sched.running):
        engine.step()
    cuda = engine.device.type == "cuda"
    times = []
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine.step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    if profile and cuda:
        _profile_steps(engine, PROFILE_STEPS)
    while engine.has_work:  # let the requests finish
        engine.step()
    return times


def _profile_steps(engine, n: int) -> None:
    """The device activity of `n` decode steps: per step the kernels and copies and their summed
    time, then the busiest kernel names."""
    from zerodram.runtime.metrics.devtime import device_activity

    acts = device_activity(engine.step, n)
    print(f"profile: per step {sum(c for _, _, c in acts):.0f} kernels and copies, "
          f"{sum(us for _, us, _ in acts) / 1e3:.3f} ms of device time")  # fmt: skip
    print(f"{'us per step':>12} {'count':>6}  kernel (all {n} steps)")
    for name, us, c in acts[:15]:
        print(f"{us:12.1f} {c:6.0f}  {name[:80]}")


def _graph_mode(engine) -> str | None:
    """ "whole" (the step in one graph), "piecewise" (graphs between eager attention calls) or None."""
    if engine.graphs is None:
        return None
    return "whole" if all(s.static_attn is not None for s in engine.graphs.steps.values()) else "piecewise"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--kv",
        default=f"{FP2};{DEFAULT_FP2};bf16",
        help="semicolon-separated KV formats (the default calibrates)",
    )
    p.add_argument("--batches", type=int_list, default="1,8,16")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--dtype", default=None, help="weights: bf16 on GPU, fp32 on CPU by default")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--defer-write", default="auto",
        help="comma list of auto,on,off: EngineConfig.defer_write of the graph cases, each timed",
    )  # fmt: skip
    p.add_argument(
        "--profile", action="store_true",
        help="GPU: after each case's timing, the device activity of 3 steps at the largest batch (torch profiler)",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    ctx = one_process_context()
    cuda = ctx is not None
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    batches = list(args.batches)
    max_b = max(batches)
    tokens = args.context + _max_tokens(max_b, args.context, args.warmup, args.steps)  # per sequence, at most
    modes = [{"auto": "auto", "on": True, "off": False}[m] for m in args.defer_write.split(",")]
    rows = []
    # Each row is printed as it is timed (a run cut short by a time limit keeps what it measured),
    # then the JSON lines.
    print(f"{'kv':>26} {'graphs':>9} {'deferred':>8} {'B':>4} {'median ms':>10} {'p90 ms':>8} {'tok/s':>9}", flush=True)
    for kv in args.kv.split(";"):
        for graphs, defer in [(False, modes[0]), *((True, m) for m in modes)]:
            config = EngineConfig(
                kv_format=kv,
                num_kv_pages=max_b * math.ceil(tokens / 32) + 8,
                page_size=32,
                scheduler=SchedulerConfig(max_b, max(max_b, STEP_TOKENS), STEP_TOKENS),
                cuda_graphs=graphs,
                defer_write=defer,
            )
            t0 = time.perf_counter()
            engine = build_engine(args.model, ctx, config, dtype=dtype)
            build_s = time.perf_counter() - t0
            for b in batches:
                ms = _time_steps(
                    engine,
                    b,
                    args.context,
                    args.warmup,
                    args.steps,
                    seed=b,
                    profile=args.profile and b == max_b,
                )
                med = statistics.median(ms)
                rows.append({
                    "bench": "engine_step", "model": args.model, "device": str(engine.device),
                    "dtype": dtype, "kv": kv, "fused_decode": isinstance(engine.attn.decode, Fp2FusedDecode),
                    "cuda_graphs": engine.graphs is not None, "graph_mode": _graph_mode(engine),
                    "defer_write": bool(getattr(engine.attn.decode, "defers_write", False)),
                    "batch": b, "context": args.context,
                    "steps": len(ms), "median_ms": round(med, 4),
                    "p90_ms": round(statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else med, 4),
                    "tok_s": round(b / med * 1e3, 1), "build_s": round(build_s, 2),
                })  # fmt: skip
                r = rows[-1]
                print(
                    f"{r['kv']:>26} {r['graph_mode'] or 'off':>9} {'yes' if r['defer_write'] else 'no':>8} "
                    f"{r['batch']:>4} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} {r['tok_s']:>9.1f}",
                    flush=True,
                )
            del engine
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
