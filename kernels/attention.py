"""Launch wrappers of the FP2 decode-attention kernels (kernels/cuda/attn_fp2_*.cu).

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, S split slots,
NP pages, P page size, NBK / NBV scale blocks per token, HP bf16 tokens per sequence, N written tokens.

Each wrapper takes tensors that runtime/attention/ (decode.py, writer.py) has validated once, and launches on torch's
current stream without allocating or synchronising (CUDA-graph safe). Kernel specialisations are
compiled per `Fp2KernelConfig` and cached (kernels/jit.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from zerodram.kernels.jit import BuildOptions
from zerodram.kernels.kv_write import PendingAppend
from zerodram.kernels.module import allow_shared_memory, launch, load_module, num_sms, ptr

SCALE_FMTS = {"e4m3": 0, "e8m0": 1}
TOKENS_PER_STAGE = 32  # attn_fp2_decode's pipeline stage; split boundaries are multiples of it
HP_CHUNK = 64  # bf16 tokens the decode kernel's bf16 CTA stages at a time (kHpChunk)
TIMELINE_COLS = 12  # stamps per CTA of a timeline build (kTimelineCols, attn_fp2_decode.cu)


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
    # The decode kernel's register cap, passed to ptxas explicitly: without one (NVRTC / nvcc 13.0)
    # ptxas squeezed the kernel to ~117-128 registers by recomputing every lane's shared-memory
    # offsets each stage (674 instructions in the main loop against 564 with a cap of 255).
    max_registers: int = 255
    # ptxas's --register-usage-level (0..10, its default 5): how freely it may spend registers to
    # schedule. At 6..10 the device's NVRTC 13.0 gives the decode's main loop 159 registers (3 CTAs
    # per SM still fit) and a schedule with 829 fixed stall cycles a stage against 896 at 5, the same
    # 474 instructions and the same floating-point and MMA instructions in the whole kernel; measured
    # 2-3% faster at L = 128k (docs/benchmarks.md, 2026-12-05).
    register_usage: int = 8
    timeline: bool = False  # per-CTA %globaltimer stamps (benchmarks/attention_timeline.py); off: same SASS
    # attn_fp2_write: warps sharing one scale block's 33 MSE candidates (capped at 1024 threads a
    # CTA) where the grid is short (a decode append: a latency chain, one warp walking all 33 was
    # most of its time); a grid of more than two CTAs per SM (a prefill chunk, a tail flush) is a
    # throughput job and runs one warp per block (H200: 4 warps made a 32-token flush at B = 8
    # 27.4 us against 18.1).
    write_search_warps: int = 4

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
            "TIMELINE": int(self.timeline),
        }

    def split_key(self) -> str:
        """The decode build's name in measured split tables (runtime/attention/split_table.py):
        every define that shapes its work, and the register options (a timeline build times like
        the plain one, so it is left out)."""
        d = self.defines()
        del d["TIMELINE"]
        opts = f"r{self.max_registers}u{self.register_usage}"
        return "-".join(f"{k.lower()}{v}" for k, v in d.items()) + "-" + opts

    @classmethod
    def from_split_key(cls, key: str) -> Fp2KernelConfig:
        """The build a split table's key names (the inverse of `split_key`). Raises ValueError for a
        key this code does not make (an option renamed, added or dropped since it was measured)."""
        names = [k.lower() for k in cls().defines() if k != "TIMELINE"]  # split_key's order
        *parts, opts = key.split("-")
        values = [p[len(n) :] for n, p in zip(names, parts, strict=False) if p.startswith(n)]
        m = re.fullmatch(r"r(\d+)u(\d+)", opts)
        if len(parts) != len(names) or len(values) != len(names) or not all(map(str.isdigit, values)) or not m:
            raise ValueError(f"split key {key!r} names no build of Fp2KernelConfig: it needs {names} and r<N>u<N>")
        v = dict(zip(names, map(int, values), strict=True))
        fmt = {i: k for k, i in SCALE_FMTS.items()}.get(v.pop("scale_fmt"))
        if fmt is None:
            raise ValueError(f"split key {key!r}: scale_fmt is none of {SCALE_FMTS}")
        cfg = cls(
            **v | {"key_s8": bool(v["key_s8"]), "v_quad": bool(v["v_quad"])}, scale_dtype=fmt,
            max_registers=int(m.group(1)), register_usage=int(m.group(2)),
        )  # fmt: skip
        if cfg.split_key() != key:  # a flag written as 2, say
            raise ValueError(f"split key {key!r} names no build of Fp2KernelConfig (read back: {cfg.split_key()!r})")
        return cfg

    @property
    def write_warps_per_block(self) -> int:
        """attn_fp2_write's search warps per scale block: `write_search_warps`, as many as fit in
        1024 threads beside the token's blocks at the smaller block size."""
        return max(1, min(self.write_search_warps, 32 // (self.head_dim // min(self.k_block, self.v_block))))

    def build_options(self, kernel: str, search_warps: int | None = None) -> BuildOptions:
        """search_warps: attn_fp2_write's SEARCH_WARPS (default `write_warps_per_block`)."""
        keep = {
            "attn_fp2_decode": self.defines().keys(),
            "attn_fp2_write": ("HEAD_DIM", "K_BLOCK", "V_BLOCK", "SCALE_FMT", "V_QUAD", "SEARCH_WARPS"),
        }[kernel]
        d = self.defines() | {"SEARCH_WARPS": search_warps or self.write_warps_per_block}
        extra = ("-lineinfo",)
        if kernel == "attn_fp2_decode":
            extra += (f"-maxrregcount={self.max_registers}", f"-Xptxas=--register-usage-level={self.register_usage}")
        return BuildOptions.make(arch="sm_90", defines={k: d[k] for k in keep}, extra=extra)

    @property
    def decode_smem_bytes(self) -> int:
        """Dynamic shared memory of attn_fp2_decode: the warps' stage rings, reused for the combine,
        by the bf16 CTA (attn_fp2_decode_merge.cuh, kHpSmemFloats) and by the merge (its weights,
        `merge_smem_bytes`, checked per launch)."""
        d, g = self.head_dim, self.group
        stage = 2 * TOKENS_PER_STAGE * d // 4 + TOKENS_PER_STAGE * (d // self.k_block + d // self.v_block)
        ring = self.num_warps * self.stages * stage
        combine = 4 * self.num_warps * 8 * (d + 2)
        bf16 = 4 * (g * d + g * HP_CHUNK + ((3 * g + 3) & ~3) + HP_CHUNK * d)  # kHpSmemFloats
        return max(ring, combine, bf16)

    def merge_smem_bytes(self, max_splits: int) -> int:
        """Shared memory the last CTA of a row merges in: per head and partial (at most max_splits
        of them: the FP2 splits and the bf16 slot) its m, then weight, and its l; 1 / l per head."""
        return 4 * self.group * (2 * max_splits + 1)

    def merge_all_early_bytes(self, num_partials: int) -> int:
        """Shared memory in which the merge holds every one of a row's `num_partials` partial outputs
        early: `merge_smem_bytes` rounded up to 16 bytes, then [num_partials, G, D] fp32
        (attn_fp2_decode_merge.cuh's `early_at` and `n_early`)."""
        return -(-self.merge_smem_bytes(num_partials) // 16) * 16 + 4 * num_partials * self.group * self.head_dim


SMALL_GRID_SMEM = 100 * 1024  # the most dynamic shared memory a decode launch of <= 2 CTAs an SM takes


class Fp2Kernels:
    """The compiled kernels of one config, loaded on the current CUDA device."""

    def __init__(self, cfg: Fp2KernelConfig) -> None:
        self.cfg = cfg
        if cfg.decode_smem_bytes > 48 * 1024:
            raise ValueError(
                f"decode needs {cfg.decode_smem_bytes} B of shared memory; keep num_warps * stages "
                "within 48 KB (what every launch must get; only grids of <= 2 CTAs an SM get more)"
            )

    @cached_property
    def _decode(self):
        k = load_module("attn_fp2_decode", self.cfg.build_options("attn_fp2_decode")).kernel("attn_fp2_decode")
        allow_shared_memory(k, SMALL_GRID_SMEM)
        return k

    def _most_smem_keeping(self, ctas: int, top: int) -> int:
        """The most dynamic shared memory, from `top` down in 1 KB steps, that still keeps `ctas`
        decode CTAs on an SM (the driver's occupancy); `decode_smem_bytes` where none does."""
        occ, threads, need = self._decode.occupancy, 32 * self.cfg.num_warps, self.cfg.decode_smem_bytes
        for smem in range(top, need, -1024):
            if occ.max_active_blocks_per_multiprocessor(threads, smem) >= ctas:
                return smem
        return need

    @cached_property
    def two_cta_smem(self) -> int:
        """The most dynamic shared memory, up to SMALL_GRID_SMEM, that still keeps two decode CTAs on
        an SM: what a grid of at most two CTAs an SM may give its merges (`decode`)."""
        return self._most_smem_keeping(2, SMALL_GRID_SMEM)

    @cached_property
    def _write(self):  # {search warps per block: kernel}: the short-grid build and the one-warp build
        return {
            cw: load_module("attn_fp2_write", self.cfg.build_options("attn_fp2_write", cw)).kernel("attn_fp2_write")
            for cw in sorted({self.cfg.write_warps_per_block, 1})
        }

    @cached_property
    def _num_sms(self) -> int:
        return num_sms(torch.cuda.current_device())

    def load(self) -> None:
        """Compile and load every kernel now (not inside a CUDA-graph capture)."""
        _ = self._decode, self._write, self._num_sms, self.decode_launch_smem, self.two_cta_smem

    def decode_ctas_per_sm(self) -> int:
        """How many decode CTAs one SM holds at once (registers and shared memory), from the driver."""
        occ = self._decode.occupancy
        return int(
            occ.max_active_blocks_per_multiprocessor(32 * self.cfg.num_warps, self.cfg.decode_smem_bytes)
        )

    @cached_property
    def decode_launch_smem(self) -> int:
        """Dynamic shared memory every decode launch gets at least: the most within the default cap
        (48 KB less the kernel's static shared memory) that still keeps `decode_ctas_per_sm()` CTAs
        on an SM; grids of at most two CTAs an SM may get more (`two_cta_smem`). The kernel needs
        `decode_smem_bytes`; the merge copies as many partials as the rest holds into it beside its
        (m, l) round trip (attn_fp2_decode_merge.cuh), a round trip fewer per 16 partials past the
        ring's share at B = 1, where the merge is on the critical path (docs/fp2-kernel.md)."""
        top = 48 * 1024 - self._decode.attributes.shared_size_bytes  # `_decode` raised the cap past it
        return self._most_smem_keeping(self.decode_ctas_per_sm(), top)

    def decode(
        self,
        q: torch.Tensor,  # [B, Hq, D] fp32, stored key space
        q_scale: float,  # softmax_scale * log2(e)
        k_codes: torch.Tensor,  # [NP, Hkv, P, D/16] int32, dense, NP * Hkv * P < 2^32
        k_scales: torch.Tensor,  # [NP, Hkv, P, NBK] uint8, dense
        v_codes: torch.Tensor,
        v_scales: torch.Tensor,
        levels: torch.Tensor,  # [8] fp32
        block_table: torch.Tensor,  # [B, max_pages] int32
        fp2_len: torch.Tensor,  # [B] int32: sequence b attends its FP2 tokens [0, fp2_len[b])
        split_tokens: int,
        num_splits: int,
        o_part: torch.Tensor,  # [B, Hq, S, D] fp32 workspace, S > num_splits (slot num_splits: bf16 tokens)
        ml_part: torch.Tensor,  # [B, Hq, S, 2] fp32 workspace
        hp_k: torch.Tensor,  # [num_slots, Hkv, HP, D] bf16, row hp_slot[b] for sequence b
        hp_v: torch.Tensor,
        hp_len: torch.Tensor,  # [B] int32
        hp_slot: torch.Tensor,  # [B] int32 row of hp_k / hp_v
        row_done: torch.Tensor,  # [>= B * Hkv] int32, zero between launches (the kernel resets it)
        out: torch.Tensor,  # [B, Hq, D] fp32, normalised
        timeline: torch.Tensor | None = None,  # [>= grid, TIMELINE_COLS] int64: with cfg.timeline, the CTAs' stamps
        pending: PendingAppend | None = None,  # the step's write, made after this call: its tokens
    ) -> None:
        B, Hkv = q.shape[0], k_codes.shape[1]
        S = o_part.shape[2]
        smem = max(self.decode_launch_smem, self.cfg.merge_smem_bytes(S))
        if num_splits >= S or smem > 48 * 1024:
            raise ValueError(f"{num_splits} splits need {num_splits + 1} workspace slots and {smem} B of shared memory; have {S}, 48 KB")
        grid = (num_splits + 1) * Hkv * B
        if grid <= 2 * self._num_sms:
            # A grid of at most two CTAs an SM (B = 1 at long contexts) gives each merge room for all of
            # its row's partials, so none waits for a round trip after the (m, l) one: about 1 us of
            # 41 at B = 1, L = 128k, 32 splits on the H100 (docs/fp2-kernel.md, "Every partial early").
            smem = max(smem, min(self.cfg.merge_all_early_bytes(num_splits + 1), self.two_cta_smem))
        if self.cfg.timeline and (timeline is None or timeline.shape[0] < grid):
            raise ValueError(f"a timeline build needs a [{grid}, {TIMELINE_COLS}] int64 timeline buffer")
        args = (
            # dense pools of fewer than 2^32 token rows (Fp2DecodeAttention.check): no strides
            ptr(q), np.float32(q_scale), ptr(k_codes), ptr(k_scales), ptr(v_codes), ptr(v_scales), ptr(levels),
            ptr(block_table), np.int32(block_table.stride(0)), np.int32(k_codes.shape[2]),
            ptr(fp2_len), np.int32(split_tokens), np.int32(num_splits), np.int32(Hkv), np.int32(S),
            ptr(o_part), ptr(ml_part),
            ptr(hp_k), ptr(hp_v), ptr(hp_len), ptr(hp_slot), np.int64(hp_k.stride(0)), np.int64(hp_k.stride(1)),
            np.int32(hp_k.shape[2]), ptr(row_done), ptr(out),
            ptr(timeline) if timeline is not None else np.uint64(0),
            *(pending.args if pending is not None else PendingAppend.NONE),
        )  # fmt: skip
        launch(
            # one dimension, the splits first (attn_fp2_decode.cu): the bf16 CTAs take what is left
            self._decode, grid=(grid,), block=(32 * self.cfg.num_warps,), args=args,
            shared_mem=smem,
        )  # fmt: skip

    def write(
        self,
        y: torch.Tensor,  # [N, Hkv, 2, D] fp32 stored-space K (0) and V (1)
        seq_idx: torch.Tensor,  # [N] int32
        fp2_idx: torch.Tensor,  # [N] int32
        # [B, max_pages] int32, contiguous (row seq_idx[i] at stride(0)). Its page ids, seq_idx and
        # fp2_idx are trusted: checking them would sync (Fp2Writer checks them on its CPU path only)
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
        cw = self.cfg.write_warps_per_block if N * Hkv * 2 <= 2 * self._num_sms else 1  # write_search_warps
        launch(self._write[cw], grid=(N, Hkv, 2), block=(32 * nb * cw,), args=args)
