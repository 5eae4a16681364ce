"""The decode kernel's main loop as ptxas compiled it: instructions per stage, without a GPU.

    python benchmarks/sass_census.py [--json] [--configs default,fp16keys,token] [--opcodes]
                                     [--set FIELD=VALUE ...]
    zerodram bench sass ...

Compiles `attn_fp2_decode` through the package's own JIT (NVRTC, the cubin that runs), and counts
the steady walk of its main loop with `zerodram.kernels.sass.census`: one iteration is one warp's
stage, so the count per 8192 K/V elements (32 tokens x D 128 x K and V) is the one Nsight Compute
measures per stage (docs/fp2-kernel.md, "Static counts", for how far the two agree). Columns: the
walk's instructions, those per 8192 K/V elements, the ALU pipe's share (LOP3, PRMT, SHF, I2FP,
FMNMX, F2FP: one warp instruction per two cycles, docs/fp2-kernel.md, "Issue costs"), MMAs,
shared-memory loads, copies, the shortest and longest walks round the loop, ptxas's fixed stall
cycles along the stage (the schedule, not only the count), registers and spilled loads and stores. A count, not a time: a change that lowers it still needs `bench attention` on a
GPU, and the first config is the baseline the others are read against.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

ALU_PIPE = ("LOP3", "PRMT", "SHF", "I2FP", "FMNMX", "F2FP")  # measured at half the issue rate
MMA = ("HMMA", "IMMA", "HGMMA", "IGMMA", "QGMMA")
SHARED_LOADS = ("LDS", "LDSM")


def configs() -> dict:
    """Name -> kernel config (D 128, G 4, c64 blocks, 4 warps x 4 stages): the runtime's default
    first, then the variants the docs compare it with."""
    from zerodram.kernels.attention import Fp2KernelConfig

    return {
        "default": Fp2KernelConfig(key_s8=True, v_quad=True),  # what Fp2DecodeAttention builds
        "fp16keys": Fp2KernelConfig(key_s8=False, v_quad=True),
        "token": Fp2KernelConfig(key_s8=True, v_quad=False),  # values in the token layout
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="default,fp16keys,token", help="comma separated, from: default, fp16keys, token")
    p.add_argument("--opcodes", action="store_true", help="also each config's steady walk by opcode")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an Fp2KernelConfig field in every config (max_registers=168, stages=5)")
    p.add_argument("--json", action="store_true", help="one JSON line per config")


@dataclass(frozen=True)
class Row:
    config: str
    per_stage: int  # one warp's stage
    per_8192: float  # per 8192 K/V elements
    alu_pipe: int
    mma: int
    shared_loads: int
    copies: int
    shortest: int
    longest: int
    stall_cycles: int  # ptxas's fixed stall cycles along the stage (kernels/sass.py)
    registers: int
    spills: int


def override(cfg, assignments: list[str]):
    """`cfg` with FIELD=VALUE assignments applied, each value parsed as the field's current type."""
    import dataclasses

    from zerodram.runtime.errors import ConfigError

    fields = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    for item in assignments:
        name, eq, text = item.partition("=")
        if not eq or name not in fields:
            raise ConfigError(f"--set {item!r}: want FIELD=VALUE with FIELD one of {sorted(fields)}")
        kind = type(getattr(cfg, name))
        changes[name] = text.lower() in ("1", "true") if kind is bool else kind(text)
    return dataclasses.replace(cfg, **changes)


def census_row(name: str, cfg, elements_per_stage: int):
    """(Row, steady-walk opcode counts) of one config's decode kernel."""
    from zerodram.kernels.jit import compile_cubin
    from zerodram.kernels.sass import COPY_OPS, census

    kernel = "attn_fp2_decode"
    k = census(compile_cubin(kernel, cfg.build_options(kernel)), kernel)
    loop = k.main_loop()
    row = Row(
        name, loop.per_iteration, round(loop.per_iteration * 8192 / elements_per_stage, 1), loop.count(ALU_PIPE),
        loop.count(MMA), loop.count(SHARED_LOADS), loop.count(COPY_OPS), loop.shortest, loop.longest,
        loop.stall_cycles, k.registers, k.local_memory_ops(),
    )
    return row, loop.steady


def run(args: argparse.Namespace) -> int:
    from zerodram.kernels.attention import TOKENS_PER_STAGE
    from zerodram.runtime.errors import ConfigError

    known = configs()
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in known]:
        raise ConfigError(f"unknown config(s) {unknown}; known: {list(known)}")
    results = [census_row(n, override(known[n], args.set), TOKENS_PER_STAGE * known[n].head_dim * 2) for n in names]
    if args.json:
        for row, _ in results:
            print(json.dumps({"bench": "sass_census", **asdict(row)}))
        return 0
    head = ("config", "/stage", "/8192", "ALU pipe", "MMA", "LDS", "copies", "shortest", "longest", "stalls", "regs",
            "spills")
    print(" ".join(f"{h:>9}" for h in head))
    for row, _ in results:
        print(" ".join(f"{v:>9}" for v in asdict(row).values()))
    print("static counts of the main loop's steady walk, one warp's stage (kernels/sass.py); not a time")
    if args.opcodes:
        for row, steady in results:
            print(f"\n{row.config}: " + ", ".join(f"{op} {n}" for op, n in steady.most_common()))
    return 0


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
