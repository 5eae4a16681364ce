"""What rounding P to 8 bits would cost the decode attention's output (a probe for kernel design).

    python benchmarks/p_rounding.py [--json] [--lengths 64,8192,131072] [--temps 1,3]
    zerodram bench p-rounding ...

An FP8 `wgmma` for the value product (docs/fp2-kernel.md, "What the measured counts say about the
next step") takes P as e4m3, with each token's value scale folded in (values as e5m2 levels), where
today's kernel takes P times the scale as fp16. This measures, for one query row, the relative
error of the output sum_t p_t s_t v_t / sum_t p_t when p_t s_t is rounded to e4m3 (times 2^k
before, 2^-k after; k from --shifts) or to fp16, against fp32. Synthetic data on CPU: q, k, v
Gaussian (D = 128), scores (k . q) / sqrt(D) times a temperature (higher: peakier), p = exp(score -
max) * 2^7 (the kernel's lazy max lets p reach 2^7), value scales 2^N(0, 0.5). A probe, not a
quality measurement: the FP2 cache's own attention error is 16-32% on SmolLM2 (docs/kv-quality.md),
and only a perplexity run with the engine can say what e4m3 P adds to it.
"""

from __future__ import annotations

import argparse
import json
import sys

from zerodram.runtime.argtypes import int_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=int_list, default="64,8192,131072", help="tokens per row, comma separated")
    p.add_argument("--temps", default="1,3", help="score temperatures, comma separated")
    p.add_argument("--shifts", default="-4,-2,0,1,2", help="k in 2^k before rounding to e4m3, comma separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON line per (length, temperature)")


def row_errors(L: int, temp: float, shifts: list[int], seed: int) -> dict[str, float]:
    """Relative output error of one attention row with p * s in fp16 and in e4m3 (per shift)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + L)
    D = 128
    q, k, v = torch.randn(D, generator=g), torch.randn(L, D, generator=g), torch.randn(L, D, generator=g)
    s = torch.exp2(torch.randn(L, generator=g) * 0.5)  # [L] value scales
    score = (k @ q) / D**0.5 * temp  # [L]
    p = torch.exp(score - score.max()) * 2**7  # [L]
    ref = (p * s) @ v / p.sum()  # [D]

    def err(ps: torch.Tensor) -> float:
        return float(((ps @ v / p.sum()) - ref).norm() / ref.norm())

    out = {"fp16": err((p * s).half().float())}
    for sh in shifts:
        ps8 = (p * s * 2.0**sh).clamp(max=448.0).to(torch.float8_e4m3fn).float() * 2.0**-sh
        out[f"e4m3_shift{sh}"] = err(ps8)
    return out


def run(args: argparse.Namespace) -> int:
    lengths = list(args.lengths)
    temps = [float(x) for x in args.temps.split(",")]
    shifts = [int(x) for x in args.shifts.split(",")]
    rows = [{"L": L, "temp": t, **row_errors(L, t, shifts, args.seed)} for L in lengths for t in temps]
    if args.json:
        for r in rows:
            print(json.dumps({"bench": "p_rounding", **r}))
        return 0
    print(f"{'L':>7} {'temp':>5} {'fp16':>8} " + " ".join(f"{'e4m3 2^' + str(sh):>10}" for sh in shifts))
    for r in rows:
        cells = " ".join(f"{r[f'e4m3_shift{sh}']:>10.4f}" for sh in shifts)
        print(f"{r['L']:>7} {r['temp']:>5.1f} {r['fp16']:>8.5f} {cells}")
    print("relative output error against fp32; e4m3 2^k: p * s scaled by 2^k, rounded, scaled back")
    return 0


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
