"""Counters fed from the step thread and read from the publisher thread, without a GPU sync.

`CounterVector` accumulates per-step count vectors (expert token counts ``[E]``, dispatch bytes
per peer ``[W]``). A host sequence or CPU tensor is added on the host; CUDA tensors are kept until
`fold()` (end of step) adds them into a device accumulator with one stack + sum + add, and
`flush()` (step thread, at most a few times a second) enqueues a non-blocking copy to pinned host
memory plus an event. `read()` returns the newest copy whose event has completed, so the reader
never waits for the GPU and the step never syncs.

`RateWindow` turns cumulative readings taken at snapshot time into rates over the last seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

_MAX_PARTS = 256


class CounterVector:
    """A vector of `size` growing counts (int64 on the host, float64 on a device accumulator)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._host = torch.zeros(size, dtype=torch.float64)
        self._dev: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []  # this step's CUDA counts, not yet added
        self._landed: torch.Tensor | None = None  # last device copy known to be on the host
        self._inflight: list[tuple[torch.Tensor, Any]] = []  # (pinned copy, event)
        self._lock = threading.Lock()  # _inflight is appended by the step thread, trimmed by the reader

    def add(self, values: torch.Tensor | Sequence[float]) -> None:
        """Add one step's counts (`size` values). Raises ValueError on a size mismatch."""
        if isinstance(values, torch.Tensor):
            if values.numel() != self.size:
                raise ValueError(f"counter of {self.size} values given {values.numel()}")
            if values.is_cuda:
                # Kept until `fold` (end of step): one stack + sum + add for all of a step's
                # per-layer counts instead of a kernel launch each.
                self._parts.append(values.reshape(-1))
                if len(self._parts) >= _MAX_PARTS:
                    self.fold()
            else:
                self._host += values.reshape(-1).to(torch.float64)
            return
        if len(values) != self.size:
            raise ValueError(f"counter of {self.size} values given {len(values)}")
        self._host += torch.as_tensor(values, dtype=torch.float64)

    def fold(self) -> None:
        """Step thread: add the step's CUDA counts into the device accumulator (async)."""
        if not self._parts:
            return
        if self._dev is None:
            self._dev = torch.zeros(self.size, dtype=torch.float64, device=self._parts[0].device)
        self._dev += self._parts[0] if len(self._parts) == 1 else torch.stack(self._parts).sum(0)
        self._parts.clear()

    def flush(self) -> None:
        """Step thread: fold, then start copying the device accumulator to the host (no wait)."""
        self.fold()
        if self._dev is None:
            return
        host = self._dev.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        with self._lock:
            self._inflight.append((host, done))
            del self._inflight[:-4]  # a reader that never comes must not pile copies up

    def read(self) -> list[float]:
        """Any thread: the counts as far as known on the host right now."""
        with self._lock:
            for i in range(len(self._inflight) - 1, -1, -1):
                host, done = self._inflight[i]
                if done.query():
                    self._landed = host
                    del self._inflight[: i + 1]
                    break
        total = self._host.clone()
        if self._landed is not None:
            total += self._landed
        return total.tolist()


class RateWindow:
    """Rates over the last `window_s` seconds from cumulative readings `(t, values)`.

    The oldest reading kept is the newest one at least `window_s` old, so a rate always spans
    at least the window once the window has passed (and since start before that).
    """

    def __init__(self, size: int, window_s: float = 2.0, t0: float | None = None) -> None:
        self.window_s = window_s
        t0 = time.monotonic() if t0 is None else t0
        self._readings: deque[tuple[float, list[float]]] = deque([(t0, [0.0] * size)])

    def update(self, t: float, values: list[float]) -> tuple[list[float], float]:
        """Add a reading; return (values gained over the window, window length in seconds)."""
        self._readings.append((t, values))
        while len(self._readings) > 2 and t - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        t_old, old = self._readings[0]
        return [v - o for v, o in zip(values, old, strict=True)], t - t_old
