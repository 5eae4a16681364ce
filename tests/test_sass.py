"""kernels/sass.py: loops and walks of a hand-written listing whose counts are known by
construction, then the real decode kernel's cubin (NVRTC and nvdisasm run without a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_cli import load_script, run_bench

from zerodram.kernels.sass import SassError, census, census_text, registers

# One kernel, laid out as ptxas lays out a pipelined loop. Block sizes in instructions:
#   entry 2 | loop head 2 | copy 2 (skipped on the tail) | 1 | full stage 4 or partial stage 5 |
#   BRA.DIV 1 (-> a stub of 2 at the end, which jumps back) | inner loop 2 | outer latch 1 | exit 1
_LISTING = [
    "S2R R0, SR_TID.X", "ISETP.GE.AND P0, PT, R0, 0x20, PT",
    ".L_x_0:", "DEPBAR.LE SB0, 0x2", "@P0 BRA `(.L_x_1)",
    "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]", "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]",
    ".L_x_1:", "@P1 BRA `(.L_x_2)",
    "HMMA.16816.F32 R8, R12, R14, R8", "HMMA.16816.F32 R8, R12, R14, R8", "HMMA.16816.F32 R8, R12, R14, R8",
    "BRA `(.L_x_3)",
    ".L_x_2:", *["HMMA.16816.F32 R8, R12, R14, R8"] * 5,
    ".L_x_3:", "BRA.DIV UR4, `(.L_x_9)",
    ".L_x_4:", "FADD R1, R1, R2", "@P2 BRA `(.L_x_4)",
    "@P3 BRA `(.L_x_0)",
    "EXIT",
    ".L_x_9:", "WARPSYNC.ALL", "BRA `(.L_x_4)",
]


def _nvdisasm_text(kernel: str, body: list[str], stall=None) -> str:
    """nvdisasm -c's layout; with `stall` (instruction text -> cycles) also -hex's encoding lines,
    the stall count in bits 41-44 of the high word beside other control bits set."""
    out = [f"\t.section\t.text.{kernel},\"ax\",@progbits", f"{kernel}:", f".text.{kernel}:"]
    addr = 0
    for line in body:
        if line.startswith(".L_x_"):
            out.append(line)
            continue
        pred, _, rest = line.partition(" ") if line.startswith("@") else ("", "", line)
        if stall is None:
            out.append(f"        /*{addr:04x}*/ {pred:>18} {rest} ;")
        else:
            high = (0x3F << 46) | (1 << 45) | (stall(line) << 41) | 0x5C50  # no barriers, yield, stall
            out.append(f"        /*{addr:04x}*/ {pred:>18} {rest} ;   /* 0x0000001e44447237 */")
            out.append(f"                                           /* 0x{high:016x} */")
        addr += 0x10
    other = ["\t.section\t.text.other,\"ax\",@progbits", ".text.other:", "        /*0000*/ BRA `(.L_x_0) ;"]
    return "\n".join(out + other) + "\n"


def test_loops_and_walks_of_a_known_listing():
    k = census_text(_nvdisasm_text("k", _LISTING), "k")
    assert len(k.instrs) == 2 + 2 + 2 + 1 + 4 + 5 + 1 + 2 + 1 + 1 + 2  # the other kernel's line left out
    outer, inner = k.loops
    assert (outer.depth, inner.depth) == (0, 1)
    assert k.main_loop() is outer
    # steady: head, copy, branch, full stage, BRA.DIV, inner loop once, latch
    assert outer.per_iteration == 2 + 2 + 1 + 4 + 1 + 2 + 1
    assert outer.steady["LDGSTS.E.BYPASS.128"] == 2 and outer.steady["HMMA.16816.F32"] == 3
    assert outer.count(("HMMA",)) == 3 and outer.count(("LDGSTS", "DEPBAR")) == 3
    assert outer.shortest == 2 + 1 + 4 + 1 + 2 + 1  # no copy
    assert outer.longest == 2 + 2 + 1 + 5 + 1 + 2 + 2 + 1  # partial stage and the divergence stub
    assert inner.per_iteration == inner.shortest == inner.longest == 2
    assert k.indirect == ()
    # the walk itself, in order, as the listing wrote it
    assert len(outer.walk) == outer.per_iteration
    assert [i.text for i in outer.walk[:3]] == ["DEPBAR.LE SB0, 0x2", "@P0 BRA `(.L_x_1)", _LISTING[5]]
    assert outer.walk[-1].text == "@P3 BRA `(.L_x_0)"


def test_stall_cycles_are_summed_along_the_steady_walk():
    text = _nvdisasm_text("k", _LISTING, stall=lambda line: 7 if line.startswith("HMMA") else 3)
    k = census_text(text, "k")
    outer = k.main_loop()
    assert outer.stall_cycles == 3 * (outer.per_iteration - 3) + 7 * 3  # its 3 HMMA stall 7, the rest 3
    assert census_text(_nvdisasm_text("k", _LISTING), "k").main_loop().stall_cycles == 0  # no encoding


# A stage loop inside a loop over chunks of stages (attn_fp2_decode's pieces): the outer loop's walk
# takes the inner once, so both hold the same MMAs, and the inner one is the stage.
_PIECES = [
    "S2R R0, SR_TID.X",
    ".L_x_0:", "SHFL.IDX R5, R4, R0, 0x1f", "LDG.E R4, desc[UR4][R8.64]",
    ".L_x_1:", "DEPBAR.LE SB0, 0x2", "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64]",
    "HMMA.16816.F32 R8, R12, R14, R8", "HMMA.16816.F32 R8, R12, R14, R8", "@P1 BRA `(.L_x_1)",
    "@P2 BRA `(.L_x_0)",
    ".L_x_2:", *["FADD R1, R1, R2"] * 5, "@P3 BRA `(.L_x_2)",
    "EXIT",
]


def test_the_main_loop_is_the_innermost_of_those_with_the_most_mmas():
    k = census_text(_nvdisasm_text("k", _PIECES), "k")
    pieces, stage = sorted((lp for lp in k.loops if lp.count(("HMMA",))), key=lambda lp: lp.depth)
    assert (pieces.depth, stage.depth) == (0, 1)
    assert pieces.count(("HMMA",)) == stage.count(("HMMA",)) == 2
    assert k.main_loop() is stage and stage.per_iteration == 5
    # a longer loop without MMAs (6 instructions) is not the main loop
    assert max(lp.per_iteration for lp in k.loops if not lp.count(("HMMA",))) == 6


def test_a_missing_kernel_is_named():
    with pytest.raises(SassError, match="'nope'"):
        census_text(_nvdisasm_text("k", _LISTING), "nope")


@pytest.fixture(scope="module")
def decode_cubin() -> bytes:
    from zerodram.kernels.attention import Fp2KernelConfig
    from zerodram.kernels.jit import compile_cubin

    return compile_cubin("attn_fp2_decode", Fp2KernelConfig(key_s8=True, v_quad=True).build_options("attn_fp2_decode"))


def test_the_decode_kernels_main_loop(decode_cubin):
    """The committed kernel's stage, by the algorithm: 8 int8 score MMAs (two 16-token tiles x 4
    k32 steps of D 128; at G <= 4 the query's hi and lo terms share one MMA) and 16 fp16 value MMAs
    (two 16-token k steps x 8 tiles of 16 channels), a copy ahead, no spills. Compiler-independent
    facts only; the count itself is `bench sass`'s to report."""
    k = census(decode_cubin, "attn_fp2_decode")
    loop = k.main_loop()
    assert loop.count(("IMMA",)) == 8 and loop.count(("HMMA",)) == 16
    assert loop.count(("LDGSTS",)) > 0
    assert loop.shortest <= loop.per_iteration <= loop.longest
    assert loop.per_iteration <= loop.stall_cycles <= 15 * loop.per_iteration  # each stalls 1..15
    # three CTAs of 128 threads per SM (the split plan's slots): Fp2KernelConfig.register_usage lets
    # ptxas spend registers on its schedule, but not past that cliff
    assert 64 <= k.registers <= 168 and k.local_memory_ops() == 0


def test_registers_refuses_what_is_not_there(decode_cubin):
    with pytest.raises(SassError, match="no kernel 'nope'"):
        registers(decode_cubin, "nope")
    with pytest.raises(SassError, match="ELF"):
        registers(b"not a cubin", "attn_fp2_decode")


def test_bench_sass_prints_a_json_line_per_config():
    run = run_bench(["sass", "--json", "--configs", "default,token"])
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["config"] for r in rows] == ["default", "token"]
    assert all(r["bench"] == "sass_census" and r["per_8192"] == r["per_stage"] for r in rows)


def test_bench_sass_lists_the_steady_walk():
    run = run_bench(["sass", "--configs", "default", "--walk"])
    assert run.returncode == 0, run.stderr
    per_stage = int(run.stdout.splitlines()[1].split()[1])
    listed = run.stdout.split("the steady walk", 1)[1].splitlines()[1:]
    assert len(listed) == per_stage and any("IMMA" in line for line in listed)


def test_bench_sass_names_an_unknown_config():
    run = run_bench(["sass", "--configs", "default,nope"])
    assert run.returncode != 0 and "nope" in run.stderr


def test_bench_sass_counts_with_another_nvrtc(tmp_path):
    """--nvrtc LIBDIR: the package's own NVRTC folder loads and is named; a folder without one is refused."""
    import cuda.pathfinder

    libdir = str(Path(cuda.pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path).parent)
    run = run_bench(["sass", "--json", "--configs", "default", "--nvrtc", libdir])
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["nvrtc"].count(".") == 1
    run = run_bench(["sass", "--configs", "default", "--nvrtc", str(tmp_path)])
    assert run.returncode != 0 and "libnvrtc.so.13" in run.stderr


def test_bench_sass_overrides_config_fields():
    from zerodram.kernels.attention import Fp2KernelConfig
    from zerodram.runtime.errors import ConfigError

    override = load_script("sass_census").override
    cfg = override(Fp2KernelConfig(key_s8=True), ["max_registers=168", "key_s8=0", "scale_dtype=e8m0"])
    assert (cfg.max_registers, cfg.key_s8, cfg.scale_dtype) == (168, False, "e8m0")
    for bad in ("nope=1", "stages"):
        with pytest.raises(ConfigError, match="FIELD=VALUE"):
            override(cfg, [bad])
