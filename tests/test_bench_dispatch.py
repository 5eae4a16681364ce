"""`zerodram bench dispatch` on CPU: the JSON lines, the summary, progress on rank 0 only, and the
multi-rank flow under torchrun (gloo). Smoke runs: nothing here is a measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_cli import run_bench
from multirank import free_port

REPO = Path(__file__).resolve().parents[1]
FIELDS = {
    "path", "wire", "tokens", "hidden", "experts", "topk", "world_size", "dispatch_graph_us",
    "combine_graph_us", "dispatch_eager_us", "combine_eager_us", "graph_host_bound", "host_stages_us",
    "dispatch_bytes", "combine_bytes", "dispatch_floor_us", "combine_floor_us", "floor_basis", "iters",
    "warmup", "shared_gpu", "note", "device", "date", "route", "unfused_dispatch_graph_us",
    "unfused_dispatch_eager_us",
}  # fmt: skip
STAGES = {f"dispatch.{s}" for s in ("plan", "counts", "rows", "unpack")} | {
    f"combine.{s}" for s in ("gather", "rows", "reduce")
}
TINY = ["--json", "--iters", "2", "--warmup", "1", "--tokens", "1,4", "--hidden", "128", "--experts", "4"]


def _env() -> dict[str, str]:
    return {
        "ZERODRAM_FORCE_CPU": "1",
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "OMP_NUM_THREADS": "1",
    }


def _rows(stdout: str) -> list[dict]:
    lines = stdout.splitlines()
    assert all(line.startswith("{") for line in lines), f"--json: stdout must hold JSON lines only: {lines}"
    return [json.loads(line) for line in lines]


def test_bench_dispatch_json_on_cpu() -> None:
    out = run_bench(["dispatch", *TINY], env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    rows = _rows(out.stdout)
    assert {(r["path"], r["wire"], r["tokens"]) for r in rows} == {
        ("torch", w, t) for w in ("bf16", "fp8") for t in (1, 4)
    }
    for r in rows:
        assert set(r) == FIELDS, set(r) ^ FIELDS
        assert r["dispatch_eager_us"] > 0 and r["combine_eager_us"] > 0
        assert r["dispatch_graph_us"] is None  # no graph on the host path
        assert set(r["host_stages_us"]) == STAGES
        assert r["dispatch_bytes"] == r["tokens"] * 2 * (256 if r["wire"] == "bf16" else 128 + 16)
        assert (r["world_size"], r["shared_gpu"], r["iters"], r["warmup"]) == (1, False, 2, 1)
        assert r["route"] == "given" and r["unfused_dispatch_graph_us"] is None
    assert "bench dispatch: 4/4" in out.stderr  # progress (plain lines: not a terminal)
    assert "median over 4 torch cases" in out.stderr  # the summary, on stderr with --json


def test_bench_dispatch_routes_from_a_gate_weight_on_cpu() -> None:
    """--route gate on the host path: torch's router inside dispatch (no fused router to compare)."""
    out = run_bench(["dispatch", *TINY, "--wires", "bf16", "--route", "gate"], env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    rows = _rows(out.stdout)
    assert [(r["route"], r["tokens"]) for r in rows] == [("gate", 1), ("gate", 4)]
    assert all(r["dispatch_eager_us"] > 0 and r["unfused_dispatch_eager_us"] is None for r in rows)
    assert "fused router" not in out.stderr  # the comparison line needs the NVSHMEM path


@pytest.mark.slow
def test_bench_dispatch_under_torchrun_on_four_cpu_ranks() -> None:
    env = {**_env(), "ZERODRAM_TOPOLOGY": "local-cpu-4"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
        str(REPO / "benchmarks" / "dispatch.py"), *TINY, "--wires", "bf16",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(out.stdout)  # rank 0 alone prints: one line per case
    assert [(r["tokens"], r["world_size"]) for r in rows] == [(1, 4), (4, 4)]
    assert all(r["floor_basis"].startswith("topology link") for r in rows)
    assert out.stderr.count("bench dispatch: 2/2") == 1


def test_stage_watchdog_ends_a_stuck_stage() -> None:
    code = (
        "import time; from zerodram.launch.watchdog import StageWatchdog; "
        "d = StageWatchdog('rank 1/2', poll_s=0.05); d.stage('barrier after case 3', 0.2); time.sleep(30)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 4
    assert "rank 1/2: no progress for 0.2s in barrier after case 3" in out.stderr
    assert "time.sleep" in out.stderr or "line 1" in out.stderr  # the stuck thread's stack


@pytest.mark.gpu
@pytest.mark.slow
def test_bench_dispatch_graph_and_eager_on_one_gpu() -> None:
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "dispatch.py"), "--json", "--iters", "3", "--warmup", "1",
        "--tokens", "1,32", "--hidden", "4096", "--experts", "32", "--topk", "2", "--wires", "bf16",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=dict(os.environ), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(out.stdout)
    assert {(r["path"], r["tokens"]) for r in rows} == {(p, t) for p in ("nvshmem", "torch") for t in (1, 32)}
    for r in rows:
        if r["path"] == "nvshmem":
            assert r["dispatch_graph_us"] > 0 and r["combine_graph_us"] > 0, r
        else:
            assert r["dispatch_graph_us"] is None and set(r["host_stages_us"]) == STAGES


@pytest.mark.gpu
@pytest.mark.slow
def test_bench_dispatch_times_the_fused_router_beside_torchs() -> None:
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "dispatch.py"), "--json", "--iters", "3", "--warmup", "1",
        "--tokens", "1,32", "--hidden", "4096", "--experts", "32", "--topk", "2", "--wires", "bf16",
        "--paths", "nvshmem", "--route", "gate",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=dict(os.environ), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(out.stdout)
    assert [(r["route"], r["tokens"]) for r in rows] == [("gate", 1), ("gate", 32)]
    for r in rows:
        assert r["dispatch_graph_us"] > 0 and r["unfused_dispatch_graph_us"] > 0, r
        assert r["unfused_dispatch_eager_us"] > 0, r
    assert "fused router + dispatch vs torch's router then dispatch (graph), median over 2" in out.stderr
