"""Four CPU ranks publish through the real store transport; rank 0 reads, renders and checks.

First, hand-made metrics: every rank's numbers encode its rank (tokens per step, requests, KV
pages, its hot expert), so the test can tell from rank 0's render whose row is whose, and compare
it with what each rank sent. Then a real engine run (tiny random MoE, FP2 KV) under the serving
jobs' `observe`: rank 0's last frame, plain lines and JSON lines against what the engine did.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from multirank import run_ranks
from rich.console import Console

from zerodram.launch.dashboard_view import render
from zerodram.runtime.context import RankContext
from zerodram.runtime.metrics import (
    PHASES,
    ClusterSampler,
    MetricsCollector,
    RankSnapshot,
    StorePublisher,
    StoreReader,
)
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


ENGINE_PROMPTS = [[5 + i, 6, 7, 8 + i, 9] * (1 + i % 3) for i in range(8)] + [[]]  # the last is refused
ENGINE_TOKENS = 12


def _serve_and_render(ctx: RankContext, metrics_file: str, svg: str) -> dict:
    """A real engine on every rank under `observe`; rank 0 returns its frames and outputs."""
    import argparse

    import torch

    from zerodram.launch.observe import observe
    from zerodram.runtime.engine import EngineConfig, SamplingParams, SchedulerConfig
    from zerodram.runtime.engine.build import build_engine

    torch.set_num_threads(1)
    # FP2 in channel blocks of 16: tiny-moe's head dim (the default blocks are 64 channels)
    cfg = EngineConfig(kv_format="fp2:blk=c16", num_kv_pages=8, page_size=32, scheduler=SchedulerConfig(4, 32, 8))
    engine = build_engine("random:tiny-moe", ctx, cfg)
    args = argparse.Namespace(no_dashboard=True, metrics_file=Path(metrics_file), svg=Path(svg))
    console = Console(record=True, width=WIDTH, file=io.StringIO())
    with observe(ctx, engine, args, console=console) as dash:
        outs = engine.generate(ENGINE_PROMPTS, SamplingParams(max_tokens=ENGINE_TOKENS, ignore_eos=True))
    if ctx.rank != 0:
        return {}
    return {
        "outs": [(o.rank, len(o.token_ids), o.finish_reason) for o in outs],
        "last": [None if s.snapshot is None else s.snapshot.to_json() for s in dash.last.ranks],
        "status": [s.status for s in dash.last.ranks],
        "frame": dash.export(WIDTH, 60).export_text(),
        "plain": console.export_text(),
        "failed": dict(dash.failed),
    }


SERVE_LINES = [
    json.dumps({"prompt_ids": [5, 6, 7], "params": {"max_tokens": 3, "ignore_eos": True}, "id": "a"}),
    "{not json",
    json.dumps({"prompt_ids": [1] * 600, "id": "long"}),
    json.dumps({"prompt_ids": [9, 9], "params": {"top_p": 0}, "id": "top_p"}),
    *(json.dumps({"prompt_ids": [i, 2], "params": {"max_tokens": 2, "ignore_eos": True}}) for i in range(6)),
]


def _serve_job(ctx: RankContext, tmp: str) -> int:
    """The `serve` worker job itself, as torchrun would run it, with bad lines among good ones."""
    from zerodram.launch.serve_cmd import serve_job

    inp, out = Path(tmp) / "requests.jsonl", Path(tmp) / "results.jsonl"
    if ctx.rank == 0:
        inp.write_text("\n".join(SERVE_LINES) + "\n")
    argv = ["--model", "random:tiny-moe", "--kv", "fp32", "--input", str(inp), "--output", str(out)]
    return serve_job(ctx, [*argv, "--no-dashboard", "--metrics-file", str(Path(tmp) / "serve.jsonl")])


def _both(ctx: RankContext, metrics_file: str, svg: str) -> dict:
    # One job for all tests: starting four ranks costs ~10 s on a small machine.
    out = _publish_and_render(ctx)
    out["engine"] = _serve_and_render(ctx, metrics_file, svg)
    out["serve_rc"] = _serve_job(ctx, str(Path(metrics_file).parent))
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path, Path]:
    topo = load_topology(resolve_topology_path("local-cpu-4"))
    tmp = tmp_path_factory.mktemp("engine")
    path, svg = tmp / "metrics.jsonl", tmp / "dashboard.svg"
    return run_ranks(_both, 4, args=(str(path), str(svg)), topology=topo, timeout_s=180), path, svg


def test_four_ranks_through_the_store_to_rank_zero(four_ranks: tuple[list[dict], Path, Path]) -> None:
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


def test_a_real_engine_run_on_four_ranks_as_rank_zero_shows_it(
    four_ranks: tuple[list[dict], Path, Path],
) -> None:
    results, path, svg = four_ranks
    run = results[0]["engine"]
    outs = run["outs"]
    assert outs[-1][2] == "error"
    assert all(n == ENGINE_TOKENS and reason == "length" for _, n, reason in outs[:-1])
    assert sorted({r for r, _, _ in outs[:-1]}) == [0, 1, 2, 3], "requests spread over every rank"
    assert run["status"] == ["ok"] * 4
    assert run["failed"] == {}
    snaps = [RankSnapshot.from_json(j) for j in run["last"]]
    # every sampled token is counted once, by the rank that owns the request
    for snap in snaps:
        assert snap.num_tokens == sum(n for r, n, _ in outs[:-1] if r == snap.rank)
        assert snap.num_steps > 0
        assert snap.kv.num_pages_used == 0, "every request finished: pages freed"
        assert [q.layer_idx for q in snap.kv_quality] == [0, 1], "both layers' K/V sampled"
        assert all(0.05 < q.k_rel_err < 1.0 and q.score_rel_err is not None for q in snap.kv_quality)
        assert len(snap.expert_counts) == 8
    assert snaps[0].num_errors == 1, "the refused request is counted on rank 0"
    frame = run["frame"]
    assert "4/4 ok" in frame
    for snap in snaps:
        (row,) = [line for line in frame.splitlines() if f"  r{snap.rank} cpu" in line]
        assert f"{snap.phase('total').p50_ms:.2f}" in row, row
        assert f"{snap.num_running}/{snap.num_queued}" in row
    assert "KV quality" in frame
    assert "no K/V samples yet" not in frame
    assert "expert load" in frame
    assert "errors 1" in frame
    assert "zerodram local-cpu-4" in run["plain"], "plain lines without a terminal"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records
    assert [r["snapshot"]["num_tokens"] for r in records[-1]["ranks"]] == [s.num_tokens for s in snaps]
    assert svg.read_text().startswith("<svg")


def test_the_serve_job_on_four_ranks_answers_every_line(four_ranks: tuple[list[dict], Path, Path]) -> None:
    results, path, _ = four_ranks
    assert [r["serve_rc"] for r in results] == [0] * 4
    recs = [json.loads(line) for line in (path.parent / "results.jsonl").read_text().splitlines()]
    by_id = {str(r["id"]): r for r in recs}
    assert len(recs) == len(SERVE_LINES)
    assert by_id["a"]["finish_reason"] == "length"
    assert len(by_id["a"]["token_ids"]) == 3
    assert "bad request line" in by_id["1"]["error"]
    assert "exceeds the model" in by_id["long"]["error"]
    assert "top_p" in by_id["top_p"]["error"]
    served = [r for r in recs if r["finish_reason"] == "length"]
    assert len(served) == 7
    assert {r["rank"] for r in served} == {0, 1, 2, 3}
    last = json.loads((path.parent / "serve.jsonl").read_text().splitlines()[-1])
    assert last["ranks"][0]["snapshot"]["num_errors"] == 3
