"""Per-step phase timings: one `StepTimer` interface, a backend chosen once at construction.

The engine brackets each decode step and marks the end of every phase; a phase may be marked many
times per step (once per layer) and its times add up:

    timer.begin_step()
    for layer in layers:
        attention(...);          timer.mark("attention")
        route_and_dispatch(...); timer.mark("dispatch")
        experts(...);            timer.mark("experts")
        combine(...);            timer.mark("combine")
    sample(...);                 timer.mark("sampling")
    timer.end_step()
    for timing in timer.drain(): ...   # finished steps, possibly from earlier steps

A mark attributes the time since the previous mark (or `begin_step`) to its phase.

Backends:
    CpuStepTimer   time.perf_counter at each mark; a step's timing is ready at `end_step`.
    CudaStepTimer  CUDA events recorded on the current stream. The step thread never waits for
                   the GPU: slots of events live in a ring, `end_step` only `query()`s the events
                   of earlier steps and converts those that completed. If the GPU falls so far
                   behind that every slot is still pending, the new step is not timed (counted in
                   `num_dropped`) rather than stalling.

Only every `sample_every`-th step records phase marks; the others record just begin and end,
which keeps the event count (and its few microseconds each) off most steps.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

from zerodram.runtime.metrics.snapshot import PHASES

_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}


@dataclass(frozen=True)
class StepTiming:
    """One finished step: `total_ms` begin to end; `phase_ms[i]` for PHASES[i] (None when the
    step was not phase-sampled)."""

    total_ms: float
    phase_ms: tuple[float, ...] | None


class StepTimer(ABC):
    """Times decode steps and their phases. Not thread-safe: call from the step thread only."""

    def __init__(self, sample_every: int = 1) -> None:
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self.sample_every = sample_every
        self.num_steps = 0
        self.num_dropped = 0
        self._sampled = False
        self._ready: list[StepTiming] = []

    @abstractmethod
    def begin_step(self) -> None:
        """Start timing a step."""

    @abstractmethod
    def mark(self, phase: str) -> None:
        """End a stretch of `phase` (one of PHASES); raises KeyError for another name."""

    @abstractmethod
    def end_step(self) -> None:
        """End the step; collect whatever earlier steps have finished, without waiting."""

    def drain(self) -> list[StepTiming]:
        """Finished step timings since the last drain, oldest first."""
        out, self._ready = self._ready, []
        return out

    def _next_sampled(self) -> bool:
        self._sampled = self.num_steps % self.sample_every == 0
        self.num_steps += 1
        return self._sampled


class CpuStepTimer(StepTimer):
    """Host wall-clock timer; on CPU the ops run synchronously, so host time is compute time."""

    def __init__(self, sample_every: int = 1) -> None:
        super().__init__(sample_every)
        self._t0 = 0.0
        self._last = 0.0
        self._acc = [0.0] * len(PHASES)

    def begin_step(self) -> None:
        self._next_sampled()
        self._t0 = self._last = time.perf_counter()
        if self._sampled:
            self._acc = [0.0] * len(PHASES)

    def mark(self, phase: str) -> None:
        i = _PHASE_INDEX[phase]
        if not self._sampled:
            return
        now = time.perf_counter()
        self._acc[i] += now - self._last
        self._last = now

    def end_step(self) -> None:
        total_ms = (time.perf_counter() - self._t0) * 1e3
        phases = tuple(s * 1e3 for s in self._acc) if self._sampled else None
        self._ready.append(StepTiming(total_ms, phases))


class _Slot:
    """The events of one step: `events[0]` is begin, then one per mark, then end."""

    def __init__(self, torch: Any, max_marks: int) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(max_marks + 2)]
        self.phase_idx: list[int] = []
        self.sampled = False
        self.overflow = False


class CudaStepTimer(StepTimer):
    """CUDA-event timer. Events are created once (`ring_size` slots of `max_marks_per_step + 2`).

    Args:
        ring_size: steps that may be in flight on the GPU before new steps go untimed.
        max_marks_per_step: marks a sampled step may record (4 per layer + 1 is typical); a step
            with more is dropped, not truncated, so its phases never miss time.
        sample_every: record phase marks on every n-th step only.
    """

    def __init__(self, ring_size: int = 16, max_marks_per_step: int = 512, sample_every: int = 8) -> None:
        super().__init__(sample_every)
        import torch

        self._free = deque(_Slot(torch, max_marks_per_step) for _ in range(ring_size))
        self._pending: deque[_Slot] = deque()
        self._cur: _Slot | None = None
        self._max_marks = max_marks_per_step

    def begin_step(self) -> None:
        self._poll()
        self._next_sampled()
        self._cur = self._free.popleft() if self._free else None
        if self._cur is None:
            self.num_dropped += 1
            return
        self._cur.phase_idx.clear()
        self._cur.sampled, self._cur.overflow = self._sampled, False
        self._cur.events[0].record()

    def mark(self, phase: str) -> None:
        i = _PHASE_INDEX[phase]
        slot = self._cur
        if slot is None or not slot.sampled:
            return
        n = len(slot.phase_idx)
        if n >= self._max_marks:
            slot.overflow = True
            return
        slot.events[n + 1].record()
        slot.phase_idx.append(i)

    def end_step(self) -> None:
        slot, self._cur = self._cur, None
        if slot is None:
            return
        slot.events[len(slot.phase_idx) + 1].record()
        self._pending.append(slot)
        self._poll()

    def _poll(self) -> None:
        # Oldest first: steps finish in order on one stream. query() never blocks; an event not yet
        # reached leaves its slot (and every later one) pending for the next call.
        while self._pending:
            slot = self._pending[0]
            n = len(slot.phase_idx)
            if not slot.events[n + 1].query():
                return
            self._pending.popleft()
            ev = slot.events
            if slot.overflow:
                self.num_dropped += 1
            else:
                phases = None
                if slot.sampled:
                    acc = [0.0] * len(PHASES)
                    for k, i in enumerate(slot.phase_idx):
                        acc[i] += ev[k].elapsed_time(ev[k + 1])
                    phases = tuple(acc)
                self._ready.append(StepTiming(ev[0].elapsed_time(ev[n + 1]), phases))
            self._free.append(slot)


def make_step_timer(device: Any, *, sample_every: int | None = None) -> StepTimer:
    """The timer for `device` (a torch.device or string): CUDA events on a GPU, perf_counter else.

    Args:
        sample_every: phase-mark every n-th step (default: every step on CPU, every 8th on GPU).
    """
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cuda":
        return CudaStepTimer(sample_every=sample_every or 8)
    return CpuStepTimer(sample_every=sample_every or 1)
