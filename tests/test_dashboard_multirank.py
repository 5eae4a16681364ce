"""Four CPU ranks publish through the real store transport; rank 0 reads, renders and checks.

Every rank's numbers encode its rank (tokens per step, requests, KV pages, its hot expert), so the
test can tell from rank 0's render whose row is whose, and compare it with what each rank sent.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from multirank import run_ranks
from rich.console import Console

from zerodram.launch.dashboard import render
from zerodram.runtime.context import RankContext
from zerodram.runtime.metrics import (
    PHASES,
    ClusterSampler,
    MetricsCollector,
    RankSnapshot,
    StorePublisher,
    StoreReader,
)
from zerodram.runtime.metrics.demo import run_metrics_demo
from zerodram.runtime.metrics.summary import fmt_rate
from zerodram.runtime.topology import load_topology, resolve_topology_path

pytestmark = pytest.mark.slow
WIDTH = 140


def _text(renderable) -> str:
    console = Console(record=True, width=WIDTH, height=60, force_terminal=False, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


PREFIX = "zerodram/test-metrics/"  # apart from the demo's keys, which the same job uses after


def _publish_and_render(ctx: RankContext) -> dict:
    topo = ctx.topology
    metrics = MetricsCollector.for_context(ctx)
    for _ in range(20):
        metrics.timer.begin_step()
        for phase in PHASES:
            metrics.timer.mark(phase)
        counts = [1] * topo.experts.num_experts
        counts[9 * ctx.rank] = 50  # rank r's hot expert: 9r
        metrics.record_expert_counts(counts)
        metrics.end_step(num_tokens=10 * (ctx.rank + 1))
    metrics.set_requests(num_running=ctx.rank + 1, num_queued=ctx.rank)
    metrics.set_kv(10 * (ctx.rank + 1), 90 - 10 * ctx.rank, 1024 * (ctx.rank + 1), 8192 * (ctx.rank + 1))
    publisher = StorePublisher(ctx.rank, prefix=PREFIX)
    sent = [metrics.snapshot().to_json()]
    publisher.publish(sent[0])
    ctx.barrier("first snapshots published")
    out: dict = {"rank": ctx.rank}
    if ctx.rank == 0:
        sampler = ClusterSampler(
            StoreReader(ctx.world_size, prefix=PREFIX), ctx.world_size, stale_after_s=0.5
        )
        first = sampler.sample()
        out["first"] = [s.status for s in first.ranks]
        out["first_read"] = [s.snapshot.to_json() for s in first.ranks]
        out["first_text"] = _text(render(first, topo, width=WIDTH, height=60))
    time.sleep(0.8)
    if ctx.rank != 3:  # rank 3 goes quiet: rank 0 must show it stale, and not wait for it
        sent.append(metrics.snapshot().to_json())
        publisher.publish(sent[-1])
    ctx.barrier("second snapshots published")
    if ctx.rank == 0:
        t0 = time.monotonic()
        second = sampler.sample()
        out["second_read_s"] = time.monotonic() - t0
        out["second"] = [s.status for s in second.ranks]
        out["second_text"] = _text(render(second, topo, width=WIDTH, height=60))
    out["sent"] = sent
    return out


def _both(ctx: RankContext, demo_argv: list[str]) -> dict:
    # One job for both tests: starting four ranks costs ~10 s on a small machine.
    out = _publish_and_render(ctx)
    out["demo_rc"] = run_metrics_demo(ctx, demo_argv)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    topo = load_topology(resolve_topology_path("local-cpu-4"))
    path = tmp_path_factory.mktemp("demo") / "metrics.jsonl"
    argv = ["--seconds", "2.5", "--no-dashboard", "--metrics-file", str(path)]
    return run_ranks(_both, 4, args=(argv,), topology=topo, timeout_s=90), path


def test_four_ranks_through_the_store_to_rank_zero(four_ranks: tuple[list[dict], Path]) -> None:
    results = four_ranks[0]
    zero = results[0]
    assert zero["first"] == ["ok"] * 4
    # rank 0 read exactly what every rank sent
    assert zero["first_read"] == [r["sent"][0] for r in results]
    text = zero["first_text"]
    assert "4/4 ok" in text
    for r in results:
        snap = RankSnapshot.from_json(r["sent"][0])
        (row,) = [line for line in text.splitlines() if f"  r{snap.rank} cpu" in line]
        assert fmt_rate(snap.tokens_per_s) in row, row
        assert f"{snap.num_running}/{snap.num_queued}" in row
        assert f"{snap.kv.occupancy:.0%}" in row
        assert snap.num_tokens == 200 * (snap.rank + 1)
    assert "hottest e0 on r0" in text  # 50 from rank 0 + 1 from each other rank beats e9r's 50 + 3
    # rank 3 stopped publishing: stale, the others fresh, and reading did not wait on it
    assert zero["second"] == ["ok", "ok", "ok", "stale"]
    assert zero["second_read_s"] < 1.0
    stale_row = next(line for line in zero["second_text"].splitlines() if "  r3 cpu" in line)
    assert "stale" in stale_row
    assert "3/4 ok" in zero["second_text"]


def test_metrics_demo_runs_on_four_ranks(four_ranks: tuple[list[dict], Path]) -> None:
    results, path = four_ranks
    assert [r["demo_rc"] for r in results] == [0, 0, 0, 0]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) >= 2
    last = records[-1]
    assert len(last["ranks"]) == 4
    assert any(all(r["status"] == "ok" for r in rec["ranks"]) for rec in records)
    snaps = [r["snapshot"] for r in last["ranks"] if r["snapshot"] is not None]
    assert snaps
    assert all(s["num_steps"] > 0 and s["kv"]["num_pages_used"] > 0 for s in snaps)
    assert all(s["kv_quality"] for s in snaps), "every rank sampled K/V quality"
    assert last["tokens_per_s"] > 0
