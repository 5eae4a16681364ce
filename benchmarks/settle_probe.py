"""How long a decode runs slow after heavy GPU work (a probe for how benchmarks time).

    python benchmarks/settle_probe.py [--cases 8:131072:4,6,8,16 2:131072:8,16,23] [--smi FILE]
    zerodram bench settle ...

One (B, L) set up as benchmarks/attention.py sets it up, then one decode graph (the wave model's
count, which was the plan's when stop 48 ran this) timed in phases, 22 repetitions each (the first 2
untimed), the L2 flushed before each and no idle before them (unlike `medians_ms`): right after
setup; again at once; right after `check_rel_err` (the reference dequantizes ~1 GB a sequence at
128k); again at once; after 2 s idle; right after filling 3 GB; after 2 s idle; right after 2 s of
bf16 GEMMs; then the case's counts interleaved, after 2 s idle and again right after a check. One
JSON line per phase and count: every repetition's time (us), the median of the timed ones,
wall-clock stamps. `--smi FILE` samples `nvidia-smi` clocks, power and throttle reasons every 50 ms
into FILE alongside. Stop 48's run (docs/benchmarks.md, "What the first count timed had") found the
decode 12-17% slower for ~8 ms after the check or the fill, which is why `medians_ms` idles
`SETTLE_S` before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from zerodram.launch.bench_cmd import load_sibling

REPS = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cases", nargs="+", default=["8:131072:4,6,8,16", "2:131072:8,16,23"],
        help="B:L:COUNTS, the counts to interleave in the last two phases",
    )  # fmt: skip
    p.add_argument("--smi", default=None, help="a file for nvidia-smi samples every 50 ms")


def _reps_us(fns, flush) -> list[list[float]]:
    """Every repetition's time (us) of each of fns, captured as graphs, their repetitions
    interleaved, the L2 flushed before each; no idle before the first (the point of the probe)."""
    from zerodram.runtime.metrics.devtime import rep_times_ms

    return [[round(t * 1e3, 1) for t in ts] for ts in rep_times_ms(fns, REPS, flush, settle_s=0.0)]


def _case(B: int, L: int, counts: list[int], attention) -> None:
    import torch

    from zerodram.runtime.attention import Fp2DecodeAttention, random_decode_batch, random_fp2_layer

    (hq, hkv, d), P, HP, dev = attention.SHAPE, attention.P, attention.HP, "cuda"
    flush = torch.zeros(64 << 20, dtype=torch.float32, device=dev)  # 256 MB, as the benchmark's
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(50):  # the benchmark's clock warm-up
        a @ a
    torch.cuda.synchronize()
    gen = torch.Generator(device=dev).manual_seed(B * 7 + L)
    pages = B * -(-L // P)
    layer = random_fp2_layer(pages, hkv, P, d, device=dev, generator=gen, v_layout="quad")
    batch = random_decode_batch([L] * B, [HP] * B, pages, hkv, P, d, hp_max=HP, device=dev, generator=gen)
    q = torch.randn(B, hq, d, device=dev, generator=gen)
    att = Fp2DecodeAttention(
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P, max_batch=B, max_fp2_tokens=L, device=dev,
        v_layout="quad", workspace_splits=Fp2DecodeAttention.most_count(L),
    )  # fmt: skip
    wave = att.wave_count(B, L)

    def decode(splits: int):
        return lambda: att(q, layer, batch, max_len=L, num_splits=splits)

    t0 = time.time()

    def phase(name: str, tags: list[int], fns) -> None:
        start = time.time() - t0
        for tag, ts in zip(tags, _reps_us(fns, flush), strict=True):
            row = {"B": B, "L": L, "phase": name, "count": tag, "t_start": round(start, 2),
                   "t_end": round(time.time() - t0, 2), "wall0": round(t0, 2),
                   "median_us": statistics.median(ts[2:]), "us": ts}  # fmt: skip
            print(json.dumps(row), flush=True)

    def check() -> None:
        print(json.dumps({"check_rel_err": attention.check_rel_err(att, q, layer, batch, L, wave)}), flush=True)

    phase("first", [wave], [decode(wave)])
    phase("again", [wave], [decode(wave)])
    check()
    phase("after_check", [wave], [decode(wave)])
    phase("after_check_again", [wave], [decode(wave)])
    time.sleep(2)
    phase("after_2s_idle", [wave], [decode(wave)])
    big = torch.empty(3 << 30, dtype=torch.uint8, device=dev)
    big.fill_(1)
    torch.cuda.synchronize()
    del big
    phase("after_3GB_touch", [wave], [decode(wave)])
    time.sleep(2)
    phase("idle_again", [wave], [decode(wave)])
    end = time.time() + 2
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    phase("after_2s_gemm", [wave], [decode(wave)])
    time.sleep(2)
    phase("interleaved", counts, [decode(s) for s in counts])
    check()
    phase("interleaved_after_check", counts, [decode(s) for s in counts])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        cases = [(int(b), int(n), [int(c) for c in cs.split(",")]) for b, n, cs in (x.split(":") for x in args.cases)]
    except ValueError:
        print(f"--cases takes B:L:COUNTS (counts comma separated), got {args.cases}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("settle probe needs a CUDA GPU", file=sys.stderr)
        return 2
    attention = load_sibling(__file__, "attention")
    smi = None
    if args.smi:
        query = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
        with open(args.smi, "w") as out:  # the child keeps its own handle
            smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv", "-lms", "50"], stdout=out)
    try:
        for B, L, counts in cases:
            _case(B, L, counts, attention)
    finally:
        if smi is not None:
            smi.terminate()
    return 0


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
