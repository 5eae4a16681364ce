"""`zerodram bench decode` runs on CPU at small sizes: both paths, every stage timed, floors below."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_decode_runs_on_cpu() -> None:
    argv = ["bench", "decode", "--batches", "1,3", "--contexts", "100", "--iters", "2", "--warmup", "1"]
    env = {"ZERODRAM_FORCE_CPU": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    code = f"import sys; from zerodram.launch.cli import main; sys.exit(main({argv!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "breakdown at L = 100" in out.stdout
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {(r["path"], r["B"], r["L"]) for r in rows} == {
        (p, b, 100) for p in ("fp2-fused", "bf16-host") for b in (1, 3)
    }
    for r in rows:
        stages = [r[f"{s}_ms"] for s in ("attention", "dispatch", "experts", "combine")]
        assert all(ms > 0 for ms in stages)
        assert abs(sum(stages) - r["total_ms"]) < 1e-2
        assert 0 < r["total_floor_ms"] < r["total_ms"]
        assert r["dispatch"] == "torch"  # no NVSHMEM on CPU, and the row says so
        assert 1 <= r["experts_touched"] <= 2 * r["B"]
    fp2, bf16 = (next(r for r in rows if r["path"] == p and r["B"] == 3) for p in ("fp2-fused", "bf16-host"))
    assert fp2["kv_bytes"] < bf16["kv_bytes"]
