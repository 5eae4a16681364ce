"""Feeds the engine's step hooks into runtime/metrics' `MetricsCollector` (never the dashboard).

    collector, agent = start_metrics(engine, ctx)     # every rank: record, publish to rank 0
    ...serve...
    agent.stop()

or by hand: `bridge = MetricsBridge(collector, expert_owners, hidden, bytes_per_elem)` and
`engine.attach_observer(bridge, bridge.on_step, kv_probe=bridge.kv_probe(engine.kv))`.

Phase names map onto the collector's: attention -> attention; router, dispatch -> dispatch;
experts -> experts; combine -> combine; lm_head, sampling -> sampling. Each phase's end is a `timer.mark`, so host time between phases goes to the next one.
Routing: expert counts per step (all MoE layers summed) and the bytes each step would send to
every peer (rows x hidden x element size, by the owner rank the dispatch picks). KV quality: every layer's freshly
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
        expert_owners: tuple[tuple[int, ...], ...] | None,
        hidden: int,
        bytes_per_elem: int,
    ) -> None:
        """expert_owners[e]: the ranks holding expert e, primary first (`Engine.expert_owners`)."""
        self.collector = collector
        self.timer = collector.timer
        owners = expert_owners or ()
        self.num_experts = len(owners)
        R = max((len(o) for o in owners), default=1)
        # [E, R] each expert's owners (padded with the primary) and [E] how many: token t's choice
        # of expert e goes to owners[e][t % len(owners[e])], the dispatch's rule (runtime/comm/layout.py)
        self.owner = torch.tensor([[*o, *(o[:1] * (R - len(o)))] for o in owners], dtype=torch.int64).reshape(-1, R)
        self.num_owners = torch.tensor([len(o) for o in owners], dtype=torch.int64)
        self.row_bytes = hidden * bytes_per_elem
        # On the routing's device, moved there at the first step: counting must never sync the
        # step (scatter_add, not bincount, which reads the max back to size its output on CUDA).
        self._counts = torch.zeros(self.num_experts, dtype=torch.int64)
        self._rows_to = torch.zeros(collector.world_size, dtype=torch.int64)  # [W] rows sent to each rank

    def begin_step(self) -> None:
        self.timer.begin_step()
        self._counts.zero_()
        self._rows_to.zero_()

    @contextmanager
    def phase(self, name: str):
        try:
            yield
        finally:
            self.timer.mark(_PHASE_MAP.get(name, "experts"))

    def routed(self, layer_idx: int, topk_idx: torch.Tensor) -> None:
        if not self.num_experts or not topk_idx.numel():
            return
        dev = topk_idx.device
        if self._counts.device != dev:
            self._counts, self._rows_to = self._counts.to(dev), self._rows_to.to(dev)
            self.owner, self.num_owners = self.owner.to(dev), self.num_owners.to(dev)
        idx = topk_idx.flatten()  # [T*K]
        ones = torch.ones_like(idx)
        self._counts.scatter_add_(0, idx, ones)
        token = torch.arange(idx.numel(), device=dev) // topk_idx.shape[1]  # [T*K] t of each choice
        self._rows_to.scatter_add_(0, self.owner[idx, token % self.num_owners[idx]], ones)

    def on_step(self, stats: Any) -> None:
        c = self.collector
        if self.num_experts:
            if len(c.expert_idx) == self.num_experts:
                c.record_expert_counts(self._counts.clone())
            c.record_dispatch_bytes(self._rows_to * self.row_bytes)
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
    owners = engine.expert_owners
    collector = MetricsCollector(
        ctx.rank,
        ctx.world_size,
        ctx.device,
        num_layers=cfg.num_layers,
        expert_idx=range(len(owners or ())),
        kv_quality_period=kv_quality_period,
    )
    bridge = MetricsBridge(collector, owners, cfg.hidden_size, engine.model.dtype.itemsize)
    engine.attach_observer(bridge, bridge.on_step, kv_probe=bridge.kv_probe(engine.kv), on_error=collector.error)
    agent = MetricsAgent(collector, StorePublisher(ctx.rank), period_s=period_s).start()
    return collector, agent
