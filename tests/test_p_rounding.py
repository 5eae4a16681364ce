"""`zerodram bench p-rounding` on CPU: fp16 P stays far below e4m3 P in output error."""

from __future__ import annotations

import json

from bench_cli import load_script, run_bench


def test_fp16_p_is_exact_enough_and_e4m3_p_is_not() -> None:
    mod = load_script("p_rounding")
    for L in (64, 4096):
        r = mod.row_errors(L, 1.0, [0, 4], seed=1)
        assert r["fp16"] < 1e-3, r
        assert 3e-3 < r["e4m3_shift0"] < 0.1, r  # 3 mantissa bits: a few percent, not noise
        assert r["e4m3_shift4"] > r["e4m3_shift0"], r  # 2^4 pushes the largest products past 448


def test_cli_prints_one_json_line_per_case() -> None:
    out = run_bench(["p-rounding", "--lengths", "64,128", "--temps", "1", "--shifts", "0", "--json"])
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["L"], r["temp"]) for r in rows] == [(64, 1.0), (128, 1.0)]
