"""Launch wrapper of the decode-sized SwiGLU expert kernels (kernels/cuda/moe_experts_bulk.cu and
kernels/cuda/moe_experts.cu).

Shape legend: N packed rows (expert-major), D hidden, F expert FFN dim, El local experts.

`swiglu_experts_cuda(x, ends, w_gate, w_up, w_down)` computes, for every local expert e and its rows
x[ends[e-1]:ends[e]], down(silu(gate(x)) * up(x)): gate+up fused with the SwiGLU, then down, each
read once per active expert. Two kernel kinds split the experts by their row count on the device:
the bulk kernels (weights staged by bulk copies, up to 16 rows, the decode case) and the register
kernels (32 rows a pass, more rows). Where a projection's reduction dim is at least
`ExpertsConfig.bulk_min_k` both kinds are launched and each skips the other's experts, so the split
needs no host sync; below it the register kernels take every expert. It validates its inputs once,
allocates the [N, F] intermediate and the [N, D] output, and launches on torch's current stream
without a host sync (capturable in a CUDA graph). The first call compiles the kernels; the engine's
graph captures run eager warm-ups first, so no capture compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions
from zerodram.kernels.module import allow_shared_memory, launch, load_module, ptr
from zerodram.runtime.errors import ConfigError

TOKENS_PER_PASS = 32  # 8 * NG: an expert with more rows re-reads its weights once per 32 rows


@dataclass(frozen=True)
class KernelShape:
    """Compile-time shape of one kernel: warps along the weight rows (16 rows each) and along K per
    CTA (gate+up CTAs have twice as many: one set per matrix), and the k32 steps whose loads a warp
    issues before their MMAs."""

    row_tiles: int
    ksplit: int
    unroll: int

    def __post_init__(self) -> None:
        # every module compiles both kernels: gate+up's block (2 * warps) and its shared partial sums
        # ((2 * ksplit - 1) * row_tiles * 2 KB, static, at most 48 KB) bound every shape
        if min(self.row_tiles, self.ksplit, self.unroll) < 1 or 2 * 32 * self.row_tiles * self.ksplit > 1024:
            raise ConfigError(f"kernel shape {self}: need positive sizes and 2 * 32 * row_tiles * ksplit <= 1024")
        if (2 * self.ksplit - 1) * self.row_tiles * 2048 > 48 * 1024:
            raise ConfigError(f"kernel shape {self}: (2 * ksplit - 1) * row_tiles * 2 KB of shared memory > 48 KB")

    @staticmethod
    def parse(text: str) -> KernelShape:
        """'ROW_TILESxKSPLITxUNROLL', e.g. '8x1x4'."""
        return KernelShape(*(int(v) for v in text.split("x")))

    def __str__(self) -> str:
        return f"{self.row_tiles}x{self.ksplit}x{self.unroll}"


@dataclass(frozen=True)
class BulkShape:
    """Compile-time shape of one kernel of moe_experts_bulk.cu: 16-row tiles per matrix per CTA,
    consumer warps (they split each chunk's K), reduction elements per stage, stages in flight, and
    token rows per pass (an expert with more rows re-reads its weights once per pass)."""

    m_tiles: int
    consumers: int
    chunk: int
    stages: int
    tokens: int = TOKENS_PER_PASS

    def __post_init__(self) -> None:
        if min(self.m_tiles, self.consumers, self.stages) < 1 or self.consumers > 31 or self.stages > 8:
            # 8 stages: the full and empty barriers (16 bytes a stage) fill the ring's 128-byte header
            raise ConfigError(
                f"bulk kernel shape {self}: need positive sizes, at most 31 consumer warps and 8 stages"
            )
        if self.chunk < 64 or self.chunk % 64 or self.tokens not in (8, 16, 24, 32):
            raise ConfigError(f"bulk kernel shape {self}: need a chunk that is a multiple of 64, tokens 8..32 by 8")
        if self.smem_bytes(2) > MAX_SHARED:
            raise ConfigError(f"bulk kernel shape {self}: {self.smem_bytes(2)} bytes of shared memory > {MAX_SHARED}")

    def smem_bytes(self, mats: int) -> int:
        """Dynamic shared memory of the kernel with `mats` weight matrices (the layout in the .cu):
        barriers, the ring of stages x (weight + token rows) x (2 chunk + 64 padding) bytes, the
        partial sums of one consumer warp."""
        rows = mats * self.m_tiles * 16 + self.tokens
        partials = 32 * mats * self.m_tiles * (self.tokens // 8) * 4 * 4  # one warp's at a time
        return 128 + self.stages * rows * (2 * self.chunk + 64) + partials

    @staticmethod
    def parse(text: str) -> BulkShape:
        """'MTILESxCONSUMERSxCHUNKxSTAGES[xTOKENS]', e.g. '1x4x256x3x16'."""
        return BulkShape(*(int(v) for v in text.split("x")))

    def __str__(self) -> str:
        return f"{self.m_tiles}x{self.consumers}x{self.chunk}x{self.stages}x{self.tokens}"


MAX_SHARED = 227 * 1024  # sm_90's dynamic shared memory per block


@dataclass(frozen=True)
class ExpertsConfig:
    """Which kernels run and their shapes (from sweeps on the H200, docs/benchmarks.md "Experts").
    `bulk`: moe_experts_bulk.cu's (gate+up, down) shapes, for experts with up to `bulk[0].tokens`
    rows, in a kernel whose reduction dim is at least `bulk_min_k` (a short K leaves a bulk CTA
    mostly filling and draining its ring); `regs`: moe_experts.cu's, for the rest. With one of them
    None the other takes every active expert (in passes of its tokens)."""

    bulk: tuple[BulkShape, BulkShape] | None = (BulkShape(1, 4, 512, 2, 16), BulkShape(1, 4, 512, 2, 16))
    regs: tuple[KernelShape, KernelShape] | None = (KernelShape(4, 1, 8), KernelShape(4, 2, 8))
    bulk_min_k: int = 4096

    def __post_init__(self) -> None:
        if self.bulk is None and self.regs is None:
            raise ConfigError("experts config: needs the bulk kernels, the register kernels, or both")
        if self.bulk is not None and self.bulk[0].tokens != self.bulk[1].tokens:
            raise ConfigError(f"experts config {self}: the two bulk kernels must take the same tokens per pass")

    def split(self, k_dim: int) -> tuple[int | None, int | None]:
        """For a kernel of reduction dim k_dim: (the bulk kernel's largest expert, or None: not launched;
        the register kernel's largest expert it leaves to the bulk one, or None: not launched)."""
        if self.bulk is None or (self.regs is not None and k_dim < self.bulk_min_k):
            return None, 0
        if self.regs is None:
            return 2**31 - 1, None
        return self.bulk[0].tokens, self.bulk[0].tokens

    @staticmethod
    def parse(text: str) -> ExpertsConfig:
        """'GATE_UP/DOWN' register kernels only (each 'ROW_TILESxKSPLITxUNROLL', e.g. '4x1x8/4x2x8');
        'bulk:GATE_UP/DOWN' bulk kernels only (each 'MTILESxCONSUMERSxCHUNKxSTAGESxTOKENS', e.g.
        'bulk:1x4x512x2x16/1x4x512x2x16'); 'bulk:GATE_UP/DOWN+GATE_UP/DOWN@MIN_K' both."""
        bulk = regs = None
        body, _, min_k = text.partition("@")
        if body.startswith("bulk:"):
            bulk_text, _, body = body.removeprefix("bulk:").partition("+")
            bulk = tuple(BulkShape.parse(t) for t in bulk_text.split("/"))
        if body:
            regs = tuple(KernelShape.parse(t) for t in body.split("/"))
        if any(pair is not None and len(pair) != 2 for pair in (bulk, regs)):
            raise ConfigError(f"experts config {text!r}: each kind takes two shapes, GATE_UP/DOWN")
        return ExpertsConfig(bulk, regs, int(min_k or ExpertsConfig.bulk_min_k))  # type: ignore[arg-type]

    def __str__(self) -> str:
        bulk = f"bulk:{self.bulk[0]}/{self.bulk[1]}" if self.bulk else ""
        regs = f"{self.regs[0]}/{self.regs[1]}" if self.regs else ""
        both = f"@{self.bulk_min_k}" if self.bulk and self.regs else ""  # the threshold splits only then
        return "+".join(t for t in (bulk, regs) if t) + both


DEFAULT_CONFIG = ExpertsConfig()


def experts_build_options(shape: KernelShape | BulkShape) -> BuildOptions:
    if isinstance(shape, BulkShape):
        defines = {"MT": shape.m_tiles, "CW": shape.consumers, "KC": shape.chunk, "STAGES": shape.stages}
        defines["NG"] = shape.tokens // 8
    else:
        defines = {"ROW_TILES": shape.row_tiles, "KSPLIT": shape.ksplit, "UNROLL": shape.unroll}
        defines["NG"] = TOKENS_PER_PASS // 8
    return BuildOptions.make(arch="sm_90", defines=defines, extra=("-lineinfo",))


def supports_shapes(hidden: int, ffn: int) -> bool:
    """Whether the kernels take experts of this shape (both reduction dims positive multiples of 32)."""
    return hidden > 0 and ffn > 0 and hidden % 32 == 0 and ffn % 32 == 0


@cache
def _kernels(device_index: int, config: ExpertsConfig) -> dict[str, object]:
    out = {}
    if config.regs is not None:
        for name, shape in zip(("experts_gate_up", "experts_down"), config.regs, strict=True):
            out[name] = load_module("moe_experts", experts_build_options(shape)).kernel(name)
    if config.bulk is not None:
        for mats, name, shape in zip((2, 1), ("experts_gate_up_bulk", "experts_down_bulk"), config.bulk, strict=True):
            out[name] = load_module("moe_experts_bulk", experts_build_options(shape)).kernel(name)
            allow_shared_memory(out[name], shape.smem_bytes(mats))
    return out


def swiglu_experts_cuda(
    x: torch.Tensor,
    ends: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    config: ExpertsConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """x [N, D] bf16 packed rows; ends [El] int32 cumulative row ends (on the device); w_gate, w_up
    [El, F, D] and w_down [El, D, F] bf16, contiguous, 16-byte aligned (ends: 4). Returns [N, D] bf16;
    rows past ends[-1] are unspecified.

    Raises:
        ConfigError: a tensor not on x's CUDA device, not bf16 / int32, not contiguous, or shapes that
            disagree (the message names the tensor and both shapes).
    """
    if x.device.type != "cuda":
        raise ConfigError(f"the expert kernels run on CUDA tensors, x is on {x.device}")
    N, D = x.shape
    El, F_ = w_gate.shape[0], w_gate.shape[1]
    want = {"w_gate": (El, F_, D), "w_up": (El, F_, D), "w_down": (El, D, F_), "ends": (El,)}
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down), ("ends", ends)):
        # rows are read 16 bytes at a time; ends one int32 at a time (a slice of a bigger buffer is fine)
        dtype, align = (torch.int32, 4) if name == "ends" else (torch.bfloat16, 16)
        if t.device != x.device or t.dtype != dtype or not t.is_contiguous() or t.data_ptr() % align:
            raise ConfigError(
                f"{name}: want a contiguous, {align}-byte aligned {dtype} tensor on {x.device}, got {t.dtype} on "
                f"{t.device} (contiguous={t.is_contiguous()}, address % {align} = {t.data_ptr() % align})"
            )
        if name in want and tuple(t.shape) != want[name]:
            raise ConfigError(
                f"{name} has shape {tuple(t.shape)}, x {tuple(x.shape)} and w_gate {tuple(w_gate.shape)} need {want[name]}"
            )
    if not supports_shapes(D, F_):
        raise ConfigError(
            f"the expert kernels need hidden and FFN dims that are multiples of 32, got {D} and {F_}"
        )
    h = torch.empty(N, F_, dtype=x.dtype, device=x.device)  # [N, F]
    y = torch.empty_like(x)  # [N, D]
    if N == 0 or El == 0:
        return y
    with torch.cuda.device(x.device):
        k = _kernels(x.device.index, config)
        for mats, (a, w0, w1, out, R, K) in ((2, (x, w_gate, w_up, h, F_, D)), (1, (h, w_down, w_down, y, D, F_))):
            args = (ptr(a), ptr(ends), ptr(w0)) + ((ptr(w1),) if mats == 2 else ()) + (ptr(out), np.int32(R), np.int32(K))
            bulk_max, regs_skip = config.split(K)  # the experts split by row count on the device
            if config.bulk is not None and bulk_max is not None:
                b = config.bulk[2 - mats]
                launch(k["experts_gate_up_bulk" if mats == 2 else "experts_down_bulk"],
                       grid=(-(-R // (16 * b.m_tiles)), El), block=(32 * (b.consumers + 1),),
                       args=(*args, np.int32(bulk_max)), shared_mem=b.smem_bytes(mats))  # fmt: skip
            # with at most regs_skip rows in all, every expert is the bulk kernel's: no launch of
            # CTAs that would all skip (~0.01 ms at seed-700b's sizes)
            if config.regs is not None and regs_skip is not None and regs_skip < N:
                r = config.regs[2 - mats]
                launch(k["experts_gate_up" if mats == 2 else "experts_down"],
                       grid=(-(-R // (16 * r.row_tiles)), El), block=(mats * 32 * r.row_tiles * r.ksplit,),
                       args=(*args, np.int32(regs_skip)))  # fmt: skip
    return y
