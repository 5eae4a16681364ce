"""The GPU paths of the metrics: CUDA-event timing that never waits, device counters, K/V samples."""

from __future__ import annotations

import pytest
import torch

from zerodram.runtime.metrics import (
    PHASES,
    CudaStepTimer,
    KvQualitySampler,
    MetricsCollector,
    make_step_timer,
)
from zerodram.runtime.metrics.counters import CounterVector

pytestmark = pytest.mark.gpu

# torch.cuda._sleep spins a kernel for this many cycles (~0.1-0.2 s at 1-2 GHz).
LONG_SPIN = 200_000_000


def test_cuda_timer_does_not_wait_for_the_gpu() -> None:
    timer = make_step_timer("cuda")
    assert isinstance(timer, CudaStepTimer)
    timer.sample_every = 1
    torch.cuda.synchronize()
    timer.begin_step()
    torch.cuda._sleep(LONG_SPIN)
    timer.mark("attention")
    torch.cuda._sleep(LONG_SPIN // 4)
    timer.mark("experts")
    timer.end_step()
    assert timer.drain() == [], "the step's events were still pending: nothing may be ready yet"
    torch.cuda.synchronize()
    timer.begin_step()  # polls: the finished step comes out now
    timer.end_step()
    first, *_ = timer.drain()
    phases = dict(zip(PHASES, first.phase_ms, strict=True))
    assert phases["attention"] > 3 * phases["experts"] > 0
    assert phases["attention"] + phases["experts"] <= first.total_ms * 1.001


def test_cuda_timer_drops_steps_rather_than_stalling() -> None:
    timer = CudaStepTimer(ring_size=2, max_marks_per_step=4, sample_every=1)
    torch.cuda.synchronize()
    for _ in range(4):
        timer.begin_step()
        torch.cuda._sleep(LONG_SPIN // 4)
        timer.mark("attention")
        timer.end_step()
    assert timer.num_dropped == 2
    torch.cuda.synchronize()
    timer.begin_step()
    timer.end_step()
    assert len(timer.drain()) in (2, 3)  # the two timed steps, and maybe the empty one
    torch.cuda.synchronize()


def test_cuda_counters_land_without_a_sync() -> None:
    c = CounterVector(4)
    c.add(torch.tensor([1, 2, 3, 4], device="cuda"))
    c.add([1, 0, 0, 0])
    c.flush()
    torch.cuda.synchronize()
    assert c.read() == [2.0, 2.0, 3.0, 4.0]


def test_cuda_kv_samples_and_collector_snapshot() -> None:
    m = MetricsCollector(
        0, 2, torch.device("cuda"), num_layers=2, expert_idx=range(4), kv_quality_period=1, flush_every_s=0.0
    )
    k = torch.randn(64, 8, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        m.timer.begin_step()
        m.kv_quality.maybe_sample(0, k, k * 1.25, k, k, q)
        m.timer.mark("attention")
        m.record_expert_counts(torch.tensor([5, 0, 0, 1], device="cuda"))
        m.end_step(num_tokens=4)
    torch.cuda.synchronize()
    m.end_step(num_tokens=0)  # flushes counters again, after the sync
    torch.cuda.synchronize()
    snap = m.snapshot()
    assert snap.device.startswith("cuda")
    assert snap.kv_quality[0].k_rel_err == pytest.approx(0.25, rel=1e-2)
    assert snap.kv_quality[0].score_rel_err == pytest.approx(0.25, rel=1e-2)
    assert snap.expert_counts == (15, 0, 0, 3)


def test_kv_sampler_copies_are_small() -> None:
    kvq = KvQualitySampler(1, period=1, max_rows=8)
    k = torch.randn(4096, 128, device="cuda")
    kvq.maybe_sample(0, k, k, k, k)
    (sample,) = kvq._pending
    assert all(t.device.type == "cpu" and t.shape[0] <= 8 for t in sample.tensors)
    torch.cuda.synchronize()
    assert kvq.summarize()[0].k_rel_err == 0.0
