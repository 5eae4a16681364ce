"""`zerodram demo`: the README's main job: the packaged SmolLM2 served as experts on local ranks.

    zerodram demo                                   # local-cpu-4: four CPU ranks via torchrun
    zerodram demo -- --max-tokens 24 --no-dashboard
is `zerodram launch --topology local-cpu-4 -- demo ...`; `demo_job` is what every rank runs.

Rank 0 converts the packaged GGUF once (cached), every rank then loads its FFN slices (its
experts) and the replicated attention, and the engine serves a few chat prompts with the FP2 KV
cache. Rank 0 shows the dashboard on a terminal (plain status lines otherwise) and prints each
answer when all are done.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain in one sentence what a mixture-of-experts model is.",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from zerodram.launch.dashboard import add_dashboard_args
    from zerodram.runtime.argtypes import int_at_least
    from zerodram.runtime.engine.jobs import add_engine_args

    p = argparse.ArgumentParser(prog="demo", description="serve the packaged SmolLM2 as experts")
    add_engine_args(p)
    # 64 pages x 32 tokens (2048 tokens per rank): ample for the demo, and its KV bars show
    p.set_defaults(num_kv_pages=64)
    add_dashboard_args(p)
    p.add_argument("--max-tokens", type=int_at_least(1), default=40, help="tokens per answer")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: four built-in)")
    return p.parse_args(argv)


def demo_job(ctx: Any, argv: list[str]) -> int:
    """The demo worker job. Every rank runs it (the engine loop is collective); rank 0 returns 1
    when an answer failed or the --svg could not be saved, else 0."""
    import torch

    from zerodram.launch.observe import observe
    from zerodram.runtime.engine.jobs import build_from_args
    from zerodram.runtime.engine.request import SamplingParams

    args = parse_args(argv)
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # four ranks on two cores: OpenMP spinning would swamp them
    t0 = time.perf_counter()
    engine = build_from_args(args, ctx)  # converts the packaged GGUF once per node first
    cfg = engine.model.config
    if ctx.rank == 0:
        print(
            f"zerodram demo: {engine.model_name} as {cfg.num_experts} experts over {ctx.world_size} "
            f"rank(s), KV {engine.kv.kv_format} ({engine.kv.num_pages} pages x {engine.kv.page_size} "
            f"tokens per rank), loaded in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
    prompts = list(args.prompt or PROMPTS)
    params = [SamplingParams(max_tokens=args.max_tokens) for _ in prompts]
    if len(params) > 2:  # one sampled answer among the greedy ones
        params[2] = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=7)
    t1 = time.perf_counter()
    with engine, observe(ctx, engine, args) as dash:
        outs = engine.generate(prompts, params, chat=True)
    if ctx.rank == 0:
        secs = time.perf_counter() - t1
        num = sum(len(o.token_ids) for o in outs)
        for prompt, out in zip(prompts, outs, strict=True):
            body = out.text if out.error is None else f"error: {out.error}"
            print(f"\n> {prompt}\n[rank {out.rank}, {len(out.token_ids)} tokens, {out.finish_reason}] {body}")
        print(
            f"\nzerodram demo: {num} tokens in {secs:.1f}s ({num / max(secs, 1e-9):.1f} tok/s over "
            f"{ctx.world_size} ranks), total {time.perf_counter() - t0:.1f}s"
        )
        sys.stdout.flush()
        return 1 if any(o.error is not None for o in outs) or "svg" in dash.failed else 0
    return 0


def _cmd(args: argparse.Namespace) -> int:
    from zerodram.launch import launcher

    rest = list(args.job_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    port = args.master_port
    if port is None and _single_host(args.topology):
        port = _free_port()  # a second demo (or a test) on this host must not collide on 29500
    ns = argparse.Namespace(
        topology=args.topology,
        node_rank=0,
        master_port=port,
        dry_run=args.dry_run,
        job=["demo", *rest],
    )
    return launcher._cmd(ns)


def _single_host(topology_arg: str) -> bool:
    from zerodram.runtime.topology import load_topology, resolve_topology_path

    topo = load_topology(resolve_topology_path(topology_arg))
    return topo.num_nodes == 1 and topo.master_addr in ("127.0.0.1", "localhost")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="serve the packaged SmolLM2 as experts on the local topology's ranks, with the dashboard",
        description="Spawn the topology's ranks (torchrun), load the packaged SmolLM2-135M-Instruct "
        "sliced into experts, generate answers to a few prompts with the FP2 KV cache, show metrics. "
        "Options after -- go to every rank (demo -- --help lists them).",
    )
    p.add_argument("--topology", default="local-cpu-4", help="topology file or packaged name")
    p.add_argument("--master-port", type=int, default=None, help="default: a free port on one host")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command only")
    p.add_argument(
        "job_args", nargs=argparse.REMAINDER, help="-- [--max-tokens N] [--prompt P] [--no-dashboard] ..."
    )
    p.set_defaults(func=_cmd)
