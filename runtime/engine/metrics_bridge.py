"""Feeds the engine's step hooks into runtime/metrics' `MetricsCollector` (never the dashboard).

    collector, agent = start_metrics(engine, ctx)     # every rank: record, publish to rank 0
    ...serve...
    agent.stop()

or by hand: `bridge = MetricsBridge(collector, expert_to_rank, hidden, bytes_per_elem)` and
`engine.attach_observer(bridge, bridge.on_step, kv_probe=bridge.kv_probe(engine.kv))`.

Phase names map onto the collector's: attention -> attention; router, dispatch -> dispatch;
experts -> experts; combine -> combine; lm_head, sampling -> sampling. Each phase's end is a `timer.mark`, so host time between phases goes to the next one.
Routing: expert counts per step (all MoE layers summed) and the bytes each step would send to
every peer (rows x hidden x element size, by owner rank). KV quality: every layer's freshly
written K/V reach `kv_probe`, which on the sampler's turn (one step in `kv_quality_period` per
layer) copies at most `PROBE_TOKENS` of them to the host; the publisher thread round-trips them
through the KV format and computes the errors, so the step never waits for the quantizer.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("zerodram.metrics")

# Tokens of a sampled K/V write that are round-tripped through the format (all their heads).
PROBE_TOKENS = 4

_PHASE_MAP = {
    "attention": "attention",
    "router": "dispatch",
    "dispatch": "dispatch",
    "experts": "experts",
    "combine": "combine",
    "lm_head": "sampling",
    "sampling": "sampling",
}


class MetricsBridge:
    """A `PhaseTimer` plus the engine's `on_step` hook, writing into one `MetricsCollector`."""

    def __init__(
        self,
        collector: Any,
        expert_to_rank: tuple[int, ...] | None,
        hidden: int,
        bytes_per_elem: int,
    ) -> None:
        self.collector = collector
        self.timer = collector.timer
        self.num_experts = len(expert_to_rank or ())
        self.owner = torch.tensor(expert_to_rank or (), dtype=torch.int64)
        self.row_bytes = hidden * bytes_per_elem
        # On the routing's device, moved there at the first step: counting must never sync the
        # step (scatter_add, not bincount, which reads the max back to size its output on CUDA).
        self._counts = torch.zeros(self.num_experts, dtype=torch.int64)

    def begin_step(self) -> None:
        self.timer.begin_step()
        self._counts.zero_()

    @contextmanager
    def phase(self, name: str):
        try:
            yield
        finally:
            self.timer.mark(_PHASE_MAP.get(name, "experts"))

    def routed(self, layer_idx: int, topk_idx: torch.Tensor) -> None:
        if not self.num_experts or not topk_idx.numel():
            return
        if self._counts.device != topk_idx.device:
            self._counts = self._counts.to(topk_idx.device)
            self.owner = self.owner.to(topk_idx.device)
        idx = topk_idx.flatten()  # [T*K]
        self._counts.scatter_add_(0, idx, torch.ones_like(idx))

    def on_step(self, stats: Any) -> None:
        c = self.collector
        if self.num_experts:
            if len(c.expert_idx) == self.num_experts:
                c.record_expert_counts(self._counts.clone())
            W = c.world_size
            per_rank = torch.zeros(W, dtype=torch.int64, device=self._counts.device)
            per_rank.scatter_add_(0, self.owner, self._counts)  # [W] rows sent to each rank
            c.record_dispatch_bytes(per_rank * self.row_bytes)
        c.set_requests(stats.num_running, stats.num_waiting)
        used = stats.kv_pages_used
        c.set_kv(used, stats.kv_pages_total - used, stats.kv_stored_bytes, stats.kv_bf16_bytes)
        c.end_step(num_tokens=stats.num_sampled)

    def kv_probe(self, kv: Any) -> Any:
        """The engine's KV-quality hook for partition `kv` (see the module docstring).

        Off the sampler's turn it is a counter decrement. A probe that fails is switched off
        with one warning: telemetry must never take serving down.
        """
        sampler = self.collector.kv_quality
        if sampler.num_layers == 0:
            return None
        state = {"on": True}

        def probe(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            if not state["on"] or not sampler.take_turn(layer_idx):
                return
            try:
                pick = slice(None, None, max(1, k.shape[0] // PROBE_TOKENS))
                k_s, v_s, q_s = k[pick][:PROBE_TOKENS], v[pick][:PROBE_TOKENS], q[pick][:PROBE_TOKENS]
                # copied to the host as they are; the round trip runs when a snapshot is built
                sampler.record_raw(layer_idx, k_s, v_s, q_s, kv.roundtrip)
            except Exception as err:
                state["on"] = False
                log.exception("KV-quality probe failed; switched off")
                self.collector.warn(f"KV-quality probe switched off: {type(err).__name__}: {err}")

        return probe


def start_metrics(engine: Any, ctx: Any, *, kv_quality_period: int = 8, period_s: float = 0.25) -> tuple:
    """Record `engine`'s metrics on this rank and publish them for rank 0's dashboard.

    Returns (collector, agent); call `agent.stop()` when serving ends (before the context closes).
    """
    from zerodram.runtime.metrics import MetricsAgent, MetricsCollector, StorePublisher

    cfg = engine.model.config
    e2r = engine.expert_to_rank
    collector = MetricsCollector(
        ctx.rank,
        ctx.world_size,
        ctx.device,
        num_layers=cfg.num_layers,
        expert_idx=range(len(e2r or ())),
        kv_quality_period=kv_quality_period,
    )
    bridge = MetricsBridge(collector, e2r, cfg.hidden_size, engine.model.dtype.itemsize)
    engine.attach_observer(bridge, bridge.on_step, kv_probe=bridge.kv_probe(engine.kv), on_error=collector.error)
    agent = MetricsAgent(collector, StorePublisher(ctx.rank), period_s=period_s).start()
    return collector, agent
