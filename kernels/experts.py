"""Launch wrapper of the decode-sized SwiGLU expert kernels (kernels/cuda/moe_experts.cu).

Shape legend: N packed rows (expert-major), D hidden, F expert FFN dim, El local experts.

`swiglu_experts_cuda(x, ends, w_gate, w_up, w_down)` computes, for every local expert e and its rows
x[ends[e-1]:ends[e]], down(silu(gate(x)) * up(x)) in two launches (gate+up fused with the SwiGLU,
then down) that read each active expert's weights once. It validates its inputs once, allocates the
[N, F] intermediate and the [N, D] output, and launches on torch's current stream without a host
sync (capturable in a CUDA graph). Call `load_experts_kernels` before a capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions
from zerodram.kernels.module import launch, load_module, ptr
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
class ExpertsConfig:
    """The two kernels' shapes (from a sweep on the H200, docs/benchmarks.md "Experts")."""

    gate_up: KernelShape = KernelShape(4, 1, 8)
    down: KernelShape = KernelShape(4, 2, 8)

    @staticmethod
    def parse(text: str) -> ExpertsConfig:
        """'GATE_UP/DOWN', each 'ROW_TILESxKSPLITxUNROLL', e.g. '8x1x4/4x2x4'."""
        gate_up, down = text.split("/")
        return ExpertsConfig(KernelShape.parse(gate_up), KernelShape.parse(down))

    def __str__(self) -> str:
        return f"{self.gate_up}/{self.down}"


DEFAULT_CONFIG = ExpertsConfig()


def experts_build_options(shape: KernelShape = DEFAULT_CONFIG.gate_up) -> BuildOptions:
    defines = {
        "ROW_TILES": shape.row_tiles,
        "KSPLIT": shape.ksplit,
        "NG": TOKENS_PER_PASS // 8,
        "UNROLL": shape.unroll,
    }
    return BuildOptions.make(arch="sm_90", defines=defines, extra=("-lineinfo",))


def supports_shapes(hidden: int, ffn: int) -> bool:
    """Whether the kernels take experts of this shape (both reduction dims positive multiples of 32)."""
    return hidden > 0 and ffn > 0 and hidden % 32 == 0 and ffn % 32 == 0


@cache
def _kernels(device_index: int, config: ExpertsConfig):
    gate_up = load_module("moe_experts", experts_build_options(config.gate_up)).kernel("experts_gate_up")
    return gate_up, load_module("moe_experts", experts_build_options(config.down)).kernel("experts_down")


def load_experts_kernels(
    device: torch.device | str | None = None, config: ExpertsConfig = DEFAULT_CONFIG
) -> None:
    """Compile and load the kernels on `device` now (not inside a graph capture)."""
    with torch.cuda.device(device):
        _kernels(torch.cuda.current_device(), config)


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
    gu, dn = config.gate_up, config.down
    with torch.cuda.device(x.device):
        gate_up, down = _kernels(x.device.index, config)
        launch(gate_up, grid=(-(-F_ // (16 * gu.row_tiles)), El), block=(2 * 32 * gu.row_tiles * gu.ksplit,),
               args=(ptr(x), ptr(ends), ptr(w_gate), ptr(w_up), ptr(h), np.int32(F_), np.int32(D)))  # fmt: skip
        launch(down, grid=(-(-D // (16 * dn.row_tiles)), El), block=(32 * dn.row_tiles * dn.ksplit,),
               args=(ptr(h), ptr(ends), ptr(w_down), ptr(y), np.int32(D), np.int32(F_)))  # fmt: skip
    return y
