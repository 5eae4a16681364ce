"""Metrics on one rank: timers, counters, KV-quality errors, snapshots, transports, staleness."""

from __future__ import annotations

import datetime
import json
import logging
import time

import pytest
import torch
from torch.distributed import TCPStore

from zerodram.runtime.errors import RankTimeoutError
from zerodram.runtime.metrics import (
    PHASES,
    ClusterSampler,
    ClusterSnapshot,
    CpuStepTimer,
    InProcessBus,
    KvQualitySampler,
    KvStats,
    MetricsAgent,
    MetricsCollector,
    MetricsReader,
    RankSnapshot,
    StorePublisher,
    StoreReader,
    make_step_timer,
)
from zerodram.runtime.metrics.collector import percentile
from zerodram.runtime.metrics.counters import CounterVector, RateWindow
from zerodram.runtime.metrics.summary import json_line


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_cpu_timer_adds_up_phases_over_layers() -> None:
    timer = make_step_timer("cpu")
    assert isinstance(timer, CpuStepTimer)
    timer.begin_step()
    for _ in range(3):  # three "layers": attention is marked three times and its times add up
        _busy(0.002)
        timer.mark("attention")
        timer.mark("experts")
    _busy(0.001)
    timer.mark("sampling")
    timer.end_step()
    (timing,) = timer.drain()
    phases = dict(zip(PHASES, timing.phase_ms, strict=True))
    assert phases["attention"] >= 6.0
    assert phases["dispatch"] == 0.0
    assert phases["sampling"] >= 1.0
    assert sum(timing.phase_ms) <= timing.total_ms
    assert timer.drain() == []


def test_cpu_timer_samples_phases_every_nth_step() -> None:
    timer = CpuStepTimer(sample_every=2)
    for _ in range(4):
        timer.begin_step()
        timer.mark("attention")
        timer.end_step()
    got = timer.drain()
    assert [t.phase_ms is not None for t in got] == [True, False, True, False]
    with pytest.raises(KeyError):
        timer.mark("not-a-phase")


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0


def test_counter_vector_and_rate_window() -> None:
    c = CounterVector(3)
    c.add([1, 2, 3])
    c.add(torch.tensor([1, 0, 1]))
    assert c.read() == [2.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="3 values given 2"):
        c.add([1, 2])
    w = RateWindow(1, window_s=2.0, t0=0.0)
    assert w.update(1.0, [10.0]) == ([10.0], 1.0)
    w.update(2.5, [25.0])
    gained, dt = w.update(5.0, [50.0])  # the oldest reading kept is the newest >= 2 s old
    assert dt == pytest.approx(2.5)
    assert gained == [25.0]


def test_kv_quality_errors_are_exact_for_a_known_distortion() -> None:
    kvq = KvQualitySampler(num_layers=2, period=1)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(8, 4, 16, generator=gen)  # [T, H, Dh]
    v = torch.randn(8, 4, 16, generator=gen)
    q = torch.randn(2, 4, 16, generator=gen)
    assert kvq.maybe_sample(1, k, k * 1.1, v, v * 0.95, q)
    (layer,) = kvq.summarize()
    assert layer.layer_idx == 1
    assert layer.num_samples == 1
    assert layer.k_rel_err == pytest.approx(0.1, rel=1e-4)
    assert layer.v_rel_err == pytest.approx(0.05, rel=1e-4)
    assert layer.score_rel_err == pytest.approx(0.1, rel=1e-4)  # scores scale with K
    with pytest.raises(ValueError, match="dequantized"):
        kvq.maybe_sample(0, k, k[:4], v, v)


def test_kv_quality_samples_at_its_rate_and_keeps_only_few_rows() -> None:
    kvq = KvQualitySampler(num_layers=1, period=8, max_rows=4)
    k = torch.randn(64, 16)
    kept = [kvq.maybe_sample(0, k, k, k, k) for _ in range(32)]
    assert sum(kept) == 4
    assert all(s.tensors[0].shape == (4, 16) for s in kvq._pending)
    assert kvq.summarize()[0].k_rel_err == 0.0


def test_kv_quality_round_trip_runs_when_summarized_off_the_step(caplog: pytest.LogCaptureFixture) -> None:
    kvq = KvQualitySampler(num_layers=3, period=1)
    gen = torch.Generator().manual_seed(1)
    k, v, q = (torch.randn(4, h, 16, generator=gen) for h in (2, 2, 4))  # [n, Hkv|Hq, Dh]
    calls = []

    def roundtrip(layer_idx: int, k_host: torch.Tensor, v_host: torch.Tensor):
        calls.append(layer_idx)
        if layer_idx == 1:
            return None  # the format cannot tell from these tokens: sample dropped
        if layer_idx == 2:
            raise RuntimeError("broken quantizer")
        return k_host * 1.2, v_host * 0.9

    for layer in range(3):
        kvq.record_raw(layer, k, v, q, roundtrip)
    k.mul_(0)  # the step goes on and overwrites its tensors: the sample kept its own copy
    assert calls == [], "nothing is computed when recording"
    with caplog.at_level(logging.ERROR, logger="zerodram.metrics"):
        (layer,) = kvq.summarize()
    assert calls == [0, 1, 2]
    assert layer.layer_idx == 0
    assert layer.k_rel_err == pytest.approx(0.2, rel=1e-4)
    assert layer.v_rel_err == pytest.approx(0.1, rel=1e-4)
    assert layer.score_rel_err == pytest.approx(0.2, rel=1e-4)
    assert "broken quantizer" in caplog.text


def _fill(collector: MetricsCollector, steps: int, tokens: int) -> None:
    for _ in range(steps):
        collector.timer.begin_step()
        for phase in PHASES:
            collector.timer.mark(phase)
        collector.record_expert_counts([3, 1, 0, 0])
        collector.record_dispatch_bytes([100, 300])
        collector.end_step(num_tokens=tokens)


def test_collector_snapshot_roundtrips_through_json() -> None:
    c = MetricsCollector(1, 2, "cpu", num_layers=2, expert_idx=range(4), kv_quality_period=1)
    _fill(c, steps=10, tokens=8)
    k = torch.randn(4, 16)
    c.kv_quality.maybe_sample(0, k, k * 1.2, k, k)
    c.set_requests(num_running=8, num_queued=3)
    c.set_kv(num_pages_used=25, num_pages_free=75, used_bytes=25 * 1024, bf16_bytes=25 * 8192)
    c.warn("slow step")
    c.timeout("waited for rank 0")
    snap = c.snapshot()
    assert RankSnapshot.from_json(snap.to_json()) == snap
    assert (snap.rank, snap.seq, snap.num_steps, snap.num_tokens) == (1, 1, 10, 80)
    assert snap.tokens_per_s == pytest.approx(80 / snap.uptime_s, rel=0.05)
    assert snap.phase("total").num_samples == 10
    assert snap.expert_counts == (30, 10, 0, 0)
    assert snap.expert_imbalance == pytest.approx(3.0)
    assert snap.send_bytes_per_s[1] == pytest.approx(3 * snap.send_bytes_per_s[0])
    assert snap.kv.occupancy == 0.25
    assert snap.kv.saved_bytes == 25 * 7168
    assert snap.kv_quality[0].k_rel_err == pytest.approx(0.2, rel=1e-4)
    assert (snap.num_warnings, snap.num_timeouts) == (1, 1)
    assert [w.level for w in snap.recent_warnings] == ["warning", "timeout"]
    assert c.snapshot().seq == 2


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a rank snapshot"):
        RankSnapshot.from_json("{not json")
    with pytest.raises(ValueError, match="version"):
        RankSnapshot.from_json('{"v": 99}')


def _snap(rank: int, seq: int, state: str = "running") -> str:
    return RankSnapshot(rank=rank, seq=seq, time_s=0.0, uptime_s=1.0, state=state, kv=KvStats()).to_json()


def test_cluster_sampler_marks_stale_missing_and_stopped() -> None:
    now = [100.0]
    bus = InProcessBus(4)
    sampler = ClusterSampler(bus.reader(), 4, stale_after_s=2.0, clock=lambda: now[0])
    bus.publisher(0).publish(_snap(0, 1))
    bus.publisher(1).publish(_snap(1, 1))
    bus.publisher(2).publish(_snap(2, 1, state="stopped"))
    assert [r.status for r in sampler.sample().ranks] == ["ok", "ok", "stopped", "missing"]
    now[0] += 3.0
    bus.publisher(0).publish(_snap(0, 2))  # rank 0 moved on, rank 1 did not
    ranks = sampler.sample().ranks
    assert [r.status for r in ranks] == ["ok", "stale", "stopped", "missing"]
    assert ranks[1].age_s == pytest.approx(3.0)


def test_the_last_sample_of_a_failing_job_does_not_vouch_for_unconfirmed_ranks() -> None:
    """A rank killed a second ago still has a fresh snapshot; only "stopped" is known for sure."""
    bus = InProcessBus(3)
    sampler = ClusterSampler(bus.reader(), 3)
    bus.publisher(0).publish(_snap(0, 1, state="stopped"))
    bus.publisher(1).publish(_snap(1, 1))
    assert [r.status for r in sampler.sample().ranks] == ["stopped", "ok", "missing"]
    assert [r.status for r in sampler.sample(failed=True).ranks] == ["stopped", "unknown", "missing"]


def test_json_line_is_strict_json() -> None:
    """All-zero K rows make an infinite relative error: the JSON line says null, not Infinity."""
    c = MetricsCollector(0, 1, num_layers=1, kv_quality_period=1)
    zeros = torch.zeros(4, 8)
    c.kv_quality.maybe_sample(0, zeros, zeros + 0.01, zeros, zeros, torch.randn(2, 8))
    snap = c.snapshot()
    assert snap.kv_quality[0].k_rel_err == float("inf")
    line = json_line(ClusterSnapshot.from_snapshots({0: snap}, 1), float("nan"))

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    record = json.loads(line, parse_constant=refuse)
    assert record["elapsed_s"] is None
    quality = record["ranks"][0]["snapshot"]["kv_quality"][0]
    assert (quality["k_rel_err"], quality["v_rel_err"], quality["score_rel_err"]) == (None, 0.0, None)


class _BrokenReader(MetricsReader):
    world_size = 2

    def read(self) -> dict[int, str]:
        raise ConnectionError("store went away\nmore detail")


def test_cluster_sampler_survives_a_broken_transport() -> None:
    cluster = ClusterSampler(_BrokenReader(), 2).sample()
    assert cluster.error == "ConnectionError: store went away"
    assert [r.status for r in cluster.ranks] == ["missing", "missing"]


def test_store_transport_does_not_block_on_absent_ranks() -> None:
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    StorePublisher(2, store).publish(_snap(2, 5))
    reader = StoreReader(4, store)
    t0 = time.monotonic()
    blobs = reader.read()
    assert time.monotonic() - t0 < 1.0, "an absent rank must not cost the store timeout"
    assert list(blobs) == [2]
    assert RankSnapshot.from_json(blobs[2]).seq == 5
    StorePublisher(0, store).publish(_snap(0, 1))
    StorePublisher(2, store).publish(_snap(2, 6))
    blobs = reader.read()
    assert sorted(blobs) == [0, 2]
    assert RankSnapshot.from_json(blobs[2]).seq == 6


def test_the_error_that_stops_a_rank_is_in_its_last_snapshot() -> None:
    c = MetricsCollector(0, 2, "cpu")
    c.failed(RankTimeoutError("rank 0 waited 30 s for rank 1's dispatch of expert 3"))
    c.failed(ValueError("bad row"))
    c.failed(KeyboardInterrupt())  # an interrupt is no failure of the rank
    snap = c.snapshot("stopped")
    assert (snap.num_timeouts, snap.num_errors, snap.num_warnings) == (1, 1, 0)
    assert [(w.level, w.message) for w in snap.recent_warnings] == [
        ("timeout", "rank 0 waited 30 s for rank 1's dispatch of expert 3"),
        ("error", "ValueError: bad row"),
    ]


def test_agent_publishes_periodically_and_a_final_stopped_snapshot() -> None:
    bus = InProcessBus(1)
    c = MetricsCollector(0, 1, "cpu")
    agent = MetricsAgent(c, bus.publisher(0), period_s=0.1).start()
    deadline = time.monotonic() + 5
    while agent.num_published < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    agent.stop()
    agent.stop()  # idempotent
    last = RankSnapshot.from_json(bus.reader().read()[0])
    assert agent.num_published >= 3
    assert last.state == "stopped"


def test_benchmark_clock_and_copy_bandwidth_on_cpu() -> None:
    """The benchmarks' stage marks and copy bandwidth also run on CPU (perf_counter, ops synchronous)."""
    from zerodram.runtime.metrics.devtime import Clock, copy_bandwidth

    clock = Clock(torch.device("cpu"), flush_bytes=1 << 20)  # no flush buffer on CPU
    a = clock.mark()
    time.sleep(0.01)
    clock.idle()
    assert 5 <= clock.between_ms(a, clock.mark()) < 5000
    assert copy_bandwidth(num_bytes=1 << 20, reps=4, device="cpu") > 1e6  # bytes/s, any CPU


def test_medians_interleave_their_repetitions(monkeypatch: pytest.MonkeyPatch) -> None:
    """`medians_ms` times its functions turn about (a, b, a, b, ...) after each one's warm-up, and
    reads each one's median, the timed repetitions after a settling idle; `median_ms` is its
    one-function case. CUDA events are stood in for by a clock that each function advances by a
    known number of ticks, with one slow repetition of each, which the medians must ignore."""
    from zerodram.runtime.metrics import devtime

    ticks = [0]
    calls: list[str] = []

    class TickEvent:  # a CUDA event's interface: record, synchronize, elapsed_time
        def __init__(self, enable_timing: bool = True) -> None:
            self.at = 0

        def record(self) -> None:
            self.at = ticks[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: TickEvent) -> float:
            return float(end.at - self.at)

    def work(name: str, cost: int):
        def run() -> None:
            calls.append(name)
            slow = calls.count(name) == 6  # the first timed repetition (after 3 warm-ups and 2 untimed)
            ticks[0] += cost * (10 if slow else 1)

        return run

    monkeypatch.setattr(torch.cuda, "Event", TickEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(devtime.time, "sleep", lambda s: calls.append(f"|{s}|"))
    flush = torch.zeros(4)
    assert devtime.medians_ms([work("a", 2), work("b", 5)], 5, flush, graph=False) == [2.0, 5.0]
    assert "".join(calls) == f"aaabbb|{devtime.SETTLE_S}|" + "ab" * 7
    calls.clear()
    assert devtime.median_ms(work("c", 3), 5, flush, graph=False) == 3.0
    assert calls == ["c"] * 3 + [f"|{devtime.SETTLE_S}|"] + ["c"] * 7
    # rep_times_ms, what both read: every repetition kept, and the settle probe's no idle
    calls.clear()
    assert devtime.rep_times_ms([work("d", 4)], 3, flush, graph=False, settle_s=0.0) == [[4.0, 4.0, 40.0, 4.0, 4.0]]
    assert calls == ["d"] * 3 + ["|0.0|"] + ["d"] * 5


def test_settle_probe_refuses_bad_cases_and_runs_only_on_a_gpu() -> None:
    """`zerodram bench settle` (benchmarks/settle_probe.py, the probe behind `SETTLE_S`)."""
    from bench_cli import assert_refuses_without_gpu, run_bench

    out = run_bench(["settle", "--cases", "8:131072"])
    assert out.returncode == 2 and "--cases takes B:L:COUNTS" in out.stderr, out.stderr[-2000:]
    assert_refuses_without_gpu("settle")


def test_dispatch_bytes_follow_the_owner_each_token_goes_to() -> None:
    """A replicated expert's rows are counted at the owner the dispatch picks for each token,
    owners[e][t % len(owners[e])], not all at its primary."""
    from zerodram.runtime.engine.metrics_bridge import MetricsBridge

    c = MetricsCollector(0, 2, "cpu", num_layers=1, expert_idx=range(3))
    bridge = MetricsBridge(c, ((0,), (0, 1), (1,)), hidden=4, bytes_per_elem=2)
    bridge.begin_step()
    # tokens 0-2 pick expert 1 (ranks 0, 1, 0), token 3 expert 0 (rank 0), token 4 expert 2 (rank 1)
    bridge.routed(0, torch.tensor([[1], [1], [1], [0], [2]]))
    assert bridge._rows_to.tolist() == [3, 2]
    assert bridge._counts.tolist() == [1, 3, 1]
