"""`Fp2DecodeAttention`: decode attention over FP2 pages plus bf16 sinks/tail, the CUDA kernels on a
GPU and the torch reference on CPU (chosen at construction); validation, the split plan and the
workspaces.

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, NP pages, P page
size, HP bf16 tokens per sequence, S split slots.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch

from zerodram.runtime.attention.inputs import DecodeBatch, Fp2Layer, expect_input, expect_layer
from zerodram.runtime.attention.reference import LOG2E, VALUE_PRODUCTS, int8_key_levels, reference_decode
from zerodram.runtime.attention.split_table import SplitTable, find_table
from zerodram.runtime.device import canonical_device
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.errors import KVInputError
from zerodram.runtime.kv.pack import CodeLayout

if TYPE_CHECKING:
    from zerodram.kernels.kv_write import PendingAppend


class Fp2DecodeAttention:
    """Decode attention (one query token per sequence) over FP2 pages plus bf16 sinks/tail.

    Args:
        num_q_heads, num_kv_heads, head_dim: the model's (G = Hq / Hkv in 1..8, D in {64, 128}).
        page_size: tokens per page (multiple of 32).
        k_block, v_block: channels per scale block; scale_dtype: 'e4m3' or 'e8m0'.
        max_batch, max_fp2_tokens: bounds that size the preallocated split workspace.
        device: a CUDA device runs the kernels, anything else the torch reference.
        softmax_scale: default head_dim ** -0.5.
        num_warps, stages, min_blocks: the decode kernel's launch shape (`Fp2KernelConfig`).
        key_s8: keys through int8 MMAs (docs/fp2-kernel.md, "Int8 keys"); None: wherever the format
            allows (k_block >= 64), else the fp16-key path.
        v_layout: the value pages' layout the module reads ("token" or "quad", see `Fp2Layer`);
            "quad" needs v_block >= 16.
        timeline: a measuring build whose CTAs stamp the GPU's clock at fixed points into
            `self.timeline` ([CTAs, TIMELINE_COLS] int64; benchmarks/attention_timeline.py reads it).
        value_product: how weights meet values (`VALUE_PRODUCTS` in reference.py): "exact", or
            "e4m3", what an FP8 value product would compute, on CPU only (no kernel yet).
        split_table: the measured split counts `plan` takes where they cover a step: "packaged"
            (the package's table for this GPU model and kernel build, if one exists; on CPU none),
            a `SplitTable`, or None (the wave model alone).
        workspace_splits: at least this many split slots in the workspace (a benchmark forcing
            counts beyond the plan's); default: the plan's most (`most_splits`).

    Raises:
        ConfigError: unsupported shape or format.
    """

    def __init__(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        k_block: int = 64,
        v_block: int = 64,
        scale_dtype: str = "e4m3",
        max_batch: int,
        max_fp2_tokens: int,
        device: torch.device | str = "cpu",
        softmax_scale: float | None = None,
        num_warps: int = 4,
        stages: int = 4,
        min_blocks: int = 1,
        key_s8: bool | None = None,
        v_layout: CodeLayout = "token",
        timeline: bool = False,
        value_product: str = "exact",
        split_table: SplitTable | Literal["packaged"] | None = "packaged",
        workspace_splits: int = 0,
    ) -> None:
        if num_q_heads % num_kv_heads or not 1 <= num_q_heads // num_kv_heads <= 8:
            raise ConfigError(f"need 1..8 query heads per kv head, got {num_q_heads} / {num_kv_heads}")
        if head_dim not in (64, 128):
            raise ConfigError(f"head dim must be 64 or 128, got {head_dim}")
        if page_size % 32 or page_size <= 0:
            raise ConfigError(f"page size must be a positive multiple of 32, got {page_size}")
        if scale_dtype not in ("e4m3", "e8m0"):
            raise ConfigError(f"the kernels read e4m3 or e8m0 scales, got {scale_dtype!r}")
        if head_dim % k_block or head_dim % v_block or k_block < head_dim // 4 or v_block < head_dim // 8:
            raise ConfigError(
                f"blocks ({k_block}, {v_block}) must divide D={head_dim} and hold a lane's channels "
                f"(k_block >= {head_dim // 4}, v_block >= {head_dim // 8})"
            )
        if v_layout not in ("token", "quad"):
            raise ConfigError(f"v_layout must be 'token' or 'quad', got {v_layout!r}")
        if v_layout == "quad" and v_block < 16:
            raise ConfigError(
                f"the quad value layout needs value blocks of at least 16 channels, got {v_block}"
            )
        self.v_layout = v_layout
        if value_product not in VALUE_PRODUCTS:
            raise ConfigError(f"value_product must be one of {VALUE_PRODUCTS}, got {value_product!r}")
        if value_product != "exact" and canonical_device(device).type == "cuda":
            raise ConfigError(f"value_product {value_product!r} is a CPU emulation: no kernel computes it yet")
        self.value_product = value_product
        if key_s8 is None:  # int8 keys wherever the format allows them: ~11% faster on the H200
            key_s8 = k_block >= 64
        if key_s8 and k_block < 64:
            raise ConfigError(f"key_s8 needs key blocks of at least 64 channels, got {k_block}")
        self.key_s8 = key_s8
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        self.page_size, self.k_block, self.v_block, self.scale_dtype = (
            page_size,
            k_block,
            v_block,
            scale_dtype,
        )
        self.max_batch, self.max_fp2_tokens = max_batch, max_fp2_tokens
        self.device = canonical_device(device)
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.on_gpu = self.device.type == "cuda"
        self.timeline: torch.Tensor | None = None  # the stamps of the last call (timeline builds)
        self.split_table = None if split_table == "packaged" else split_table
        if self.on_gpu:
            from zerodram.kernels.attention import TIMELINE_COLS, Fp2KernelConfig, Fp2Kernels

            cfg = Fp2KernelConfig(
                head_dim, self.group, k_block, v_block, scale_dtype, num_warps, stages, min_blocks, key_s8,
                v_quad=v_layout == "quad", timeline=timeline,
            )  # fmt: skip
            self.kernels = Fp2Kernels(cfg)
            self.kernels.load()
            props = torch.cuda.get_device_properties(self.device)
            self.cta_slots = props.multi_processor_count * self.kernels.decode_ctas_per_sm()
            if split_table == "packaged":
                self.split_table = find_table(props.name, cfg.split_key(), num_kv_heads, page_size)
            self.max_splits = max(self.most_splits(), workspace_splits)
            slots = self.max_splits + 1  # the FP2 splits, then the bf16 tokens' partial
            if cfg.merge_smem_bytes(slots) > cfg.decode_smem_bytes:
                raise ConfigError(
                    f"{self.max_splits} splits (max_fp2_tokens {max_fp2_tokens}) need more merge shared "
                    f"memory than the decode kernel has ({cfg.decode_smem_bytes} B)"
                )
            f32 = {"dtype": torch.float32, "device": self.device}
            self.o_part = torch.empty(max_batch, num_q_heads, slots, head_dim, **f32)
            self.ml_part = torch.empty(max_batch, num_q_heads, slots, 2, **f32)
            self.out = torch.empty(max_batch, num_q_heads, head_dim, **f32)
            # Partials counted per (sequence, KV head): the last CTA of a row merges and resets its
            # count, so this stays zero between launches (and across replays of a captured graph).
            self.row_done = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=self.device)
            ctas = (self.max_splits + 1) * num_kv_heads * max_batch
            self.timeline = torch.zeros(ctas, TIMELINE_COLS, dtype=torch.int64, device=self.device) if timeline else None

    # wave_plan() on CPU (tests, workspace sizing): 132 SMs x 4 CTAs, a nominal figure; on a GPU the
    # driver's occupancy decides (3 an SM for the D = 128 build on the H100 and the H200, 4 for D = 64 on the H100)
    CTA_SLOTS_CPU = 132 * 4
    SPLIT_OVERHEAD_TOKENS = 256  # a CTA's fixed cost in token-times (an estimate, not measured)
    MIN_SPLIT_TOKENS = 1024  # sets the most splits: ~8 stages per warp, prologue and combine stay small

    def most_splits(self) -> int:
        """The most splits `plan` takes for any batch up to max_batch and length up to
        max_fp2_tokens: the largest count it asks `split` for (split rounds a count down, and the
        count it returns is not monotone in L: 48 at B = 1, L = 53,628 against 47 at 56,962 with
        396 slots). The asked-for counts grow with L within a table's grid intervals and beyond
        them (the wave model's; tests/test_split_table.py checks both densely), so the bound and the
        grid lengths below it are the lengths to ask at."""
        grid = self.split_table.lengths if self.split_table else []
        lengths = {self.max_fp2_tokens, *(n for n in grid if n < self.max_fp2_tokens)}
        return max(self.split_count(b, n) for b in range(1, self.max_batch + 1) for n in lengths)

    def plan(self, batch_size: int, max_len: int) -> tuple[int, int]:
        """(num_splits, split_tokens) for a batch whose longest FP2 range is `max_len` (host only):
        `split` of `split_count`."""
        return self.split(max_len, self.split_count(batch_size, max_len))

    def plan_source(self) -> str:
        """What plans the splits, in words (the engine logs it once): the measured table and where
        it applies, or the wave model and why."""
        t = self.split_table
        if t is None:
            why = (
                f"no measured split table for this GPU, kernel build, {self.num_kv_heads} kv heads and pages of "
                f"{self.page_size}" if self.on_gpu else "on the CPU"
            )
            return f"split counts from the wave model ({why})"
        return (
            f"split counts measured on {t.device} ({t.measured.split(',')[0]}) at batch sizes "
            f"{sorted(t.counts)} up to {max(t.lengths)} tokens; the wave model elsewhere"
        )

    def split_count(self, batch_size: int, max_len: int) -> int:
        """The split count the plan asks for: the split table's where it covers the batch (at most
        ceil(L / MIN_SPLIT_TOKENS)), else the wave model's (`wave_count`)."""
        count = self.split_table.lookup(batch_size, max_len) if self.split_table else None
        if count is None:
            return self.wave_count(batch_size, max_len)
        return min(count, self.most_count(max_len))

    @classmethod
    def most_count(cls, max_len: int) -> int:
        """The most splits any plan asks for at max_len: ceil(L / MIN_SPLIT_TOKENS)."""
        return math.ceil(max(max_len, 1) / cls.MIN_SPLIT_TOKENS)

    def wave_plan(self, batch_size: int, max_len: int) -> tuple[int, int]:
        """(num_splits, split_tokens) of the wave model's count (host only)."""
        return self.split(max_len, self.wave_count(batch_size, max_len))

    def wave_count(self, batch_size: int, max_len: int) -> int:
        """The wave model's split count for a batch whose longest FP2 range is `max_len`.

        The CTAs run in waves of `cta_slots` (SMs x resident CTAs per SM), and a wave that is only
        partly full costs as much as a full one. With N = B * Hkv CTA rows and s splits, a CTA costs
        about L / s + SPLIT_OVERHEAD_TOKENS token-times (prologue, combine, merge) and the kernel
        ceil(N * s / slots) of them. Each row also has a short bf16 CTA, launched after all the
        splits; where the N of them do not fit beside the splits' last wave, some wait for a slot,
        counted as SPLIT_OVERHEAD_TOKENS more (a guess: at one wave they start as the first bf16
        CTAs finish, long before the splits do). Take the s that minimises that (the smaller on
        ties), with at most ceil(L / MIN_SPLIT_TOKENS) splits; `split` then makes split_tokens a
        multiple of the 32-token stage, so the last split holds the remainder (it may be short).
        """
        slots = getattr(self, "cta_slots", self.CTA_SLOTS_CPU)
        rows, L = batch_size * self.num_kv_heads, max(max_len, 1)
        most = self.most_count(L)

        def cost(s: int) -> float:
            waves = math.ceil(rows * s / slots)
            late = rows * (s + 1) > waves * slots  # some bf16 CTAs wait for a slot
            return waves * (L / s + self.SPLIT_OVERHEAD_TOKENS) + late * self.SPLIT_OVERHEAD_TOKENS

        return min(range(1, most + 1), key=cost)

    @staticmethod
    def split(max_len: int, splits: int) -> tuple[int, int]:
        """(num_splits, split_tokens) of `splits` CTAs over max_len tokens: split_tokens a multiple
        of the 32-token stage, so the last split holds the remainder (and fewer than `splits`
        remain where max_len is short)."""
        L = max(max_len, 1)
        split_tokens = 32 * math.ceil(L / splits / 32)
        return math.ceil(L / split_tokens), split_tokens

    def check(self, q: torch.Tensor, layer: Fp2Layer, batch: DecodeBatch) -> None:
        """Host-only validation of dtypes, shapes, contiguity and devices. Raises KVInputError."""
        D, Hkv, P = self.head_dim, self.num_kv_heads, self.page_size
        if q.dim() != 3 or q.shape[1:] != (self.num_q_heads, D):
            raise KVInputError(f"q has shape {tuple(q.shape)}, expected [B, {self.num_q_heads}, {D}]")
        B = q.shape[0]
        if not 1 <= B <= self.max_batch:
            raise KVInputError(f"batch of {B} sequences, this module holds workspace for {self.max_batch}")
        NP = layer.k_codes.shape[0]
        dev = self.device
        expect_layer(layer, Hkv, P, D, self.k_block, self.v_block, dev)
        expect_input(batch.block_table, "block_table", torch.int32, (B, batch.block_table.shape[1]), dev)
        expect_input(batch.fp2_len, "fp2_len", torch.int32, (B,), dev)
        slots, HP = (batch.hp_k.shape[0], batch.hp_k.shape[2]) if batch.hp_k.dim() == 4 else (-1, -1)
        expect_input(batch.hp_k, "hp_k", torch.bfloat16, (slots, Hkv, HP, D), dev)
        expect_input(batch.hp_v, "hp_v", torch.bfloat16, (slots, Hkv, HP, D), dev)
        expect_input(batch.hp_len, "hp_len", torch.int32, (B,), dev)
        expect_input(batch.hp_slot, "hp_slot", torch.int32, (B,), dev)
        if q.device != dev:
            raise KVInputError(f"q is on {q.device}, the attention module on {dev}")
        expect_input(q, "q", torch.float32, (B, self.num_q_heads, D), dev)  # the kernel reads it as is
        if NP * Hkv * P >= 2**32:  # the decode kernel addresses token rows of the pool in 32 bits
            raise KVInputError(f"a pool of {NP} pages x {Hkv} heads x {P} slots holds 2^32 token rows or more")
        if layer.v_layout != self.v_layout:
            raise KVInputError(
                f"value pages in the {layer.v_layout!r} layout, the module reads {self.v_layout!r}"
            )

    def check_tables(self, layer: Fp2Layer, batch: DecodeBatch) -> None:
        """Page ids, lengths and bf16 slots (in range, one sequence each) against the pool; the
        levels (finite, increasing, e5m2-exact; int8 multiples for int8 keys); E8M0 scales of the
        batch's tokens within what the kernels expand (synchronises). Raises KVInputError."""
        P, NP = self.page_size, layer.k_codes.shape[0]
        lens = batch.fp2_len.cpu()
        if int(lens.min()) < 0 or int(lens.max()) > self.max_fp2_tokens:
            raise KVInputError(f"fp2_len outside [0, {self.max_fp2_tokens}]: {lens.tolist()}")
        if int(lens.max()) > batch.block_table.shape[1] * P:
            raise KVInputError(
                f"fp2_len {int(lens.max())} needs more than {batch.block_table.shape[1]} pages"
            )
        hp = batch.hp_len.cpu()
        if int(hp.min()) < 0 or int(hp.max()) > batch.hp_k.shape[2]:
            raise KVInputError(f"hp_len outside [0, {batch.hp_k.shape[2]}]: {hp.tolist()}")
        hs = batch.hp_slot.cpu()
        if int(hs.min()) < 0 or int(hs.max()) >= batch.hp_k.shape[0]:
            raise KVInputError(f"hp_slot outside [0, {batch.hp_k.shape[0]}): {hs.tolist()}")
        # A slot holds one sequence's bf16 rows (its sinks and tail, written by its own appends): two
        # batch rows naming one slot would both attend that sequence's recent tokens. (The padding
        # rows of the engine's static steps share the scratch slot; those steps never come here.)
        first_row: dict[int, int] = {}
        for b, slot in enumerate(hs.tolist()):
            a = first_row.setdefault(slot, b)
            if a != b:
                raise KVInputError(f"sequences {a} and {b} both name hp_slot {slot}: {hs.tolist()}")
        lv = layer.levels.cpu()
        sides = lv.view(2, 4)  # K's four, then V's
        if not bool(torch.isfinite(lv).all()) or not bool((sides[:, 1:] > sides[:, :-1]).all()):
            # the rounding rule counts midpoints between neighbours (docs/fp2-format.md): sorted levels
            raise KVInputError(
                f"levels must be finite and strictly increasing on each side (K's four, then V's): {lv.tolist()}"
            )
        if not bool((lv.to(torch.float8_e5m2).float() == lv).all()):
            raise KVInputError(
                f"levels must be e5m2-exact (the value lookup reads their high bytes): {lv.tolist()}"
            )
        if self.on_gpu and self.key_s8 and not int8_key_levels(lv[:4]):
            raise KVInputError(
                f"key_s8 needs key levels that are int8 multiples of 1/64 (1/32 if a level reaches 2): "
                f"{lv[:4].tolist()}; build the attention with key_s8=False"
            )
        table = batch.block_table.cpu()
        written = torch.zeros(NP, P, dtype=torch.bool)  # [NP, P]: the batch's FP2 token rows
        for b, n in enumerate(lens.tolist()):
            used = table[b, : (n + P - 1) // P]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= NP):
                raise KVInputError(f"sequence {b}: page ids {used.tolist()} outside the pool of {NP} pages")
            if used.numel() and self.scale_dtype == "e8m0":  # the rows whose scales are checked below
                written[used[:-1].long()] = True
                written[int(used[-1]), : n - P * (used.numel() - 1)] = True
        if self.scale_dtype == "e8m0":
            # The kernels expand E8M0 scales into fp16 (attn_fp2_common.cuh, scales_to_half2),
            # clamped to 2^15, except the int8 key path's (fp32, unclamped); the quad value path
            # multiplies P (<= 2^7) by the value scale in fp16 and clamps to 2^8. The reference does
            # not clamp: refuse what the kernel would clip. Only the batch's tokens: other rows may
            # be stale or unwritten (0xFF, which the kernels mask). (The low clamp, 2^-14, only
            # lifts near-zero blocks, by less than 2^-14 per element.)
            v_cap = 8 if self.v_layout == "quad" else 15
            rows = written.to(layer.k_scales.device)
            for side, scales, cap in (("key", layer.k_scales, 15), ("value", layer.v_scales, v_cap)):
                if (side == "key" and self.key_s8) or not bool(written.any()):
                    continue
                top = int(scales.transpose(1, 2)[rows].max()) - 127  # [N, Hkv, NB] -> one byte
                if top > cap:
                    raise KVInputError(
                        f"an E8M0 {side} scale of 2^{top} exceeds the {self.v_layout if side == 'value' else 'key'} "
                        f"kernel's 2^{cap} ({side} blocks beyond {2**cap} times the largest level in the "
                        "unit-RMS stored space)"
                    )

    def __call__(
        self,
        q: torch.Tensor,
        layer: Fp2Layer,
        batch: DecodeBatch,
        max_len: int | None = None,
        num_splits: int | None = None,
        pending: PendingAppend | None = None,
    ) -> torch.Tensor:
        """Attention of q [B, Hq, D] (stored key space) -> [B, Hq, D] fp32 (stored value space).

        max_len: a host-side bound on fp2_len (default: max_fp2_tokens); it sizes the grid, so under
        CUDA-graph capture pass the bound the graph must serve. A sequence longer than the grid
        covers gets NaN outputs (the kernel's merge checks), never attention over part of it.
        num_splits: split the FP2 tokens this many ways instead of the plan's way (tuning, and
        `benchmarks/attention.py --splits`); at most the workspace's max_splits. The reference
        (CPU) does not split. On GPU the result is a view of a preallocated buffer, overwritten by
        the next call.
        pending: the step's decode write of every row, not yet made (the cache's `pending_append`;
        the caller makes it after this call, `PendingAppend.write_after`): the rows' bf16 CTAs read
        the new tokens from it and their tails as the last step left them, less the oldest row where
        the write will flush it; batch.fp2_len and hp_len are the lengths after the write (the
        flushed row's codes were written when it arrived, W >= 1 steps earlier). The output is
        that of the write followed by this call. GPU only.
        """
        self.check(q, layer, batch)
        if pending is not None:
            if not self.on_gpu:
                raise KVInputError("a pending append is read by the decode kernel: on CPU the write comes first")
            if pending.rows != q.shape[0]:
                raise KVInputError(f"a pending append of {pending.rows} rows to a decode of {q.shape[0]} rows")
            other = pending.other_regions(batch.hp_k, batch.hp_v)
            if other:
                raise KVInputError(f"the pending append writes other regions than the decode reads: {', '.join(other)}")
        if num_splits is not None and num_splits < 1:
            raise KVInputError(f"num_splits must be at least 1, got {num_splits}")
        if not self.on_gpu:
            return reference_decode(q, layer, batch, self.softmax_scale, self.scale_dtype, self.value_product)
        B, L = q.shape[0], self.max_fp2_tokens if max_len is None else max_len
        num_splits, split_tokens = self.plan(B, L) if num_splits is None else self.split(L, num_splits)
        if num_splits > self.max_splits:
            raise KVInputError(
                f"max_len {L} in {num_splits} splits: the workspace holds {self.max_splits} (max_fp2_tokens "
                f"{self.max_fp2_tokens}, max_batch {self.max_batch})"
            )
        o_part, ml_part, out = self.o_part[:B], self.ml_part[:B], self.out[:B]
        self.kernels.decode(
            q, self.softmax_scale * LOG2E, layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales,
            layer.levels, batch.block_table, batch.fp2_len, split_tokens, num_splits, o_part, ml_part,
            batch.hp_k, batch.hp_v, batch.hp_len, batch.hp_slot, self.row_done, out, self.timeline, pending,
        )  # fmt: skip
        return out
