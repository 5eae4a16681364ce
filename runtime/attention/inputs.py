"""What decode attention reads: one layer's FP2 page pools (`Fp2Layer`) and one step's sequences
(`DecodeBatch`), built from a runtime/kv cache or at random for tests and benchmarks.

Shape legend: B seqs, Hkv kv heads, D head dim, NP pages, P page size, NBK / NBV = D / k_block,
D / v_block scale blocks per token, HP bf16 tokens per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.errors import expect_tensor
from zerodram.runtime.kv.pack import CodeLayout


@dataclass(frozen=True)
class Fp2Layer:
    """One layer's FP2 page pools, as the kernels read them (docs/fp2-kernel.md, "Layout").

    k_codes / v_codes: [NP, Hkv, P, D/16] int32 code words (bit pattern = uint32).
    k_scales / v_scales: [NP, Hkv, P, NBK] / [NP, Hkv, P, NBV] uint8 (E4M3 or E8M0 bytes).
    levels: [8] fp32, the 4 key levels then the 4 value levels (sorted, e5m2-exact).
    v_layout: "token" (each token's D/16 words in a row) or "quad" (the words of 4 tokens
        interleaved by byte: runtime/kv/pack.py; what the cache writes for the formats the kernels
        read, `runtime/kv/fp2_pages.value_layout`).
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


def expect_input(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """`expect_tensor` for the attention modules' inputs (raises KVInputError)."""
    expect_tensor(t, name, dtype, shape, device, owner="the attention module")


def expect_layer(
    layer: Fp2Layer, num_kv_heads: int, page_size: int, head_dim: int, k_block: int, v_block: int,
    device: torch.device,
) -> None:  # fmt: skip
    """The layer's pools in the dtypes, shapes and device a kernel of this shape reads, contiguous
    (the kernels take their pointers and strides as they are). Raises KVInputError."""
    NP, Hkv, P, D = layer.k_codes.shape[0], num_kv_heads, page_size, head_dim
    expect_input(layer.k_codes, "k_codes", torch.int32, (NP, Hkv, P, D // 16), device)
    expect_input(layer.v_codes, "v_codes", torch.int32, (NP, Hkv, P, D // 16), device)
    expect_input(layer.k_scales, "k_scales", torch.uint8, (NP, Hkv, P, D // k_block), device)
    expect_input(layer.v_scales, "v_scales", torch.uint8, (NP, Hkv, P, D // v_block), device)
    expect_input(layer.levels, "levels", torch.float32, (8,), device)


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
