"""The `demo` worker job: the packaged SmolLM2 served as experts over every rank, real text out.

    zerodram demo                                   # = zerodram launch --topology local-cpu-4 -- demo
    zerodram launch --topology local-cpu-4 -- demo --max-tokens 32 --no-dashboard

Rank 0 converts the packaged GGUF once (cached), every rank then loads its FFN slices (its
experts) and the replicated attention, and the engine serves a few chat prompts with the FP2 KV
cache (bf16 pages when the FP2 cache is not available). Rank 0 shows the metrics dashboard on a
terminal (plain status lines otherwise) and prints each answer as it finishes.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Any

from zerodram.runtime.engine.jobs import add_engine_args, build_from_args
from zerodram.runtime.engine.request import SamplingParams

PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain in one sentence what a mixture-of-experts model is.",
)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="demo", description="serve the packaged SmolLM2 as experts")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per answer")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: four built-in)")
    p.add_argument("--no-dashboard", action="store_true", help="plain lines instead of the live view")
    p.add_argument("--metrics-file", default=None, help="append metrics JSON lines here (rank 0)")
    return p.parse_args(argv)


def _metrics(ctx: Any, engine: Any, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(bridge, agent, dashboard) or Nones when runtime/metrics is unavailable."""
    try:
        from zerodram.runtime.engine.metrics_bridge import MetricsBridge
        from zerodram.runtime.metrics import MetricsAgent, MetricsCollector, StorePublisher, StoreReader
    except ImportError:
        return None, None, None
    cfg = engine.model.config
    e2r = engine.expert_to_rank
    collector = MetricsCollector(
        ctx.rank,
        ctx.world_size,
        ctx.device,
        num_layers=cfg.num_layers,
        expert_idx=range(len(e2r or ())),
        kv_quality_period=8,
    )
    elem = 2 if engine.model.dtype.itemsize == 2 else 4
    bridge = MetricsBridge(collector, e2r, cfg.hidden_size, elem)
    agent = MetricsAgent(collector, StorePublisher(ctx.rank)).start()
    dash = None
    if ctx.rank == 0:
        # A job may reach up to the launch-side dashboard (the engine never does); by name only.
        dashboard = importlib.import_module("zerodram.launch.dashboard")
        mode = dashboard.dashboard_mode(args.no_dashboard)
        dash = dashboard.Dashboard(
            ctx.topology, StoreReader(ctx.world_size), mode=mode, metrics_file=args.metrics_file
        )
    return bridge, agent, dash


def run_demo(ctx: Any, argv: list[str]) -> int:
    """The demo job; returns 0. Every rank runs it (the engine loop is collective)."""
    import torch

    args = _parse(argv)
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # four ranks on two cores: OpenMP spinning would swamp them
    t0 = time.perf_counter()
    if args.model == "smollm2":
        from zerodram.runtime.loading.checkpoint import ModelSpec, checkpoint_dir

        if ctx.rank == 0:
            print(
                "zerodram demo: preparing the packaged SmolLM2-135M-Instruct (converted once, cached)",
                flush=True,
            )
            checkpoint_dir(ModelSpec.parse("smollm2"))
        ctx.barrier("packaged model converted")
    engine = build_from_args(args, ctx)
    bridge, agent, dash = _metrics(ctx, engine, args)
    if bridge is not None:
        engine.attach_observer(bridge, bridge.on_step)
    cfg = engine.model.config
    if ctx.rank == 0:
        print(
            f"zerodram demo: {engine.model_name} as {cfg.num_experts} experts over {ctx.world_size} rank(s), "
            f"KV {engine.kv.kv_format} ({engine.kv.num_pages} pages x {engine.kv.page_size} per rank), "
            f"loaded in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
    prompts = list(args.prompt or PROMPTS)
    params = [SamplingParams(max_tokens=args.max_tokens) for _ in prompts]
    if len(params) > 2:
        params[2] = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=7)
    if dash is not None:
        dash.start()
    t1 = time.perf_counter()
    try:
        outs = engine.generate(prompts, params, chat=True)
    finally:
        if dash is not None:
            dash.stop()
        ctx.barrier("demo done")
        if agent is not None:
            agent.stop()
    if ctx.rank == 0:
        secs = time.perf_counter() - t1
        num = sum(len(o.token_ids) for o in outs)
        for prompt, out in zip(prompts, outs, strict=True):
            print(
                f"\n> {prompt}\n[rank {out.rank}, {len(out.token_ids)} tokens, {out.finish_reason}] "
                f"{out.text}"
            )
        print(
            f"\nzerodram demo: {num} tokens in {secs:.1f}s ({num / max(secs, 1e-9):.1f} tok/s over "
            f"{ctx.world_size} ranks), total {time.perf_counter() - t0:.1f}s"
        )
        sys.stdout.flush()
    return 0
