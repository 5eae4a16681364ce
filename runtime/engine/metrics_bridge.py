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
layer) round-trips at most `PROBE_TOKENS` of them through the KV format and records the errors.
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
        if self.num_experts and topk_idx.numel():
            self._counts += torch.bincount(topk_idx.flatten().cpu(), minlength=self.num_experts)

    def on_step(self, stats: Any) -> None:
        c = self.collector
        if self.num_experts:
            if len(c.expert_idx) == self.num_experts:
                c.record_expert_counts(self._counts.clone())
            W = c.world_size
            per_rank = torch.bincount(self.owner, weights=self._counts.double(), minlength=W).long()
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
                back = kv.roundtrip(layer_idx, k_s, v_s)  # [n, Hkv, Dh] each, fp32
                if back is not None:
                    sampler.record(layer_idx, k_s.float(), back[0], v_s.float(), back[1], q_s.float())
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
