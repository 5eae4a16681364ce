"""The per-rank metrics recorder the engine writes into; `snapshot()` freezes it for rank 0.

Every `record_*` / `set_*` call is O(1) host work (a tensor add on the device for CUDA counts) and
safe in the decode step; `snapshot()` does the heavier folding (percentiles, rates, KV-quality
errors) and runs on the publisher thread (`MetricsAgent`), a few times a second.

    metrics = MetricsCollector.for_context(ctx, num_layers=L)
    metrics.timer.begin_step(); ...; metrics.timer.mark("attention"); ...
    metrics.end_step(num_tokens=B)              # after timer.end_step's place: see end_step
    metrics.record_expert_counts(counts)        # [E] tokens this rank routed to each expert
    metrics.record_dispatch_bytes(send_bytes)   # [W] bytes sent to each peer this step
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from zerodram.runtime.errors import RankTimeoutError
from zerodram.runtime.metrics.counters import CounterVector, RateWindow
from zerodram.runtime.metrics.kv_quality import KvQualitySampler
from zerodram.runtime.metrics.snapshot import (
    PHASES,
    KvStats,
    PhaseStats,
    RankSnapshot,
    WarningRecord,
)
from zerodram.runtime.metrics.timer import StepTimer, make_step_timer

if TYPE_CHECKING:
    import torch

    from zerodram.runtime.context import RankContext

# How often the step thread starts the device-to-host copies of the counters.
_FLUSH_EVERY_S = 0.2


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ascending `sorted_values` (q in 0..100); 0.0 when empty."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])


class MetricsCollector:
    """One rank's live metrics.

    Args:
        rank, world_size: this rank and the number of peers (`record_dispatch_bytes` length).
        device: where the engine computes (picks the `StepTimer` backend).
        num_layers: layers, for KV-quality sampling (0: no sampling).
        expert_idx: the experts `record_expert_counts` covers, usually all of them (range(E)).
        timer: a `StepTimer`; default `make_step_timer(device)`.
        window_steps: timed steps the latency percentiles span.
        rate_window_s: seconds tokens/s, expert load and dispatch rates span.
        max_warnings: recent warnings kept.
        kv_quality_period: one K/V write sampled in this many, per layer.
        flush_every_s: how often `end_step` starts the device-to-host copies of CUDA counters
            (so device counts reach snapshots up to this much late).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        *,
        num_layers: int = 0,
        expert_idx: Sequence[int] = (),
        timer: StepTimer | None = None,
        window_steps: int = 256,
        rate_window_s: float = 2.0,
        max_warnings: int = 8,
        kv_quality_period: int = 64,
        flush_every_s: float = _FLUSH_EVERY_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = str(device)
        self.timer = timer if timer is not None else make_step_timer(device)
        self.kv_quality = KvQualitySampler(num_layers, period=kv_quality_period)
        self.expert_idx = tuple(expert_idx)
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._next_flush = self._t0
        self._flush_every_s = flush_every_s
        self._total_ms: deque[float] = deque(maxlen=window_steps)
        self._phase_ms = [deque(maxlen=window_steps) for _ in PHASES]
        self._num_steps = 0
        self._num_tokens = 0
        self._num_running = 0
        self._num_queued = 0
        self._kv = KvStats()
        self._experts = CounterVector(len(self.expert_idx))
        self._send = CounterVector(world_size)
        # One rate window over [tokens, experts..., peers...], so that all rates span the same time.
        self._rates = RateWindow(1 + len(self.expert_idx) + world_size, rate_window_s, t0=self._t0)
        self._warnings: deque[WarningRecord] = deque(maxlen=max_warnings)
        self._counts = {"warning": 0, "error": 0, "timeout": 0}
        self._seq = 0

    @classmethod
    def for_context(cls, ctx: RankContext, *, num_layers: int = 0, **kwargs: Any) -> MetricsCollector:
        """A collector for this rank: device from the context, experts from its topology."""
        if "expert_idx" not in kwargs and ctx.topology is not None:
            kwargs["expert_idx"] = range(ctx.topology.experts.num_experts)
        return cls(ctx.rank, ctx.world_size, ctx.device, num_layers=num_layers, **kwargs)

    # ---- step thread: cheap ----

    def end_step(self, num_tokens: int) -> None:
        """Close the step the timer is timing and count the tokens it produced.

        Calls `timer.end_step()` (so the engine calls `timer.begin_step()` / `timer.mark()` and
        then this), folds finished timings in, and every ~0.2 s starts the device-to-host copies
        of the counters.
        """
        self.timer.end_step()
        done = self.timer.drain()
        now = time.monotonic()
        with self._lock:
            self._num_steps += 1
            self._num_tokens += num_tokens
            for t in done:
                self._total_ms.append(t.total_ms)
                if t.phase_ms is not None:
                    for window, ms in zip(self._phase_ms, t.phase_ms, strict=True):
                        window.append(ms)
        self._experts.fold()
        self._send.fold()
        if now >= self._next_flush:
            self._next_flush = now + self._flush_every_s
            self._experts.flush()
            self._send.flush()

    def record_expert_counts(self, counts: torch.Tensor | Sequence[int]) -> None:
        """Add one step's router picks: tokens sent to each expert of `expert_idx`, ``[E]``."""
        self._experts.add(counts)

    def record_dispatch_bytes(self, send_bytes: torch.Tensor | Sequence[int]) -> None:
        """Add one step's dispatch traffic: bytes sent to each peer rank, ``[world_size]``."""
        self._send.add(send_bytes)

    def set_requests(self, num_running: int, num_queued: int) -> None:
        """Requests being decoded and waiting in this rank's queue."""
        self._num_running, self._num_queued = num_running, num_queued

    def set_kv(self, num_pages_used: int, num_pages_free: int, used_bytes: int, bf16_bytes: int) -> None:
        """The KV partition: pages in use and free, bytes the used pages take, and what the same
        tokens would take in BF16."""
        self._kv = KvStats(num_pages_used, num_pages_free, used_bytes, bf16_bytes)

    def warn(self, message: str) -> None:
        """Record a warning for the dashboard (also keep logging it as usual)."""
        self._note("warning", message)

    def error(self, message: str) -> None:
        """Record an error the rank survived (a failed request, a retried transfer)."""
        self._note("error", message)

    def timeout(self, message: str) -> None:
        """Record a bounded wait that expired (name the rank / expert / slot waited for)."""
        self._note("timeout", message)

    def failed(self, err: BaseException) -> None:
        """Record the error that ends this rank's serving, so that the last snapshot (published as
        the rank stops) says why: a `RankTimeoutError` as a timeout (its message names who waited
        for what), any other exception as an error; an interrupt (Ctrl-C, exit) records nothing."""
        if isinstance(err, RankTimeoutError):
            self.timeout(str(err))
        elif isinstance(err, Exception):
            self.error(f"{type(err).__name__}: {err}")

    def _note(self, level: str, message: str) -> None:
        with self._lock:
            self._counts[level] += 1
            self._warnings.append(WarningRecord(time.time(), level, message[:200]))

    # ---- publisher thread: folding ----

    def snapshot(self, state: str = "running") -> RankSnapshot:
        """Freeze the current metrics. Thread-safe; not for the decode step (it sorts windows
        and computes KV-quality errors)."""
        now = time.monotonic()
        with self._lock:
            totals = sorted(self._total_ms)
            phases = [sorted(w) for w in self._phase_ms]
            num_steps, num_tokens = self._num_steps, self._num_tokens
            warnings = tuple(self._warnings)
            counts = dict(self._counts)
            self._seq += 1
            seq = self._seq
        experts, send = self._experts.read(), self._send.read()
        gained, dt = self._rates.update(now, [float(num_tokens), *experts, *send])
        n_e = len(self.expert_idx)
        dt = max(dt, 1e-9)
        return RankSnapshot(
            rank=self.rank,
            seq=seq,
            time_s=time.time(),
            uptime_s=now - self._t0,
            state=state,
            device=self.device,
            num_steps=num_steps,
            num_tokens=num_tokens,
            tokens_per_s=gained[0] / dt,
            phases=tuple(
                _stats(name, values)
                for name, values in zip((*PHASES, "total"), (*phases, totals), strict=True)
            ),
            num_running=self._num_running,
            num_queued=self._num_queued,
            kv=self._kv,
            expert_idx=self.expert_idx,
            expert_counts=tuple(round(c) for c in gained[1 : 1 + n_e]),
            send_bytes_per_s=tuple(b / dt for b in gained[1 + n_e :]),
            kv_quality=self.kv_quality.summarize(),
            num_warnings=counts["warning"],
            num_errors=counts["error"],
            num_timeouts=counts["timeout"],
            recent_warnings=warnings,
        )


def _stats(name: str, values: list[float]) -> PhaseStats:
    mean = sum(values) / len(values) if values else 0.0
    return PhaseStats(name, percentile(values, 50), percentile(values, 99), mean, len(values))
