"""The metrics demo job: every rank runs a small synthetic decode loop, rank 0 shows the dashboard.

    zerodram launch --topology local-cpu-4 -- metrics-demo --seconds 8
    run_ranks(run_metrics_demo, 4, args=(["--seconds", "2", "--no-dashboard"],))   # tests

The numbers are synthetic but come from real work on small tensors, so they behave like the
engine's: attention is a matmul over a growing context, the router takes a real top-k over
skewed logits whose hot expert drifts (expert counts and dispatch bytes follow from its choices),
K/V blocks are really quantized to 2 bits and fed to the KV-quality sampler. Requests arrive and
finish at random, filling and draining the KV pages. A short sleep per step keeps four ranks on
two cores responsive. Everything is seeded by rank, so runs repeat.

Shapes (legend): B requests decoding, D hidden, E experts, K top-k, H heads, Dh head dim.
"""

from __future__ import annotations

import argparse
import importlib
import io
import time
from pathlib import Path
from typing import Any

import torch

from zerodram.runtime.context import RankContext
from zerodram.runtime.metrics.agent import MetricsAgent
from zerodram.runtime.metrics.collector import MetricsCollector
from zerodram.runtime.metrics.transport import StorePublisher, StoreReader

NUM_LAYERS = 8
HIDDEN = 64
TOP_K = 2
NUM_HEADS, HEAD_DIM = 4, 16
PAGE_SIZE = 16
NUM_PAGES = 512
# FP2 page: 2 bits per K and V element plus one BF16 scale per row of each; BF16: 2 bytes each.
FP2_PAGE_BYTES = PAGE_SIZE * NUM_HEADS * 2 * (HEAD_DIM * 2 // 8 + 2)
BF16_PAGE_BYTES = PAGE_SIZE * NUM_HEADS * 2 * HEAD_DIM * 2


def quantize_fp2(x: torch.Tensor) -> torch.Tensor:
    """Round-trip `x` through a 2-bit code per element (4 levels, absmax scale per row of the
    last dim); returns the dequantized tensor. A stand-in for the real FP2 KV format."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)  # [..., 1]
    code = torch.clamp(torch.round(x / scale * 1.5 + 1.5), 0, 3)  # levels -1.5 .. 1.5
    return (code - 1.5) / 1.5 * scale


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="metrics-demo", description="synthetic metrics on every rank")
    p.add_argument("--seconds", type=float, default=8.0, help="how long every rank runs")
    p.add_argument("--no-dashboard", action="store_true", help="plain status lines instead of live")
    p.add_argument("--metrics-file", type=Path, metavar="PATH", help="append JSON lines (rank 0)")
    p.add_argument("--svg", type=Path, metavar="PATH", help="save the last frame as SVG (rank 0)")
    p.add_argument("--svg-width", type=int, default=120)
    p.add_argument("--svg-height", type=int, default=40)
    p.add_argument("--step-sleep-ms", type=float, default=4.0, help="idle time per step")
    return p.parse_args(argv)


class _SyntheticRank:
    """One rank's fake decode loop, driving a `MetricsCollector` the way the engine will."""

    def __init__(
        self, ctx: RankContext, metrics: MetricsCollector, num_experts: int, owners: list[int]
    ) -> None:
        self.ctx, self.metrics = ctx, metrics
        self.num_experts, self.owners = num_experts, torch.tensor(owners)
        self.gen = torch.Generator().manual_seed(1234 + ctx.rank)
        self.w_router = torch.randn(HIDDEN, num_experts, generator=self.gen) / HIDDEN**0.5  # [D, E]
        self.w_expert = torch.randn(HIDDEN, HIDDEN, generator=self.gen) / HIDDEN**0.5
        self.lengths: list[int] = [32] * 8  # context length per running request
        self.queued = 4
        self.step_idx = 0

    def _rand(self) -> float:
        return torch.rand((), generator=self.gen).item()

    def step(self) -> None:
        m, t = self.metrics, self.metrics.timer
        B = len(self.lengths)
        t.begin_step()
        x = torch.randn(max(B, 1), HIDDEN, generator=self.gen)  # [B, D]
        ctx_len = max(self.lengths, default=1)
        hot = (self.step_idx // 200 + 3 * self.ctx.rank) % self.num_experts  # drifts every ~200 steps
        bias = torch.zeros(self.num_experts)
        bias[hot] = 0.6
        for layer in range(NUM_LAYERS):
            keys = torch.randn(ctx_len, HIDDEN, generator=self.gen)  # [T, D]
            x = torch.softmax(x @ keys.T / HIDDEN**0.5, dim=-1) @ keys  # [B, D]
            k_new = torch.randn(B, NUM_HEADS, HEAD_DIM, generator=self.gen)  # [B, H, Dh]
            v_new = torch.randn(B, NUM_HEADS, HEAD_DIM, generator=self.gen)
            q = torch.randn(B, NUM_HEADS, HEAD_DIM, generator=self.gen)
            m.kv_quality.maybe_sample(layer, k_new, quantize_fp2(k_new), v_new, quantize_fp2(v_new), q)
            t.mark("attention")
            logits = x * HIDDEN**0.5 @ self.w_router + bias  # [B, E], unit-scale logits
            topk_idx = logits.topk(TOP_K, dim=-1).indices  # [B, K]
            counts = torch.bincount(topk_idx.flatten(), minlength=self.num_experts)  # [E]
            m.record_expert_counts(counts)
            send_tokens = torch.bincount(self.owners[topk_idx.flatten()], minlength=self.ctx.world_size)
            m.record_dispatch_bytes(send_tokens * HIDDEN * 2)  # BF16 rows
            t.mark("dispatch")
            x = torch.tanh(x @ self.w_expert)
            t.mark("experts")
            x = x / (x.norm(dim=-1, keepdim=True) + 1e-6)
            t.mark("combine")
        _ = torch.argmax(x, dim=-1)
        t.mark("sampling")
        m.end_step(num_tokens=B)
        self._churn()
        self.step_idx += 1

    def _churn(self) -> None:
        self.lengths = [n + 1 for n in self.lengths if n < 160 or self._rand() > 0.05]
        self.queued += int(self._rand() < 0.1)
        if self.queued and len(self.lengths) < 12 + 4 * self.ctx.rank and self._rand() < 0.5:
            self.queued -= 1
            self.lengths.append(16 + int(self._rand() * 64))
        pages = sum(-(-n // PAGE_SIZE) for n in self.lengths)
        self.metrics.set_requests(len(self.lengths), self.queued)
        self.metrics.set_kv(pages, NUM_PAGES - pages, pages * FP2_PAGE_BYTES, pages * BF16_PAGE_BYTES)
        if self.step_idx % 150 == 149:
            self.metrics.warn(f"step {self.step_idx}: {len(self.lengths)} requests, queue {self.queued}")
        if self.ctx.rank == self.ctx.world_size - 1 and self.step_idx == 100:
            self.metrics.timeout(f"dispatch to rank 0 waited {self.ctx.timeout_s:g}s at slot 3 (simulated)")


def run_metrics_demo(ctx: RankContext, argv: list[str]) -> int:
    """The `metrics-demo` job: synthetic steps on every rank for `--seconds`, dashboard on rank 0.

    Returns 0. Rank 0 renders live on a terminal, plain lines otherwise (or with --no-dashboard).
    """
    args = _parse(argv)
    # Several ranks share few cores: one intra-op thread each, or OpenMP spinning swamps them.
    torch.set_num_threads(1)
    topo = ctx.topology
    num_experts = topo.experts.num_experts if topo is not None else 8 * ctx.world_size
    if topo is not None:
        owners = list(topo.experts.expert_to_rank)
    else:
        owners = [e * ctx.world_size // num_experts for e in range(num_experts)]
    metrics = MetricsCollector.for_context(
        ctx, num_layers=NUM_LAYERS, expert_idx=range(num_experts), kv_quality_period=8
    )
    agent = MetricsAgent(metrics, StorePublisher(ctx.rank)).start()
    dash = None
    if ctx.rank == 0:
        # The demo is a job (an entry point), not the engine: it may reach up to the launch-side
        # dashboard. The import is by name so that the runtime package has no static edge to it.
        dashboard = importlib.import_module("zerodram.launch.dashboard")
        mode = dashboard.dashboard_mode(args.no_dashboard)
        dash = dashboard.Dashboard(
            topo, StoreReader(ctx.world_size), mode=mode, metrics_file=args.metrics_file
        )
        dash.start()
    rank = _SyntheticRank(ctx, metrics, num_experts, owners)
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            rank.step()
            time.sleep(args.step_sleep_ms / 1e3)
    finally:
        if dash is not None:
            dash.stop()
            if args.svg is not None and dash.last is not None:
                _save_svg(dashboard, dash, args)
        ctx.barrier("metrics demo done")  # rank 0 has drawn its last frame of live ranks
        agent.stop()
    return 0


def _save_svg(dashboard: Any, dash: Any, args: argparse.Namespace) -> None:
    from rich.console import Console

    console = Console(record=True, width=args.svg_width, height=args.svg_height, file=io.StringIO())
    view = dashboard.render(
        dash.last, dash.topology, width=args.svg_width, height=args.svg_height, throughput=dash.throughput
    )
    console.print(view)
    args.svg.parent.mkdir(parents=True, exist_ok=True)
    console.save_svg(str(args.svg), title="zerodram metrics-demo")
