"""Launch wrapper of the engine's FP2 decode write (kernels/cuda/fp2_decode_write.cu).

Shape legend: Bp padded batch rows, H KV heads, D head dim, R bf16 rows per sequence slot, P page
size, NB scale blocks per token, C candidate scales.

`Fp2DecodeWrite` is `Fp2KVCache.write_decode_static`'s body after the move to the stored space, in
one launch: the new token to its bf16 row and quantized into its own page row at arrival (scale
search, nearest or error-feedback codes, packing), the tail moved up where the row flushes. The
cache builds it once (`unsupported` says which formats it cannot take), checks its own tensors'
layouts when it sets them, and calls it with fixed-shape device tensors: no allocation, no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions
from zerodram.kernels.module import allow_shared_memory, launch, load_module, num_sms, ptr

SCALE_FMTS = {"e4m3": 0, "e8m0": 1}
RULES = ("absmax", "mse")
NUM_THREADS = 128  # the kernel's CTA
NUM_CAND = 33  # MSE candidates (runtime/kv/quantize.MSE_FRACTIONS; the cache checks they agree)


@dataclass(frozen=True)
class DecodeWriteConfig:
    """Compile-time shape: one cubin per distinct config."""

    head_dim: int
    k_block: int
    v_block: int
    scale_dtype: str
    v_quad: bool = False  # value pages in the quad layout (runtime/kv/pack.py)
    feedback_block: int = 0  # the format's feedback blocks (`fbblk`; 0: the whole head): chains side by side

    @property
    def factor_smem_bytes(self) -> int:
        """Dynamic shared memory for the head's feedback factor [D, D] fp32 where the staged build
        can hold it whole (64 KB at most: D <= 128); 0: only the build that reads it through L2."""
        factor = 4 * self.head_dim * self.head_dim
        return factor if factor <= 64 * 1024 else 0

    def build_options(self, staged: bool) -> BuildOptions:
        """staged: the build that copies the factor into shared memory (`STAGE_ROWS`)."""
        defines = {
            "HEAD_DIM": self.head_dim, "K_BLOCK": self.k_block, "V_BLOCK": self.v_block,
            "SCALE_FMT": SCALE_FMTS[self.scale_dtype], "NUM_CAND": NUM_CAND, "V_QUAD": int(self.v_quad),
            "STAGE_ROWS": int(staged), "FB_BLOCK": self.feedback_block,
        }  # fmt: skip
        return BuildOptions.make(arch="sm_90", defines=defines, extra=("-lineinfo",))


def unsupported(
    head_dim: int, blocks: tuple[int, int], scale_dtypes: tuple[str, str], rules: tuple[str, str],
    feedback_block: int = 0,
) -> str | None:
    """Why the kernel cannot write this format (None: it can). Channel blocks, symmetric scales
    and no outliers are the caller's to check (the static write requires them anyway).
    feedback_block: the feedback blocks of the sides with feedback (one value for both; 0: the
    whole head)."""
    if head_dim % 32 or head_dim > 256:
        return f"head dim {head_dim} (the kernel takes multiples of 32 up to 256)"
    if any(b % 32 or head_dim % b for b in blocks):
        return f"channel blocks {blocks} (multiples of 32 dividing the head dim)"
    if scale_dtypes[0] != scale_dtypes[1] or scale_dtypes[0] not in SCALE_FMTS:
        return f"scale dtypes {scale_dtypes} (both e4m3 or both e8m0)"
    if any(r not in RULES for r in rules):
        return f"scale rules {rules} (absmax or mse)"
    fb, step = feedback_block, math.lcm(head_dim // 32, 8)  # fp2_write_row.cuh CHAIN_STEP
    if fb and (fb >= head_dim or head_dim % fb or fb % step or any(b % fb for b in blocks)):
        return (f"feedback blocks of {fb} channels (the kernel takes blocks smaller than the head dim {head_dim} "
                f"and dividing it, whole chain steps of {step} channels, inside the scale blocks {blocks})")
    return None


@dataclass(frozen=True)
class PendingAppend:
    """A decode write made after the decode that attends its tokens instead of before it: `args`
    in the order of attn_fp2_decode's new_* parameters (the step's new tokens, read by the rows'
    bf16 CTAs from here instead of from their regions; the index, whose flush row tells them which
    tail row the write will drop; the sinks), `rows` the batch rows (the decode's B), `write` the
    launch of the write itself on the current stream (`write_after`). `keep` holds the tensors
    behind the raw pointers that nothing else holds (the stored-space tokens): freed before the
    launches, their memory would go to the next allocation on the stream, or inside a graph capture
    to a later node's, and the kernels would read that instead."""

    args: tuple
    rows: int
    targets: tuple = ()  # the write's bf16 regions (hp_k, hp_v), as raw pointers
    keep: tuple = ()
    write: Callable[[], None] | None = None
    NONE: ClassVar[tuple] = (np.uint64(0),) * 3 + (np.int32(0),)  # nothing pending (null tokens)

    def other_regions(self, hp_k: torch.Tensor, hp_v: torch.Tensor) -> list[str]:
        """Which of the regions a decode reads (hp_k, hp_v) this write does not write: a decode
        that attends a pending write's tokens beside another cache's tail would be silently wrong."""
        return [n for n, t, a in zip(("hp_k", "hp_v"), (hp_k, hp_v), self.targets, strict=True) if ptr(t) != a]

    def write_after(self, stream: torch.cuda.Stream) -> None:
        """The write on `stream`, after everything queued so far on the current stream (the decode
        that reads its tokens and the regions as they were). Nothing waits for it here: the caller
        joins `stream` back before anything reads the regions or pages it writes (inside a graph
        capture: before the capture ends)."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.write()
        for t in self.keep[:2]:  # the tokens, made on the current stream, are read on `stream` too
            t.record_stream(stream)


class Fp2DecodeWrite:
    """The compiled kernel of one config, loaded on `device` at construction (never in a capture).

    Two builds where the factor fits in shared memory: the staged one for short grids (a launch's
    time is one CTA's latency there, and the factor from shared memory shortens the chain), the
    L2 one beyond `max_staged_ctas` (2 per SM: a measured threshold, not a residency limit),
    where 64 KB CTAs take more waves than the L2 build's (H100: 33.7 against 21.4 us at B = 32,
    14.8 against 15.8 at B = 8; docs/benchmarks.md). The choice depends on the grid and on
    whether a factor is given, both fixed for a captured graph."""

    def __init__(
        self, cfg: DecodeWriteConfig, rules: tuple[str, str], fracs: torch.Tensor, device: torch.device
    ) -> None:
        """fracs: the MSE candidates' fractions of absmax / max|L| (NUM_CAND of them, compiled in)."""
        if fracs.numel() != NUM_CAND:
            raise ValueError(f"the decode-write kernel takes {NUM_CAND} MSE candidates, not {fracs.numel()}")
        self.cfg = cfg
        self.rules = int(rules[0] == "mse") | (int(rules[1] == "mse") << 1)
        self.fracs = fracs.float().contiguous().to(device)  # [C]
        self.device = device
        with torch.cuda.device(device):
            self._kernel = load_module("fp2_decode_write", cfg.build_options(False)).kernel("fp2_decode_write")
            self._staged = None
            self.max_staged_ctas = 0  # CTAs (Bp * H * 2) up to which the staged build runs
            if cfg.factor_smem_bytes:
                self._staged = load_module("fp2_decode_write", cfg.build_options(True)).kernel("fp2_decode_write")
                if cfg.factor_smem_bytes > 48 * 1024:
                    allow_shared_memory(self._staged, cfg.factor_smem_bytes)
                self.max_staged_ctas = 2 * num_sms(torch.cuda.current_device())

    def __call__(
        self,
        yk: torch.Tensor,  # [Bp, H, D] bf16, stored space
        yv: torch.Tensor,
        index: torch.Tensor,  # [5, Bp] int64: slot, row, flush, page, page row
        hp_k: torch.Tensor,  # [slots + 1, H, R, D] bf16
        hp_v: torch.Tensor,
        k_codes: torch.Tensor,  # [pages + 1, H, P, D / 16] int32
        v_codes: torch.Tensor,
        k_scales: torch.Tensor,  # [pages + 1, H, P, NB] uint8
        v_scales: torch.Tensor,
        k_levels: torch.Tensor,  # [4] fp32
        v_levels: torch.Tensor,
        k_rows: torch.Tensor | None,  # [H, D, D] fp32: feedback factor over its diagonal, or None
        v_rows: torch.Tensor | None,
        num_sinks: int,
        window: int,
    ) -> None:
        args = self._args(yk, yv, index, hp_k, hp_v, k_codes, v_codes, k_scales, v_scales, k_levels, v_levels,
                          k_rows, v_rows, num_sinks, window)  # fmt: skip
        self._launch(args, yk.shape[0], yk.shape[1], k_rows is not None or v_rows is not None)

    def _launch(self, args: tuple, Bp: int, H: int, factor: bool) -> None:
        if Bp:
            staged = factor and Bp * H * 2 <= self.max_staged_ctas
            kernel, smem = (self._staged, self.cfg.factor_smem_bytes) if staged else (self._kernel, 0)
            with torch.cuda.device(self.device):
                launch(kernel, grid=(Bp, H, 2), block=(NUM_THREADS,), args=args, shared_mem=smem)

    def pending(self, yk, yv, index, hp_k, hp_v, k_codes, v_codes, k_scales, v_scales, k_levels, v_levels,
                k_rows, v_rows, num_sinks: int, window: int) -> PendingAppend:  # fmt: skip
        """The same write (`__call__`'s arguments), not launched: for a decode to attend its tokens
        first and the caller to launch it after (`PendingAppend.write_after`)."""
        a = self._args(yk, yv, index, hp_k, hp_v, k_codes, v_codes, k_scales, v_scales, k_levels, v_levels,
                       k_rows, v_rows, num_sinks, window)  # fmt: skip
        Bp, H = yk.shape[:2]
        return PendingAppend(
            args=(a[0], a[1], a[2], a[16]), rows=Bp, targets=(a[3], a[4]), keep=(yk, yv, index),
            write=partial(self._launch, a, Bp, H, k_rows is not None or v_rows is not None),
        )  # fmt: skip

    def _args(self, yk, yv, index, hp_k, hp_v, k_codes, v_codes, k_scales, v_scales, k_levels, v_levels,
              k_rows, v_rows, num_sinks: int, window: int) -> tuple:  # fmt: skip
        # The per-call inputs; the cache's own tensors were checked when it set them. Bp is the
        # grid and the stride between index rows: a mismatch would write through wrong rows.
        Bp, H, D = yk.shape
        for name, t, dtype, shape in (
            ("yk", yk, torch.bfloat16, (Bp, H, D)), ("yv", yv, torch.bfloat16, (Bp, H, D)),
            ("index", index, torch.int64, (5, Bp)),
        ):  # fmt: skip
            if (
                tuple(t.shape) != shape
                or t.dtype != dtype
                or not t.is_contiguous()
                or t.device != self.device
            ):
                raise ValueError(f"{name} must be contiguous {dtype} {list(shape)} on {self.device}, got "
                                 f"{t.dtype} {list(t.shape)} on {t.device}")  # fmt: skip
        opt = lambda t: np.uint64(0) if t is None else ptr(t)  # noqa: E731
        return (
            ptr(yk), ptr(yv), ptr(index), ptr(hp_k), ptr(hp_v), np.int32(hp_k.shape[2]),
            ptr(k_codes), ptr(v_codes), ptr(k_scales), ptr(v_scales), np.int32(k_codes.shape[2]),
            ptr(k_levels), ptr(v_levels), ptr(self.fracs), opt(k_rows), opt(v_rows),
            np.int32(num_sinks), np.int32(window), np.int32(self.rules),
        )  # fmt: skip
