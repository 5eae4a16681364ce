"""Per-phase timing hooks for the decode step (what `zerodram bench decode` will read).

The model and the engine wrap each phase in `timer.phase(name)`; the default `NULL_TIMER` costs one
attribute lookup. Phases: attention, router, dispatch, experts, combine, sampling (and lm_head).
`HostPhaseTimer` accumulates wall time per phase, synchronising the device around each phase when
asked (accurate but slow: for benchmarks, never for serving).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Protocol

import torch

PHASES = ("attention", "router", "dispatch", "experts", "combine", "lm_head", "sampling")


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


class HostPhaseTimer:
    """Accumulates seconds per phase; `sync_device` makes GPU phases measurable from the host."""

    def __init__(self, device: torch.device | None = None, sync_device: bool = False) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._sync = sync_device and device is not None and device.type == "cuda"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0
            self.counts[name] += 1

    def begin_step(self) -> None:
        pass

    def routed(self, layer_idx: int, topk_idx: torch.Tensor) -> None:
        pass

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()
