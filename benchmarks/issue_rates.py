"""Issue rates of single instructions and interleaved pairs on this GPU (a probe for kernel design).

    python benchmarks/issue_rates.py [--json] [--pairs A+B,...]
    zerodram bench issue-rates ...

What it answers: how many warp instructions per cycle one SM sub-partition (SMSP) issues of an
instruction alone, and of two interleaved, when latency is covered (8 warps per SMSP, 8
independent chains per thread). 1.0 is the issue limit; 0.5 means the instruction holds a
half-rate pipe for two cycles; a pair near the sum of its parts runs on two pipes. The decode
kernel's instruction choices rest on it (docs/fp2-kernel.md, "Issue costs").

The probe kernel is kernels/cuda/probe_issue_rates.cu, built per pair through the runtime's JIT
(NVRTC), one CTA of 1024 threads per SM; the time of a CTA is its last warp's end minus its first
warp's start (clock64), averaged over CTAs. The figures are cycles, so the clock does not matter.
"""

from __future__ import annotations

import argparse
import json
import sys

OPS = ("LOP3", "PRMT", "IMAD", "IMAD.HI", "HADD2.H1", "FFMA", "I2FP", "F2FP.E4M3", "FMNMX", "SHF")
ITERS = 2048
DEFAULT_PAIRS = (
    "LOP3,PRMT,IMAD,IMAD.HI,HADD2.H1,FFMA,I2FP,F2FP.E4M3,FMNMX,SHF,"
    "LOP3+PRMT,LOP3+IMAD,PRMT+IMAD,PRMT+IMAD.HI,PRMT+HADD2.H1,PRMT+FFMA,PRMT+I2FP,PRMT+FMNMX,"
    "PRMT+SHF,IMAD+FFMA,IMAD.HI+FFMA,HADD2.H1+FFMA"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", default=DEFAULT_PAIRS, help=f"A or A+B, comma separated; A, B in {', '.join(OPS)}")
    p.add_argument("--json", action="store_true", help="one JSON line with every rate")


def _parse(pairs: str) -> list[tuple[str, str]]:
    out = []
    for item in pairs.split(","):
        a, _, b = item.strip().partition("+")
        b = b or a
        for name in (a, b):
            if name not in OPS:
                raise SystemExit(f"unknown instruction {name!r} in --pairs; known: {', '.join(OPS)}")
        out.append((a, b))
    return out


def rate(a: str, b: str) -> float:
    """Warp instructions per cycle per SMSP for the pair (a, b) interleaved (a == b: one alone)."""
    import numpy as np
    import torch

    from zerodram.kernels.jit import BuildOptions
    from zerodram.kernels.module import launch, load_module, ptr

    opts = BuildOptions.make(defines={"OP_A": OPS.index(a), "OP_B": OPS.index(b), "ITERS": ITERS})
    kernel = load_module("probe_issue_rates", opts).kernel("probe_issue_rates")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 1024, dtype=torch.int32, device="cuda")
    cycles = torch.empty(sms, dtype=torch.int64, device="cuda")
    for _ in range(2):  # the first launch warms up
        launch(kernel, grid=(sms,), block=(1024,), args=(ptr(out), np.uint32(12345), ptr(cycles)))
    torch.cuda.synchronize()
    per_cta = float(cycles.double().mean())
    # 32 warps per CTA = 8 per SMSP, each issuing 8 instructions per iteration
    return 8 * 8 * ITERS / per_cta


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("issue_rates needs a CUDA GPU", file=sys.stderr)
        return 2
    pairs = _parse(args.pairs)
    rows = {f"{a}+{b}" if a != b else a: rate(a, b) for a, b in pairs}
    name = torch.cuda.get_device_name(0)
    print(f"# {name}: warp instructions issued per cycle per SM sub-partition (1.0 = the issue limit)")
    for k, v in rows.items():
        print(f"{k:>24} {v:6.3f}")
    if args.json:
        print(json.dumps({"bench": "issue_rates", "device": name, "iters": ITERS, "rates": rows}))
    return 0



if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
