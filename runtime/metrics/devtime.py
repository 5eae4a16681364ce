"""Device timing for the benchmarks: what one replay of a launch sequence costs on the GPU, the
copy bandwidth the floors are measured against, and marks between the stages of eager work.

    bw = copy_bandwidth()                                     # bytes read + written per second
    ms = median_ms(lambda: kernel(...), reps=30, flush=buf)   # GPU: captured once, replayed
    ms_a, ms_b = medians_ms([fa, fb], reps=30, flush=buf)     # the same, repetitions interleaved
    clock = Clock(dev); a = clock.mark(); ...; clock.between_ms(a, clock.mark())   # GPU or CPU
    acts = device_activity(lambda: graph.replay(), reps=5)    # per kernel: us per rep, count per rep

The time of a replay is the device's alone: a decode step runs as a graph, and timing eager
launches from Python would measure the host. `flush` (a large tensor, read with .sum() before each
repetition) evicts L2 without leaving dirty lines the timed work would write back.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class Clock:
    """Marks between the stages of eager work: CUDA events on a GPU (recorded on the current
    stream, read after the work), perf_counter on CPU (where torch ops are synchronous).

    flush_bytes: a GPU buffer that `evict` overwrites, pushing the timed work's data out of L2
    (0: none; on CPU `evict` does nothing).
    """

    def __init__(self, device: torch.device, flush_bytes: int = 0) -> None:
        self.cuda = device.type == "cuda"
        self._flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if flush_bytes and self.cuda else None

    def mark(self) -> Any:
        """A point in the work enqueued so far (an event, or the time now on CPU)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def between_ms(self, a: Any, b: Any) -> float:
        """Milliseconds from mark a to mark b (waits for b on a GPU)."""
        if not self.cuda:
            return (b - a) * 1e3
        b.synchronize()
        return a.elapsed_time(b)

    def evict(self) -> None:
        """Enqueue the L2 flush (a no-op without a flush buffer)."""
        if self._flush is not None:
            self._flush.zero_()

    def idle(self) -> None:
        """Evict the L2 and let the device go idle before a timed call."""
        self.evict()
        if self.cuda:
            torch.cuda.synchronize()


def copy_bandwidth(num_bytes: int | None = None, reps: int = 10, device: torch.device | str = "cuda") -> float:
    """Median bytes per second (read + write) of an eager copy on `device` (num_bytes default: 1 GiB
    on a GPU, 64 MiB on CPU), the first two copies left out of the median. Eager, not a graph: replayed from a
    graph the same copy measured 2.8 TB/s on the H200 against 4.2 TB/s eager (presumably a
    copy-engine memcpy node instead of an SM copy kernel)."""
    device = torch.device(device)
    n = num_bytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    clock, times = Clock(device), []
    for _ in range(reps):
        a = clock.mark()
        dst.copy_(src)
        times.append(clock.between_ms(a, clock.mark()))
    return 2 * n / (statistics.median(times[2:]) * 1e-3)


SETTLE_S = 0.2  # idle before timed repetitions: see medians_ms


def median_ms(
    fn: Callable[[], object], reps: int, flush: torch.Tensor, *, graph: bool = True,
    capture_stream: torch.cuda.Stream | None = None,
) -> float:  # fmt: skip
    """Median milliseconds of `fn` over `reps` repetitions after 3 warm-up calls and 2 untimed
    repetitions, L2 flushed before each; `graph`: captured once in a CUDA graph and replayed (else
    launched eagerly, for work that cannot be captured, e.g. a host sync). `capture_stream`: the
    stream the graph is captured on (its priority becomes the priority of the nodes captured from
    it, as the engine's whole-step graph; default: torch's private capture stream)."""
    return medians_ms([fn], reps, flush, graph=graph, capture_stream=capture_stream)[0]


def medians_ms(
    fns: Sequence[Callable[[], object]], reps: int, flush: torch.Tensor, *, graph: bool = True,
    capture_stream: torch.cuda.Stream | None = None,
) -> list[float]:  # fmt: skip
    """`median_ms` of each of `fns`, their repetitions interleaved (a, b, a, b, ...): a difference
    of two long sequences is then not a difference of when each ran. Timed one after the other,
    whichever of two 16-layer decode graphs came second took 55-93 us (up to 11%) longer a layer
    at B = 32, L = 128k on an H100 (docs/benchmarks.md, "The deferred write over sixteen layers").

    The timed repetitions start after SETTLE_S of idle: right after heavy work the GPU runs slow
    for a while. On an H100 the FP2 decode at B = 8, L = 128k ran 17% slower for ~8 ms after a 1-GB
    reference check or a 3-GB fill, and 12% slower after two seconds of GEMMs, whose power cap
    held the SM clock at 1245-1440 MHz until ~200 ms later (docs/benchmarks.md, "What the first
    count timed had"); without the idle, whatever ran just before a call would set its time."""
    times = rep_times_ms(fns, reps, flush, graph=graph, capture_stream=capture_stream)
    return [statistics.median(ts[2:]) for ts in times]


def rep_times_ms(
    fns: Sequence[Callable[[], object]], reps: int, flush: torch.Tensor, *, graph: bool = True,
    capture_stream: torch.cuda.Stream | None = None, settle_s: float = SETTLE_S,
) -> list[list[float]]:  # fmt: skip
    """Every repetition's time (ms) of each of `fns` as `medians_ms` takes them: reps + 2, the first
    two untimed warm-up (kept here), interleaved, the L2 flushed before each, after `settle_s` of
    idle (0: none, what the settle probe measures)."""
    runs = []
    for fn in fns:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        run = fn
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=capture_stream):
                fn()
            run = g.replay
        runs.append(run)
    torch.cuda.synchronize()
    time.sleep(settle_s)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps + 2):
        for run, ts in zip(runs, times, strict=True):
            flush.sum()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
    return times


def device_activity(fn: Callable[[], object], reps: int) -> list[tuple[str, float, float]]:
    """The kernels and copies of `reps` calls of `fn` (synchronised after each), from the profiler's
    trace: (name, microseconds per call, launches per call), busiest first. The trace, not
    `key_averages`: on a replayed graph of ~3,000 nodes the latter counted ~1,300 kernels and 2 ms
    of a 6 ms step (torch 2.11)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()  # one call's activity ends before the next starts
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    busy: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in trace:
        if e.get("ph") == "X" and e.get("cat") in kinds:
            busy[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return [(name, us / reps, count[name] / reps) for name, us in busy.most_common()]
