"""Launch wrappers of the FP2 decode-attention kernels (kernels/cuda/attn_fp2_*.cu).

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, S split slots,
NP pages, P page size, NBK / NBV scale blocks per token, HP bf16 tokens per sequence, N written tokens.

Each wrapper takes tensors that runtime/attention/ (decode.py, writer.py) has validated once, and launches on torch's
current stream without allocating or synchronising (CUDA-graph safe). Kernel specialisations are
compiled per `Fp2KernelConfig` and cached (kernels/jit.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions
from zerodram.kernels.module import launch, load_module, ptr

SCALE_FMTS = {"e4m3": 0, "e8m0": 1}
TOKENS_PER_STAGE = 32  # attn_fp2_decode's pipeline stage; split boundaries are multiples of it


@dataclass(frozen=True)
class Fp2KernelConfig:
    """Compile-time shape of the kernels: one cubin per distinct config."""

    head_dim: int = 128
    group: int = 4  # query heads per kv head
    k_block: int = 64
    v_block: int = 64
    scale_dtype: str = "e4m3"
    num_warps: int = 4
    stages: int = 4
    min_blocks: int = 1  # CTAs per SM the decode kernel's registers must allow (may spill)
    key_s8: bool = False  # keys through int8 MMAs (k_block >= 64); Fp2DecodeAttention picks it by default
    v_quad: bool = False  # value pages in the quad layout, value scales on P (v_block >= 16)

    def defines(self) -> dict[str, int]:
        return {
            "HEAD_DIM": self.head_dim,
            "GROUP": self.group,
            "K_BLOCK": self.k_block,
            "V_BLOCK": self.v_block,
            "SCALE_FMT": SCALE_FMTS[self.scale_dtype],
            "NUM_WARPS": self.num_warps,
            "STAGES": self.stages,
            "MIN_BLOCKS": self.min_blocks,
            "KEY_S8": int(self.key_s8),
            "V_QUAD": int(self.v_quad),
        }

    def build_options(self, kernel: str) -> BuildOptions:
        keep = {
            "attn_fp2_decode": self.defines().keys(),
            "attn_fp2_merge": ("HEAD_DIM", "GROUP"),
            "attn_fp2_write": ("HEAD_DIM", "K_BLOCK", "V_BLOCK", "SCALE_FMT", "V_QUAD"),
        }[kernel]
        d = self.defines()
        return BuildOptions.make(arch="sm_90", defines={k: d[k] for k in keep}, extra=("-lineinfo",))

    @property
    def decode_smem_bytes(self) -> int:
        """Dynamic shared memory of attn_fp2_decode: the warps' stage rings (reused for the combine)."""
        d = self.head_dim
        stage = 2 * TOKENS_PER_STAGE * d // 4 + TOKENS_PER_STAGE * (d // self.k_block + d // self.v_block)
        ring = self.num_warps * self.stages * stage
        combine = 4 * self.num_warps * 8 * (d + 2)
        return max(ring, combine)


class Fp2Kernels:
    """The compiled kernels of one config, loaded on the current CUDA device."""

    def __init__(self, cfg: Fp2KernelConfig) -> None:
        self.cfg = cfg
        if cfg.decode_smem_bytes > 48 * 1024:
            raise ValueError(
                f"decode needs {cfg.decode_smem_bytes} B of shared memory; keep num_warps * stages "
                "within 48 KB (the launch path does not raise the dynamic limit)"
            )

    @cached_property
    def _decode(self):
        return load_module("attn_fp2_decode", self.cfg.build_options("attn_fp2_decode")).kernel(
            "attn_fp2_decode"
        )

    @cached_property
    def _merge(self):
        return load_module("attn_fp2_merge", self.cfg.build_options("attn_fp2_merge")).kernel(
            "attn_fp2_merge"
        )

    @cached_property
    def _write(self):
        return load_module("attn_fp2_write", self.cfg.build_options("attn_fp2_write")).kernel(
            "attn_fp2_write"
        )

    def load(self) -> None:
        """Compile and load every kernel now (not inside a CUDA-graph capture)."""
        _ = self._decode, self._merge, self._write

    def decode_ctas_per_sm(self) -> int:
        """How many decode CTAs one SM holds at once (registers and shared memory), from the driver."""
        occ = self._decode.occupancy
        return int(
            occ.max_active_blocks_per_multiprocessor(32 * self.cfg.num_warps, self.cfg.decode_smem_bytes)
        )

    def decode(
        self,
        q: torch.Tensor,  # [B, Hq, D] fp16, pre-scaled
        k_codes: torch.Tensor,  # [NP, Hkv, P, D/16] int32
        k_scales: torch.Tensor,  # [NP, Hkv, P, NBK] uint8
        v_codes: torch.Tensor,
        v_scales: torch.Tensor,
        levels: torch.Tensor,  # [8] fp32
        block_table: torch.Tensor,  # [B, max_pages] int32
        fp2_lo: torch.Tensor,  # [B] int32
        fp2_hi: torch.Tensor,  # [B] int32
        split_tokens: int,
        num_splits: int,
        o_part: torch.Tensor,  # [B, Hq, S, D] fp32
        ml_part: torch.Tensor,  # [B, Hq, S, 2] fp32
    ) -> None:
        B, Hkv, P = q.shape[0], k_codes.shape[1], k_codes.shape[2]
        args = (
            # dense pools of fewer than 2^32 token rows (Fp2DecodeAttention.check): no strides
            ptr(q), ptr(k_codes), ptr(k_scales), ptr(v_codes), ptr(v_scales), ptr(levels), ptr(block_table), np.int32(block_table.stride(0)), np.int32(P),
            ptr(fp2_lo), ptr(fp2_hi), np.int32(split_tokens), np.int32(o_part.shape[2]),
            ptr(o_part), ptr(ml_part),
        )  # fmt: skip
        launch(
            self._decode, grid=(num_splits, Hkv, B), block=(32 * self.cfg.num_warps,), args=args,
            shared_mem=self.cfg.decode_smem_bytes,
        )  # fmt: skip

    def merge(
        self,
        o_part: torch.Tensor,
        ml_part: torch.Tensor,
        fp2_lo: torch.Tensor,
        fp2_hi: torch.Tensor,
        split_tokens: int,
        num_splits: int,  # the decode launch's grid.x
        q: torch.Tensor,
        hp_k: torch.Tensor,  # [num_slots, Hkv, HP, D] bf16, row hp_slot[b] for sequence b
        hp_v: torch.Tensor,
        hp_len: torch.Tensor,  # [B] int32
        hp_slot: torch.Tensor,  # [B] int32 row of hp_k / hp_v
        out: torch.Tensor,  # [B, Hq, D] fp32
    ) -> None:
        B, Hkv, S = q.shape[0], hp_k.shape[1], o_part.shape[2]
        hp_max = hp_k.shape[2]
        floats = self.cfg.group * (S + hp_max) + self.cfg.group * self.cfg.head_dim + self.cfg.group
        smem = 4 * ((floats + 3) & ~3) + 2 * hp_max * self.cfg.head_dim  # + the staged bf16 keys
        if smem > 48 * 1024:
            raise ValueError(
                f"merge needs {smem} B of shared memory (splits {S}, bf16 tokens {hp_max}): over 48 KB"
            )
        args = (
            ptr(o_part), ptr(ml_part), ptr(fp2_lo), ptr(fp2_hi), np.int32(split_tokens),
            np.int32(num_splits), np.int32(S),
            ptr(q), ptr(hp_k), ptr(hp_v), ptr(hp_len), ptr(hp_slot),
            np.int64(hp_k.stride(0)), np.int64(hp_k.stride(1)), np.int32(hp_max), ptr(out),
        )  # fmt: skip
        grid = (Hkv, B, self.cfg.head_dim // 32)  # 32 output channels per CTA (attn_fp2_merge.cu)
        launch(self._merge, grid=grid, block=(128,), args=args, shared_mem=smem)

    def write(
        self,
        y: torch.Tensor,  # [N, Hkv, 2, D] fp32 stored-space K (0) and V (1)
        seq_idx: torch.Tensor,  # [N] int32
        fp2_idx: torch.Tensor,  # [N] int32
        block_table: torch.Tensor,
        k_codes: torch.Tensor,
        k_scales: torch.Tensor,
        v_codes: torch.Tensor,
        v_scales: torch.Tensor,
        levels: torch.Tensor,  # [8] fp32
        fracs: torch.Tensor,  # [33] fp32
        rules: int,
    ) -> None:
        N, Hkv = y.shape[0], y.shape[1]
        if N == 0:
            return
        nb = self.cfg.head_dim // min(self.cfg.k_block, self.cfg.v_block)
        args = (
            ptr(y), ptr(seq_idx), ptr(fp2_idx), ptr(block_table), np.int32(block_table.stride(0)),
            np.int32(k_codes.shape[2]), ptr(k_codes), ptr(k_scales), ptr(v_codes), ptr(v_scales),
            np.int64(k_codes.stride(0)), np.int64(k_codes.stride(1)),
            np.int64(k_scales.stride(0)), np.int64(k_scales.stride(1)),
            np.int64(v_scales.stride(0)), np.int64(v_scales.stride(1)),
            ptr(levels), ptr(fracs), np.int32(rules),
        )  # fmt: skip
        launch(self._write, grid=(N, Hkv, 2), block=(32 * nb,), args=args)
