"""The decode kernel's main loop as ptxas compiled it: instructions per stage, without a GPU.

    python benchmarks/sass_census.py [--json] [--configs default,fp16keys,token] [--opcodes] [--walk]
                                     [--set FIELD=VALUE ...] [--nvrtc LIBDIR]
    zerodram bench sass ...

Compiles `attn_fp2_decode` through the package's own JIT (NVRTC, the cubin that runs), and counts
the steady walk of its main loop with `zerodram.kernels.sass.census`: one iteration is one warp's
stage, so the count per 8192 K/V elements (32 tokens x D 128 x K and V) is the one Nsight Compute
measures per stage (docs/fp2-kernel.md, "Static counts", for how far the two agree). Columns: the
walk's instructions, those per 8192 K/V elements, the ALU pipe's share (LOP3, PRMT, SHF, I2FP,
FMNMX, F2FP: one warp instruction per two cycles, docs/fp2-kernel.md, "Issue costs"), MMAs,
shared-memory loads, copies, the shortest and longest walks round the loop, ptxas's fixed stall
cycles along the stage (the schedule, not only the count), registers and spilled loads and stores.
`--walk` lists the steady walk itself, instruction by instruction, to read what a stage spends.
A count, not a time: a change that lowers it still needs `bench attention` on a GPU, and the first
config is the baseline the others are read against. `--nvrtc` counts what another NVRTC builds:
the H200's 13.0 builds other code than newer ones (docs/fp2-kernel.md, "The schedule, not only the
count").
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from zerodram.kernels.sass import MMA_OPS as MMA

ALU_PIPE = ("LOP3", "PRMT", "SHF", "I2FP", "FMNMX", "F2FP")  # measured at half the issue rate
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
    p.add_argument("--walk", action="store_true", help="also each config's steady walk, instruction by instruction")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an Fp2KernelConfig field in every config (max_registers=168, stages=5)")
    p.add_argument("--nvrtc", metavar="LIBDIR",
                   help="compile with the NVRTC in LIBDIR (libnvrtc.so.13 and its builtins) instead of the one the "
                        "package finds: count what another machine's NVRTC builds (the H200's is 13.0: "
                        "pip download --no-deps nvidia-cuda-nvrtc==13.0.88, unpack, LIBDIR = nvidia/cu13/lib)")
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
    """(Row, the main loop) of one config's decode kernel."""
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
    return row, loop


def load_nvrtc(libdir: str) -> str:
    """Load LIBDIR's NVRTC before cuda.bindings loads its own, so that every compile of this process
    uses it (the JIT's cache key carries NVRTC's version); its version as "13.0"."""
    import ctypes
    import os
    import sys
    from pathlib import Path

    from zerodram.runtime.errors import ConfigError

    if "cuda.bindings.nvrtc" in sys.modules:
        raise ConfigError("--nvrtc: NVRTC is already loaded in this process")
    d = Path(libdir)
    builtins, lib = sorted(d.glob("libnvrtc-builtins.so.*")), d / "libnvrtc.so.13"
    if not builtins or not lib.is_file():
        raise ConfigError(f"--nvrtc {libdir}: want libnvrtc.so.13 and libnvrtc-builtins.so.* there")
    ctypes.CDLL(str(builtins[0]), mode=os.RTLD_GLOBAL)  # libnvrtc finds its builtins by soname
    ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def run(args: argparse.Namespace) -> int:
    from zerodram.runtime.errors import ConfigError

    nvrtc = load_nvrtc(args.nvrtc) if args.nvrtc else None
    from zerodram.kernels.attention import TOKENS_PER_STAGE

    known = configs()
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in known]:
        raise ConfigError(f"unknown config(s) {unknown}; known: {list(known)}")
    results = [census_row(n, override(known[n], args.set), TOKENS_PER_STAGE * known[n].head_dim * 2) for n in names]
    if args.json:
        for row, _ in results:
            print(json.dumps({"bench": "sass_census", **asdict(row), **({"nvrtc": nvrtc} if nvrtc else {})}))
        return 0
    head = ("config", "/stage", "/8192", "ALU pipe", "MMA", "LDS", "copies", "shortest", "longest", "stalls", "regs",
            "spills")
    print(" ".join(f"{h:>9}" for h in head))
    for row, _ in results:
        print(" ".join(f"{v:>9}" for v in asdict(row).values()))
    print("static counts of the main loop's steady walk, one warp's stage (kernels/sass.py); not a time"
          + (f"; NVRTC {nvrtc} from {args.nvrtc}" if nvrtc else ""))
    if args.opcodes:
        for row, loop in results:
            print(f"\n{row.config}: " + ", ".join(f"{op} {n}" for op, n in loop.steady.most_common()))
    if args.walk:
        for row, loop in results:
            print(f"\n{row.config}: the steady walk ({row.per_stage} instructions; stall cycles after each)")
            for i in loop.walk:
                print(f"  {i.addr:#06x}  {i.stall:>2}  {i.text}")
    return 0


if __name__ == "__main__":
    from zerodram.launch.bench_cmd import run_script

    sys.exit(run_script(__doc__, add_arguments, run))
