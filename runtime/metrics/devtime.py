"""Device timing for the benchmarks: what one replay of a launch sequence costs on the GPU, and the
copy bandwidth the floors are measured against. GPU only (CUDA events).

    bw = copy_bandwidth()                                     # bytes read + written per second
    ms = median_ms(lambda: kernel(...), reps=30, flush=buf)   # captured once, replayed

The time of a replay is the device's alone: a decode step runs as a graph, and timing eager
launches from Python would measure the host. `flush` (a large tensor, read with .sum() before each
repetition) evicts L2 without leaving dirty lines the timed work would write back.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def copy_bandwidth(num_bytes: int = 1 << 30, reps: int = 10) -> float:
    """Median bytes per second (read + write) of an eager device-to-device copy. Eager, not a graph:
    replayed from a graph the same copy measured 2.8 TB/s on the H200 against 4.2 TB/s eager
    (presumably a copy-engine memcpy node instead of an SM copy kernel)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return 2 * num_bytes / (statistics.median(times[2:]) * 1e-3)


def median_ms(fn: Callable[[], object], reps: int, flush: torch.Tensor, *, graph: bool = True) -> float:
    """Median milliseconds of `fn` over `reps` repetitions after 3 warm-up calls and 2 untimed
    repetitions, L2 flushed before each; `graph`: captured once in a CUDA graph and replayed (else
    launched eagerly, for work that cannot be captured, e.g. a host sync)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(reps + 2):
        flush.sum()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])
