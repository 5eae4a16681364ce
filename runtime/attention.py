"""FP2 decode attention over a paged FP2 KV cache: the fused CUDA kernels on a GPU, plain torch on CPU.

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, NP pages, P page
size, NBK / NBV = D / k_block, D / v_block scale blocks per token, HP bf16 tokens per sequence,
S split slots, N written tokens.

Everything is in the cache's stored space (docs/fp2-format.md): keys and values rotated by their
Hadamard matrix and divided by their per-channel anchor. `prepare_query` folds the key rotation
and anchor into q, `finish_output` applies the value anchor and rotates back; both are one
[D, D] product outside the kernels. A sequence's keys are FP2 tokens [0, fp2_len) reached through
its block-table row (token f in page row[f // P], slot f % P) plus HP bf16 tokens (sinks and the
not yet quantized tail) in `hp_k` / `hp_v`, order-free (attention is a sum over tokens).

The backend (CUDA kernels or the torch reference) is chosen once, at construction, from the
device. Inputs are validated at the boundary: dtypes, shapes, contiguity and device on every call
(host-only checks); page ids against the pool in `check_tables` (it synchronises, so call it where
a sync is harmless, not inside a CUDA-graph capture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerodram.runtime.device import canonical_device
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.errors import KVInputError, expect_tensor
from zerodram.runtime.kv.pack import CodeLayout, quad_to_token, unpack_codes

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Fp2Layer:
    """One layer's FP2 page pools, as the kernels read them (docs/fp2-kernel.md, "Layout").

    k_codes / v_codes: [NP, Hkv, P, D/16] int32 code words (bit pattern = uint32).
    k_scales / v_scales: [NP, Hkv, P, NBK] / [NP, Hkv, P, NBV] uint8 (E4M3 or E8M0 bytes).
    levels: [8] fp32, the 4 key levels then the 4 value levels (sorted, e5m2-exact).
    v_layout: "token" (each token's D/16 words in a row) or "quad" (the words of 4 tokens
        interleaved by byte: runtime/kv/pack.py; what the cache writes for the formats the kernels
        read, `runtime/kv/fp2_cache.value_layout`).
    """

    k_codes: torch.Tensor
    k_scales: torch.Tensor
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    levels: torch.Tensor
    v_layout: CodeLayout = "token"


@dataclass(frozen=True)
class DecodeBatch:
    """Per-step decode metadata. block_table [B, max_pages] int32; fp2_len [B] int32;
    hp_k / hp_v [num_slots, Hkv, HP, D] bf16 (the cache's region); hp_len [B] int32 (<= HP), the
    rows 0..hp_len-1 of slot hp_slot[b] (sinks, then the tail: contiguous by docs/fp2-format.md)."""

    block_table: torch.Tensor
    fp2_len: torch.Tensor
    hp_k: torch.Tensor
    hp_v: torch.Tensor
    hp_len: torch.Tensor
    hp_slot: torch.Tensor


def prepare_query(
    q: torch.Tensor, rotation: torch.Tensor | None, anchor: torch.Tensor, group: int
) -> torch.Tensor:
    """q [B, Hq, D] -> (q @ R_k) * anchor_k of its kv head, fp32 [B, Hq, D].

    anchor: [Hkv, D], repeated over the group here; group 1 takes an anchor already [Hq, D] as is.
    """
    x = q.float()
    if rotation is not None:
        x = x @ rotation.to(x.device)
    return x * _per_query_head(anchor.to(x.device), group)[None]


def finish_output(
    o: torch.Tensor, rotation: torch.Tensor | None, anchor: torch.Tensor, group: int
) -> torch.Tensor:
    """o [B, Hq, D] in the stored value space -> (o * anchor_v) @ R_v^T, fp32 (anchor as in
    `prepare_query`)."""
    x = o.float() * _per_query_head(anchor.to(o.device), group)[None]
    return x @ rotation.to(o.device).T if rotation is not None else x


def _per_query_head(anchor: torch.Tensor, group: int) -> torch.Tensor:
    return anchor if group == 1 else anchor.repeat_interleave(group, dim=0)


def dequantize_pages(
    codes: torch.Tensor, scales_raw: torch.Tensor, levels: torch.Tensor, scale_dtype: str
) -> torch.Tensor:
    """codes [..., D/16] int32, scales [..., NB] uint8 -> values [..., D] fp32 (levels [4])."""
    from zerodram.runtime.kv.scales import decode_scale

    c = unpack_codes(codes).long()  # [..., D]
    s = decode_scale(scales_raw, scale_dtype)  # [..., NB]
    y = levels.to(codes.device)[c]
    return (y.unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2)


def reference_decode(
    q: torch.Tensor, layer: Fp2Layer, batch: DecodeBatch, softmax_scale: float, scale_dtype: str
) -> torch.Tensor:
    """Dequantize every sequence's FP2 pages, add its bf16 tokens, fp32 attention. -> [B, Hq, D] fp32.

    q [B, Hq, D] in the stored key space. The plain-torch definition the kernels are tested against.
    """
    B, Hq, D = q.shape
    Hkv, P = layer.k_codes.shape[1], layer.k_codes.shape[2]
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(batch.fp2_len[b])
        pages = batch.block_table[b, : (n + P - 1) // P].long()
        ks, vs = [], []
        if n:
            kc = layer.k_codes[pages].transpose(0, 1).flatten(1, 2)[:, :n]  # [Hkv, n, D/16]
            vp = layer.v_codes[pages]
            vc = (quad_to_token(vp) if layer.v_layout == "quad" else vp).transpose(0, 1).flatten(1, 2)[:, :n]
            ksc = layer.k_scales[pages].transpose(0, 1).flatten(1, 2)[:, :n]
            vsc = layer.v_scales[pages].transpose(0, 1).flatten(1, 2)[:, :n]
            ks.append(dequantize_pages(kc, ksc, layer.levels[:4], scale_dtype))
            vs.append(dequantize_pages(vc, vsc, layer.levels[4:], scale_dtype))
        h, slot = int(batch.hp_len[b]), int(batch.hp_slot[b])
        ks.append(batch.hp_k[slot, :, :h].float())
        vs.append(batch.hp_v[slot, :, :h].float())
        k, v = torch.cat(ks, 1), torch.cat(vs, 1)  # [Hkv, L, D]
        qb = q[b].float().view(Hkv, G, D)
        logits = (qb @ k.transpose(1, 2)) * softmax_scale  # [Hkv, G, L]
        p = torch.softmax(logits, -1) if logits.shape[-1] else logits
        out[b] = (p @ v).reshape(Hq, D) if logits.shape[-1] else 0.0
    return out


def _expect(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    expect_tensor(t, name, dtype, shape, device, owner="the attention module")


def int8_key_levels(levels: torch.Tensor) -> bool:
    """Whether four key levels (any device) are what the int8-key kernel's table holds exactly: the
    levels times f integers within +-127, f = 64 if every |L| < 2 (so levels on a 1/64 grid) else 32
    (a 1/32 grid, |L| < 4). For e5m2-exact levels that means inner levels >= 1/16 (>= 1/8 when a
    level reaches 2): the named codebooks, and calibrated ones in practice."""
    lv = levels.detach().float().cpu()
    kf = lv * (64 if float(lv.abs().max()) < 2 else 32)
    return bool(((kf == kf.round()) & (kf.abs() <= 127)).all())


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
        if self.on_gpu:
            from zerodram.kernels.attention import Fp2KernelConfig, Fp2Kernels

            cfg = Fp2KernelConfig(
                head_dim, self.group, k_block, v_block, scale_dtype, num_warps, stages, min_blocks, key_s8,
                v_quad=v_layout == "quad",
            )  # fmt: skip
            self.kernels = Fp2Kernels(cfg)
            self.kernels.load()
            props = torch.cuda.get_device_properties(self.device)
            self.cta_slots = props.multi_processor_count * self.kernels.decode_ctas_per_sm()
            self.max_splits = max(self.plan(b, max_fp2_tokens)[0] for b in range(1, max_batch + 1))
            f32 = {"dtype": torch.float32, "device": self.device}
            self.o_part = torch.empty(max_batch, num_q_heads, self.max_splits, head_dim, **f32)
            self.ml_part = torch.empty(max_batch, num_q_heads, self.max_splits, 2, **f32)
            self.out = torch.empty(max_batch, num_q_heads, head_dim, **f32)
            self.q16 = torch.empty(max_batch, num_q_heads, head_dim, dtype=torch.float16, device=self.device)
            self.zeros = torch.zeros(max_batch, dtype=torch.int32, device=self.device)

    CTA_SLOTS_CPU = 132 * 4  # plan() on CPU (tests): an H200's 132 SMs x 4 resident decode CTAs
    SPLIT_OVERHEAD_TOKENS = 256  # a CTA's fixed cost in token-times (an estimate, not measured)
    MIN_SPLIT_TOKENS = 1024  # sets the most splits: ~8 stages per warp, prologue and combine stay small

    def plan(self, batch_size: int, max_len: int) -> tuple[int, int]:
        """(num_splits, split_tokens) for a batch whose longest FP2 range is `max_len` (host only).

        The CTAs run in waves of `cta_slots` (SMs x resident CTAs per SM), and a wave that is only
        partly full costs as much as a full one. With N = B * Hkv CTA rows and s splits, a CTA costs
        about L / s + SPLIT_OVERHEAD_TOKENS token-times (prologue, combine, merge) and the kernel
        ceil(N * s / slots) of them: take the s that minimises that (the smaller on ties), with at
        most ceil(L / MIN_SPLIT_TOKENS) splits; split_tokens is a multiple of the 32-token stage, so
        the last split holds the remainder (it may be short).
        """
        slots = getattr(self, "cta_slots", self.CTA_SLOTS_CPU)
        rows, L = batch_size * self.num_kv_heads, max(max_len, 1)
        most = max(1, math.ceil(L / self.MIN_SPLIT_TOKENS))
        splits = min(
            range(1, most + 1),
            key=lambda s: math.ceil(rows * s / slots) * (L / s + self.SPLIT_OVERHEAD_TOKENS),
        )
        split_tokens = 32 * math.ceil(L / splits / 32)
        return math.ceil(L / split_tokens), split_tokens

    def check(self, q: torch.Tensor, layer: Fp2Layer, batch: DecodeBatch) -> None:
        """Host-only validation of dtypes, shapes, contiguity and devices. Raises KVInputError."""
        B, D, Hkv, P = q.shape[0], self.head_dim, self.num_kv_heads, self.page_size
        if q.dim() != 3 or q.shape[1:] != (self.num_q_heads, D):
            raise KVInputError(f"q has shape {tuple(q.shape)}, expected [B, {self.num_q_heads}, {D}]")
        if not 1 <= B <= self.max_batch:
            raise KVInputError(f"batch of {B} sequences, this module holds workspace for {self.max_batch}")
        NP = layer.k_codes.shape[0]
        dev = self.device
        _expect(layer.k_codes, "k_codes", torch.int32, (NP, Hkv, P, D // 16), dev)
        _expect(layer.v_codes, "v_codes", torch.int32, (NP, Hkv, P, D // 16), dev)
        _expect(layer.k_scales, "k_scales", torch.uint8, (NP, Hkv, P, D // self.k_block), dev)
        _expect(layer.v_scales, "v_scales", torch.uint8, (NP, Hkv, P, D // self.v_block), dev)
        _expect(layer.levels, "levels", torch.float32, (8,), dev)
        _expect(batch.block_table, "block_table", torch.int32, (B, batch.block_table.shape[1]), dev)
        _expect(batch.fp2_len, "fp2_len", torch.int32, (B,), dev)
        slots, HP = (batch.hp_k.shape[0], batch.hp_k.shape[2]) if batch.hp_k.dim() == 4 else (-1, -1)
        _expect(batch.hp_k, "hp_k", torch.bfloat16, (slots, Hkv, HP, D), dev)
        _expect(batch.hp_v, "hp_v", torch.bfloat16, (slots, Hkv, HP, D), dev)
        _expect(batch.hp_len, "hp_len", torch.int32, (B,), dev)
        _expect(batch.hp_slot, "hp_slot", torch.int32, (B,), dev)
        if q.device != dev:
            raise KVInputError(f"q is on {q.device}, the attention module on {dev}")
        if layer.k_codes.stride(0) >= 2**32:  # the decode kernel's page strides are 32-bit
            raise KVInputError(f"a page of {layer.k_codes.stride(0)} code words exceeds the kernel's 2^32")
        if layer.v_layout != self.v_layout:
            raise KVInputError(
                f"value pages in the {layer.v_layout!r} layout, the module reads {self.v_layout!r}"
            )

    def check_tables(self, layer: Fp2Layer, batch: DecodeBatch) -> None:
        """Page ids and lengths against the pool (synchronises). Raises KVInputError."""
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
        lv = layer.levels.cpu()
        if not bool((lv.to(torch.float8_e5m2).float() == lv).all()):
            raise KVInputError(
                f"levels must be e5m2-exact (the value lookup reads their high bytes): {lv.tolist()}"
            )
        if self.on_gpu and self.key_s8 and not int8_key_levels(lv[:4]):
            raise KVInputError(
                f"key_s8 needs key levels that are int8 multiples of 1/64 (1/32 if a level reaches 2): "
                f"{lv[:4].tolist()}; build the attention with key_s8=False"
            )
        if self.v_layout == "quad" and self.scale_dtype == "e8m0":
            # the quad path multiplies P (<= 2^7) by the value scale in fp16 and clamps E8M0 to 2^8
            top = int(layer.v_scales.max()) - 127
            if top > 8:
                raise KVInputError(
                    f"an E8M0 value scale of 2^{top} exceeds the quad kernel's 2^8 "
                    "(value blocks beyond 256 times the largest level in the unit-RMS stored space)"
                )
        table = batch.block_table.cpu()
        for b, n in enumerate(lens.tolist()):
            used = table[b, : (n + P - 1) // P]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= NP):
                raise KVInputError(f"sequence {b}: page ids {used.tolist()} outside the pool of {NP} pages")

    def __call__(
        self, q: torch.Tensor, layer: Fp2Layer, batch: DecodeBatch, max_len: int | None = None
    ) -> torch.Tensor:
        """Attention of q [B, Hq, D] (stored key space) -> [B, Hq, D] fp32 (stored value space).

        max_len: a host-side bound on fp2_len (default: max_fp2_tokens); it sizes the grid, so under
        CUDA-graph capture pass the bound the graph must serve. A sequence longer than the grid
        covers gets NaN outputs (the merge kernel's check), never attention over part of it. On GPU the result is a view of a
        preallocated buffer, overwritten by the next call.
        """
        self.check(q, layer, batch)
        if not self.on_gpu:
            return reference_decode(q, layer, batch, self.softmax_scale, self.scale_dtype)
        B = q.shape[0]
        num_splits, split_tokens = self.plan(B, self.max_fp2_tokens if max_len is None else max_len)
        if num_splits > self.max_splits:
            raise KVInputError(
                f"max_len {max_len} needs {num_splits} splits, workspace has {self.max_splits}"
            )
        q16 = self.q16[:B]
        torch.mul(q, self.softmax_scale * LOG2E, out=q16)
        o_part, ml_part, out, lo = self.o_part[:B], self.ml_part[:B], self.out[:B], self.zeros[:B]
        k = self.kernels
        k.decode(
            q16, layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales, layer.levels,
            batch.block_table, lo, batch.fp2_len, split_tokens, num_splits, o_part, ml_part,
        )  # fmt: skip
        k.merge(
            o_part, ml_part, lo, batch.fp2_len, split_tokens, num_splits, q16, batch.hp_k, batch.hp_v, batch.hp_len,
            batch.hp_slot, out,
        )  # fmt: skip
        return out


class Fp2Writer:
    """Quantize stored-space K/V tokens into FP2 pages (the CUDA write kernel, or the reference).

    Channel blocks, symmetric, no outliers; rule 'absmax' or 'mse' per side, as runtime/kv's
    quantizer; value pages in the token or the quad layout (`v_layout`, as `Fp2Layer`). Raises
    ConfigError for a format the kernel does not write.
    """

    def __init__(
        self, *, head_dim: int, k_block: int = 64, v_block: int = 64, scale_dtype: str = "e4m3",
        k_rule: str = "mse", v_rule: str = "mse", device: torch.device | str = "cpu", v_layout: CodeLayout = "token",
    ) -> None:  # fmt: skip
        if k_rule not in ("absmax", "mse") or v_rule not in ("absmax", "mse"):
            raise ConfigError(f"the write kernel implements absmax and mse, got {k_rule!r} / {v_rule!r}")
        if scale_dtype not in ("e4m3", "e8m0"):
            raise ConfigError(f"the write kernel writes e4m3 or e8m0 scales, got {scale_dtype!r}")
        if head_dim not in (64, 128) or head_dim % k_block or head_dim % v_block:
            raise ConfigError(
                f"blocks ({k_block}, {v_block}) must divide a head dim of 64 or 128, got {head_dim}"
            )
        if v_layout not in ("token", "quad"):
            raise ConfigError(f"v_layout must be 'token' or 'quad', got {v_layout!r}")
        self.head_dim, self.k_block, self.v_block, self.scale_dtype = head_dim, k_block, v_block, scale_dtype
        self.rules, self.v_layout = (k_rule, v_rule), v_layout
        self.device = canonical_device(device)
        self.on_gpu = self.device.type == "cuda"
        from zerodram.runtime.kv.quantize import MSE_FRACTIONS

        self.fracs = MSE_FRACTIONS.float().to(self.device)
        if self.on_gpu:
            from zerodram.kernels.attention import Fp2KernelConfig, Fp2Kernels

            cfg = Fp2KernelConfig(head_dim, 1, k_block, v_block, scale_dtype, v_quad=v_layout == "quad")
            self.kernels = Fp2Kernels(cfg)
            _ = self.kernels._write

    def write(
        self,
        y: torch.Tensor,
        seq_idx: torch.Tensor,
        fp2_idx: torch.Tensor,
        layer: Fp2Layer,
        block_table: torch.Tensor,
    ) -> None:
        """y [N, Hkv, 2, D] fp32 (K, V in the stored space) -> codes and scales of FP2 token
        fp2_idx[i] of block-table row seq_idx[i] (pages must be allocated)."""
        N, Hkv, _, D = y.shape
        _expect(y, "y", torch.float32, (N, Hkv, 2, self.head_dim), self.device)
        _expect(seq_idx, "seq_idx", torch.int32, (N,), self.device)
        _expect(fp2_idx, "fp2_idx", torch.int32, (N,), self.device)
        if layer.v_layout != self.v_layout:
            raise KVInputError(f"value pages in the {layer.v_layout!r} layout, the writer stores {self.v_layout!r}")
        if self.on_gpu:
            rules = int(self.rules[0] == "mse") | (int(self.rules[1] == "mse") << 1)
            self.kernels.write(
                y, seq_idx, fp2_idx, block_table, layer.k_codes, layer.k_scales, layer.v_codes,
                layer.v_scales, layer.levels, self.fracs, rules,
            )  # fmt: skip
            return
        from zerodram.runtime.kv.pack import pack_codes, store_quad_rows
        from zerodram.runtime.kv.quantize import quantize_blocks
        from zerodram.runtime.kv.scales import encode_scale

        P = layer.k_codes.shape[2]
        page = block_table[seq_idx.long(), (fp2_idx // P).long()].long()
        slot = (fp2_idx % P).long()
        for side, (bs, codes_t, scales_t) in enumerate(
            ((self.k_block, layer.k_codes, layer.k_scales), (self.v_block, layer.v_codes, layer.v_scales))
        ):
            yb = y[:, :, side].reshape(N, Hkv, D // bs, bs)
            codes, scales, _ = quantize_blocks(
                yb, layer.levels[4 * side : 4 * side + 4], rule=self.rules[side], scale_dtype=self.scale_dtype
            )
            if side == 1 and self.v_layout == "quad":
                store_quad_rows(codes_t, page, slot, codes.reshape(N, Hkv, D))
            else:
                codes_t[page, :, slot] = pack_codes(codes.reshape(N, Hkv, D))
            scales_t[page, :, slot] = encode_scale(scales, self.scale_dtype)


def random_fp2_layer(
    num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, *, k_block: int = 64, v_block: int = 64,
    scale_dtype: str = "e4m3", device: torch.device | str = "cpu", generator: torch.Generator | None = None,
    v_layout: CodeLayout = "token",
) -> Fp2Layer:  # fmt: skip
    """Random (never zero) FP2 pools for tests and benchmarks: uniform codes, scales in [1/4, 4].

    Uniform random words are as random in either value layout, so `v_layout` only labels them."""
    from zerodram.runtime.kv.levels import named_levels
    from zerodram.runtime.kv.scales import encode_scale, round_scale

    dev = torch.device(device)

    def codes() -> torch.Tensor:
        w = torch.randint(-(2**31), 2**31 - 1, (num_pages, num_kv_heads, page_size, head_dim // 16),
                          dtype=torch.int32, device=dev, generator=generator)  # fmt: skip
        return w

    def scales(block: int) -> torch.Tensor:
        shape = (num_pages, num_kv_heads, page_size, head_dim // block)
        s = torch.exp2(torch.rand(shape, device=dev, generator=generator) * 4 - 2)
        return encode_scale(round_scale(s, scale_dtype), scale_dtype)

    lv = named_levels("lm")
    levels = torch.cat([lv, named_levels("sig")]).float().to(dev)  # K and V differ on purpose
    return Fp2Layer(codes(), scales(k_block), codes(), scales(v_block), levels, v_layout)


def random_decode_batch(
    lengths: list[int],
    hp_lengths: list[int],
    num_pages: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    *,
    hp_max: int = 36,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> DecodeBatch:
    """Block tables over a random permutation of the pool (pages scattered), random bf16 tokens."""
    dev = torch.device(device)
    need = [(n + page_size - 1) // page_size for n in lengths]
    if sum(need) > num_pages:
        raise ValueError(f"{sum(need)} pages needed, pool has {num_pages}")
    gdev = generator.device if generator is not None else "cpu"
    perm = torch.randperm(num_pages, generator=generator, device=gdev).to(torch.int32).cpu()
    width = max(max(need), 1)
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    B = len(lengths)
    shape = (B, num_kv_heads, hp_max, head_dim)
    hp_k = torch.randn(shape, device=dev, generator=generator).to(torch.bfloat16)
    hp_v = torch.randn(shape, device=dev, generator=generator).to(torch.bfloat16)
    i32 = {"dtype": torch.int32, "device": dev}
    lens, hp_lens = torch.tensor(lengths, **i32), torch.tensor(hp_lengths, **i32)
    return DecodeBatch(table.to(dev), lens, hp_k, hp_v, hp_lens, torch.arange(B, **i32))


def layer_from_cache(cache) -> Fp2Layer:
    """The kernels' view of a runtime/kv `Fp2KVCache` (no copy of the pages).

    Raises:
        ConfigError: token blocks, asymmetric scales, a scale dtype the kernels do not read, or a
            value center.
    """
    spec = cache.spec
    for name, side in (("k", spec.k), ("v", spec.v)):
        if side.block_axis != "channel" or side.asymmetric or side.scale_dtype not in ("e4m3", "e8m0"):
            raise ConfigError(
                f"{name}: the FP2 kernels read symmetric channel blocks with e4m3/e8m0 scales, got "
                f"blk={side.block_axis[0]}{side.block_size} scale={side.scale_dtype} asym={side.asymmetric}"
            )
    if cache.params[1].center is not None:
        # A value center must be added back to the output (docs/fp2-format.md); the kernels don't.
        raise ConfigError("the FP2 kernels do not add a value center back (vcenter=1); use kcenter only")
    levels = torch.cat([cache.params[0].levels, cache.params[1].levels]).float().to(cache.device)
    return Fp2Layer(
        cache.k.codes, cache.k.scales, cache.v.codes, cache.v.scales, levels.contiguous(), cache.v.layout
    )


def batch_from_cache(cache, seq_ids: list[int]) -> DecodeBatch:
    """Block-table rows, FP2 and bf16 token counts of `seq_ids` (host bookkeeping -> device)."""
    P = cache.page_size
    lens = [cache.seq_len(s) for s in seq_ids]
    n_fp2 = [cache.rule.num_quantized(n) for n in lens]
    hp = [n - f for n, f in zip(lens, n_fp2, strict=True)]  # sinks + tail: all that is not FP2
    width = max(1, max((f + P - 1) // P for f in n_fp2))
    table = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
    for b, (sid, f) in enumerate(zip(seq_ids, n_fp2, strict=True)):
        pages = cache.tables.pages[sid][: (f + P - 1) // P]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    i32 = {"dtype": torch.int32, "device": cache.device}
    return DecodeBatch(
        table.to(cache.device), torch.tensor(n_fp2, **i32), cache.hp_k, cache.hp_v, torch.tensor(hp, **i32),
        torch.tensor(seq_ids, **i32),
    )  # fmt: skip
