"""Per-phase timing hooks for the decode step.

The model and the engine wrap each phase in `timer.phase(name)`; the default `NULL_TIMER` costs one
attribute lookup. Phases: attention, router, dispatch, experts, combine, sampling (and lm_head).
The engine's implementation (runtime/engine/metrics_bridge.py) marks them on its metrics step timer.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

import torch


class PhaseTimer(Protocol):
    """Observation hooks of a step: phase timing, step boundaries, routing decisions."""

    def phase(self, name: str): ...

    def begin_step(self) -> None: ...

    def routed(self, layer_idx: int, topk_idx: torch.Tensor) -> None:
        """Called by each MoE layer with its [T, K] expert choices (for expert-load metrics)."""
        ...


class _NullTimer:
    _ctx = nullcontext()

    def phase(self, name: str):
        return self._ctx

    def begin_step(self) -> None:
        pass

    def routed(self, layer_idx: int, topk_idx: torch.Tensor) -> None:
        pass


NULL_TIMER = _NullTimer()
