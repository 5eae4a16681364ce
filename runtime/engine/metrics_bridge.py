"""Feeds the engine's step hooks into runtime/metrics' `MetricsCollector` (never the dashboard).

    bridge = MetricsBridge(collector, expert_to_rank, hidden, bytes_per_elem)
    engine = build_engine(..., timer=bridge, on_step=bridge.on_step)

Phase names map onto the collector's: attention -> attention; router, dispatch -> dispatch;
experts, ep (a whole EP layer timed as one) -> experts; combine -> combine; lm_head, sampling ->
sampling. Each phase's end is a `timer.mark`, so host time between phases goes to the next one.
Routing: expert counts per step (all MoE layers summed) and the bytes each step would send to
every peer (rows x hidden x element size, by owner rank).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

_PHASE_MAP = {
    "attention": "attention",
    "router": "dispatch",
    "dispatch": "dispatch",
    "experts": "experts",
    "ep": "experts",
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
