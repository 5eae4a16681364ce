"""FP2 decode attention on CPU: the kernels compile for sm_90, the torch reference, the quad value
layout, the CPU writer, input validation and the split plan. The kernels against the reference on
the GPU are test_attention_gpu.py.

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, P page size.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from attention_cases import e4m3_product_bound, kernel_side, kv_cache_case, make_attention, paged_case
from bench_cli import assert_refuses_without_gpu, load_script, run_bench

from zerodram.kernels.attention import Fp2KernelConfig
from zerodram.kernels.jit import compile_cubin
from zerodram.runtime.attention import (
    DecodeBatch,
    Fp2DecodeAttention,
    Fp2Writer,
    dequantize_pages,
    random_decode_batch,
    random_fp2_layer,
    reference_decode,
)
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.errors import KVInputError

CONFIGS = [
    Fp2KernelConfig(head_dim=d, group=g, k_block=kb, v_block=kb, scale_dtype=sd)
    for d, g, kb, sd in itertools.product((64, 128), (1, 4, 8), (64,), ("e4m3", "e8m0"))
] + [Fp2KernelConfig(head_dim=128, group=4, k_block=32, v_block=32), Fp2KernelConfig(head_dim=64, k_block=32)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c.head_dim}g{c.group}b{c.k_block}{c.scale_dtype}")
@pytest.mark.parametrize("kernel", ["attn_fp2_decode", "attn_fp2_write"])
def test_kernels_compile_for_sm90(cfg: Fp2KernelConfig, kernel: str) -> None:
    assert compile_cubin(kernel, cfg.build_options(kernel))[:4] == b"\x7fELF"


@pytest.mark.parametrize(
    "cfg",
    [Fp2KernelConfig(128, 4, 64, 64, "e4m3", key_s8=True), Fp2KernelConfig(64, 8, 64, 32, "e8m0", key_s8=True),
     Fp2KernelConfig(128, 1, 128, 64, "e4m3", min_blocks=4, key_s8=True),
     Fp2KernelConfig(128, 4, 64, 64, "e4m3", key_s8=True, v_quad=True),
     Fp2KernelConfig(64, 8, 32, 16, "e8m0", v_quad=True), Fp2KernelConfig(128, 2, 64, 128, "e4m3", v_quad=True),
     Fp2KernelConfig(128, 4, 64, 64, "e4m3", key_s8=True, v_quad=True, timeline=True),
     Fp2KernelConfig(64, 3, 64, 64, "e4m3", key_s8=True)],
    ids=lambda c: f"d{c.head_dim}g{c.group}b{c.k_block}v{c.v_block}{c.scale_dtype}m{c.min_blocks}"
    + ("s8" if c.key_s8 else "") + ("quad" if c.v_quad else "") + ("timeline" if c.timeline else ""),
)  # fmt: skip
def test_decode_variants_compile_for_sm90(cfg: Fp2KernelConfig) -> None:
    assert compile_cubin("attn_fp2_decode", cfg.build_options("attn_fp2_decode"))[:4] == b"\x7fELF"


def test_selector_halves_pass_through_hi16_bit_for_bit() -> None:
    """hi16 (attn_fp2_common.cuh) brings a selector's high half down with one fp16 add of -0; that
    is exact only for finite patterns. Every half the three expansions build: e5m2 bytes
    (c << 4) | 4, int8-key nibbles c (bytes 0x00..0x33), fp16-table bytes c * 0x22 + 0x10."""
    import numpy as np

    e5m2 = [(c << 4) | 4 for c in range(4)]
    nibbles = [(a << 4) | b for a in range(4) for b in range(4)]
    f16 = [c * 0x22 + 0x10 for c in range(4)]
    halves = np.array(
        [(hi << 8) | lo for byte_set in (e5m2, nibbles, f16) for hi in byte_set for lo in byte_set], dtype=np.uint16
    )  # fmt: skip
    x = halves.view(np.float16)
    assert np.isfinite(x).all()
    assert ((x + np.float16(-0.0)).view(np.uint16) == halves).all()


def test_int8_partials_read_as_fp32_through_the_magic_start() -> None:
    """With paired query terms the IMMA accumulators start at the bits of M = 1.5 * 2^23 (kScoreMagic
    in attn_fp2_decode_compute.cuh): read as fp32 they are M + partial exactly while |partial| <
    2^22 (the kernel's are < 2^20: 64 channels x |q| <= 64 x |k| <= 127). A lane holds its head's hi
    and lo partials; F_hi - 12681216 (M + M / 128) is hi - M / 128 exactly, and one fma with 128 and
    F_lo gives fp32(128 hi + lo), one rounding, as the kernel's docs say."""
    import numpy as np

    magic, const = 0x4B400000, np.float32(12681216.0)
    assert float(const) == 1.5 * 2**23 * (1 + 1 / 128)  # exact in fp32
    rng = np.random.default_rng(4)
    edges = [0, 1, -1, 2**20 - 1, -(2**20), 2**22 - 1, -(2**22), 123457, -98765]
    hi = np.array(edges + list(rng.integers(-(2**22), 2**22, 20000)), dtype=np.int64)
    lo = np.array(edges[::-1] + list(rng.integers(-(2**22), 2**22, 20000)), dtype=np.int64)
    as_f32 = lambda p: ((magic + p) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)  # noqa: E731
    f_hi, f_lo = as_f32(hi), as_f32(lo)
    assert (f_hi.astype(np.float64) == 1.5 * 2**23 + hi).all()
    t = f_hi - const  # fp32 subtraction, exact
    assert (t.astype(np.float64) == hi - 1.5 * 2**16).all()
    # an FMA: the exact product and sum (float64 holds them), rounded once to fp32
    y = (t.astype(np.float64) * 128 + f_lo.astype(np.float64)).astype(np.float32)
    assert (y == (128 * hi + lo).astype(np.float64).astype(np.float32)).all()


def test_int8_key_levels() -> None:
    from zerodram.runtime.attention import int8_key_levels
    from zerodram.runtime.kv.levels import named_levels

    for name in ("sig", "lm"):
        assert int8_key_levels(named_levels(name))
    assert int8_key_levels(torch.tensor([-2.0, -0.125, 0.125, 2.0]))  # a level at 2: the table takes 32x
    assert not int8_key_levels(torch.tensor([-1.5, -1 / 128, 1 / 128, 1.5]))  # 1/128 is off the 1/64 grid
    assert not int8_key_levels(torch.tensor([-2.0, -1 / 64, 1 / 64, 2.0]))  # and 1/64 off the 1/32 one


def test_int8_keys_need_64_channel_blocks() -> None:
    with pytest.raises(ConfigError, match="key_s8"):
        make_attention("cpu", k_block=32, key_s8=True)
    # the default takes int8 keys wherever the blocks allow them, the fp16-key path elsewhere
    assert make_attention("cpu", k_block=64).key_s8 and not make_attention("cpu", k_block=32).key_s8


def _dense_reference(q, layer, batch, scale, P, scale_dtype="e4m3"):
    """Independent of reference_decode: token by token gather, then SDPA with GQA."""
    outs = []
    for b in range(q.shape[0]):
        n, h, slot = int(batch.fp2_len[b]), int(batch.hp_len[b]), int(batch.hp_slot[b])
        rows = [(int(batch.block_table[b, f // P]), f % P) for f in range(n)]
        k = [
            dequantize_pages(layer.k_codes[p, :, s], layer.k_scales[p, :, s], layer.levels[:4], scale_dtype)
            for p, s in rows
        ]
        v = [
            dequantize_pages(layer.v_codes[p, :, s], layer.v_scales[p, :, s], layer.levels[4:], scale_dtype)
            for p, s in rows
        ]
        k = torch.stack(k + [batch.hp_k[slot, :, j].float() for j in range(h)], 1)  # [Hkv, L, D]
        v = torch.stack(v + [batch.hp_v[slot, :, j].float() for j in range(h)], 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b][None, :, None].float(), k[None], v[None], scale=scale, enable_gqa=True
        )  # [1, Hq, 1, D]
        outs.append(o[0, :, 0])
    return torch.stack(outs)


def test_reference_matches_token_by_token_gather() -> None:
    g = torch.Generator().manual_seed(1)
    layer = random_fp2_layer(12, 2, 64, 128, generator=g)
    batch = random_decode_batch([70, 1, 128], [3, 0, 36], 12, 2, 64, 128, generator=g)
    q = torch.randn(3, 8, 128, generator=g)
    ref = reference_decode(q, layer, batch, 0.088, "e4m3")
    dense = _dense_reference(q, layer, batch, 0.088, 64)
    torch.testing.assert_close(ref, dense, rtol=1e-5, atol=1e-5)


def test_e4m3_value_product_stays_within_its_rounding() -> None:
    """VALUE_PRODUCTS "e4m3" (the emulation of an FP8 value product) moves each output element by
    at most `e4m3_product_bound` (attention_cases.py: e4m3's rounding of each FP2 token's weight
    times value scale); the rounding does act (the outputs differ, by more than a trace), and a
    sequence without FP2 tokens is the exact output bit for bit."""
    g = torch.Generator().manual_seed(11)
    P, Hkv, D = 64, 2, 128
    layer = random_fp2_layer(8, Hkv, P, D, generator=g)
    batch = random_decode_batch([300, 0], [5, 7], 8, Hkv, P, D, generator=g)
    q = torch.randn(2, 8, D, generator=g) * 3  # peaky enough that some weights fall far below the max
    exact = reference_decode(q, layer, batch, 0.088, "e4m3")
    fp8 = reference_decode(q, layer, batch, 0.088, "e4m3", value_product="e4m3")
    assert torch.equal(fp8[1], exact[1])  # no FP2 tokens: nothing to round
    err, bound = (fp8 - exact).abs(), e4m3_product_bound(q, layer, batch, 0.088)
    ratio = (err / bound)[bound > 0]
    assert bool((err <= bound * (1 + 1e-4) + 1e-6).all()), float(ratio.max())
    assert float(err.max()) > 1e-5 and float(ratio.max()) > 0.2  # the bound is not vacuous
    print(f"\ne4m3 value product: largest error / bound {float(ratio.max()):.2f}")  # docs/fp2-kernel.md
    with pytest.raises(ValueError, match="value_product"):
        reference_decode(q, layer, batch, 0.088, "e4m3", value_product="e5m2")
    with pytest.raises(ConfigError, match="value_product"):
        make_attention("cpu", value_product="e5m2")
    assert make_attention("cpu", value_product="e4m3").value_product == "e4m3"


@pytest.mark.parametrize("D", [64, 128])
def test_quad_value_layout_round_trips_and_places_each_code(D: int) -> None:
    from zerodram.runtime.kv.pack import quad_channel_order, quad_to_token, token_to_quad, unpack_codes

    g = torch.Generator().manual_seed(D)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 2, 64, D // 16), dtype=torch.int32, generator=g)
    quad = token_to_quad(words)
    assert torch.equal(quad_to_token(quad), words)
    order, codes = quad_channel_order(D), unpack_codes(words)  # [3, 2, 64, D]
    assert sorted(order.tolist()) == list(range(D))
    qw = quad.reshape(3, 2, 16, D // 4).long() & 0xFFFFFFFF  # [page, head, quad, word]
    for t, c in [(0, 0), (5, 37 % D), (62, D - 1), (33, 8), (7, 16)]:
        pos = int((order == c).nonzero())
        w, f = divmod(pos, 4)  # the kernel's word g * D/32 + k, field f: channel 32k + 16(f>>1) + 8(f&1) + g
        gg, k = divmod(w, D // 32)
        assert c == 32 * k + 16 * (f >> 1) + 8 * (f & 1) + gg
        assert int(qw[1, 1, t // 4, w] >> (8 * (t % 4) + 2 * f)) & 3 == int(codes[1, 1, t, c])


def test_reference_reads_quad_value_pages() -> None:
    from dataclasses import replace

    from zerodram.runtime.kv.pack import token_to_quad

    g = torch.Generator().manual_seed(3)
    layer = random_fp2_layer(12, 2, 64, 128, generator=g)
    batch = random_decode_batch([70, 1, 128], [3, 0, 36], 12, 2, 64, 128, generator=g)
    q = torch.randn(3, 8, 128, generator=g)
    quad = replace(layer, v_codes=token_to_quad(layer.v_codes), v_layout="quad")
    torch.testing.assert_close(
        reference_decode(q, quad, batch, 0.088, "e4m3"), reference_decode(q, layer, batch, 0.088, "e4m3"),
        rtol=0, atol=0,
    )  # fmt: skip
    with pytest.raises(KVInputError, match="quad"):
        make_attention("cpu")(q, quad, batch)  # the module reads the token layout
    assert make_attention("cpu", v_layout="quad")(q, quad, batch).shape == (3, 8, 128)
    y = torch.randn(5, 2, 2, 128, generator=g)
    f, s = torch.tensor([0, 1, 2, 67, 127], dtype=torch.int32), torch.tensor([0, 0, 0, 2, 2], dtype=torch.int32)
    with pytest.raises(KVInputError, match="quad"):
        Fp2Writer(head_dim=128).write(y, s, f, quad, batch.block_table)  # the writer stores the token layout
    Fp2Writer(head_dim=128).write(y, s, f, layer, batch.block_table)
    Fp2Writer(head_dim=128, v_layout="quad").write(y, s, f, quad, batch.block_table)
    assert torch.equal(quad.v_codes, token_to_quad(layer.v_codes))  # the same codes, byte-permuted
    with pytest.raises(ConfigError, match="16 channels"):
        make_attention("cpu", D=64, k_block=16, v_block=8, v_layout="quad")


def test_quad_layout_refuses_e8m0_value_scales_the_kernel_would_clip() -> None:
    from dataclasses import replace

    g = torch.Generator().manual_seed(4)
    layer = replace(random_fp2_layer(4, 2, 64, 128, scale_dtype="e8m0", generator=g), v_layout="quad")
    batch = random_decode_batch([70, 100], [3, 0], 4, 2, 64, 128, generator=g)
    att = make_attention("cpu", scale_dtype="e8m0", v_layout="quad")
    layer.v_scales[1, 0, 5, 1] = 127 + 8  # 2^8: the largest the kernel keeps
    att.check_tables(layer, batch)
    layer.v_scales[1, 0, 5, 1] = 127 + 9
    with pytest.raises(KVInputError, match="2\\^9"):
        att.check_tables(layer, batch)


@pytest.mark.parametrize("v_layout", ["token", "quad"])
def test_e8m0_key_and_token_value_scales_past_the_kernels_fp16_are_refused(v_layout: str) -> None:
    """The kernels expand E8M0 scales into fp16, clamped to 2^15 (the int8 key path reads key scales
    in fp32, unclamped); the reference does not clamp."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(5)
    layer = replace(random_fp2_layer(4, 2, 64, 128, scale_dtype="e8m0", generator=g), v_layout=v_layout)
    batch = random_decode_batch([70, 100], [3, 0], 4, 2, 64, 128, generator=g)
    f16_keys = make_attention("cpu", scale_dtype="e8m0", v_layout=v_layout, key_s8=False)
    s8_keys = make_attention("cpu", scale_dtype="e8m0", v_layout=v_layout, key_s8=True)
    layer.k_scales[0, 1, 3, 0] = 127 + 15
    f16_keys.check_tables(layer, batch)
    layer.k_scales[0, 1, 3, 0] = 127 + 16
    with pytest.raises(KVInputError, match=r"E8M0 key scale of 2\^16 exceeds the key kernel's 2\^15"):
        f16_keys.check_tables(layer, batch)
    s8_keys.check_tables(layer, batch)
    if v_layout == "token":
        layer.k_scales[0, 1, 3, 0] = 127
        layer.v_scales[1, 0, 5, 1] = 127 + 16
        with pytest.raises(KVInputError, match=r"E8M0 value scale of 2\^16 exceeds the token kernel's 2\^15"):
            s8_keys.check_tables(layer, batch)
    # only the batch's tokens count: rows past a sequence's length may be unwritten (0xFF, which
    # the kernels mask) or stale
    layer.k_scales[0, 1, 3, 0] = layer.v_scales[1, 0, 5, 1] = 127
    last, n = batch.block_table[0, 1], int(batch.fp2_len[0]) - 64  # sequence 0's last page, its rows
    layer.k_scales[last, :, n:] = layer.v_scales[last, :, n:] = 0xFF
    f16_keys.check_tables(layer, batch)
    layer.k_scales[last, 0, n - 1, 0] = 127 + 16
    with pytest.raises(KVInputError, match=r"E8M0 key scale of 2\^16"):
        f16_keys.check_tables(layer, batch)


def test_check_tables_refuses_two_sequences_in_one_bf16_slot() -> None:
    """A slot's sinks and tail are one sequence's; a batch that names it twice would have the other
    row attend them, silently (the decode reads whatever slot it is given)."""
    from dataclasses import replace

    layer, batch, g = paged_case([70, 0, 100], [3, 5, 2], 5, Hkv=2, P=64, D=128, device="cpu")
    att = make_attention("cpu")
    att.check_tables(layer, batch)  # slots 0, 1, 2
    shared = replace(batch, hp_slot=torch.tensor([2, 1, 2], dtype=torch.int32))
    q = torch.randn(3, 8, 128, generator=g)
    assert not torch.equal(att(q, layer, shared)[0], att(q, layer, batch)[0])  # row 0 reads row 2's tail
    with pytest.raises(KVInputError, match=r"sequences 0 and 2 both name hp_slot 2: \[2, 1, 2\]"):
        att.check_tables(layer, shared)
    with pytest.raises(KVInputError, match=r"sequences 1 and 2 both name hp_slot 0"):
        att.check_tables(layer, replace(batch, hp_slot=torch.tensor([1, 0, 0], dtype=torch.int32)))


def test_cpu_writer_round_trips_through_the_kv_quantizer() -> None:
    from zerodram.runtime.kv.levels import named_levels
    from zerodram.runtime.kv.quantize import dequantize_blocks, quantize_blocks

    g = torch.Generator().manual_seed(2)
    layer = random_fp2_layer(4, 2, 64, 128, generator=g)
    batch = random_decode_batch([200], [0], 4, 2, 64, 128, generator=g)
    y = torch.randn(7, 2, 2, 128, generator=g)
    f = torch.tensor([0, 1, 63, 64, 65, 130, 199], dtype=torch.int32)
    Fp2Writer(head_dim=128).write(y, torch.zeros(7, dtype=torch.int32), f, layer, batch.block_table)
    pages = batch.block_table[0, (f // 64).long()].long()
    slots = (f % 64).long()
    back = dequantize_pages(
        layer.k_codes[pages, :, slots], layer.k_scales[pages, :, slots], layer.levels[:4], "e4m3"
    )
    lv = named_levels("lm").float()
    codes, scales, _ = quantize_blocks(y[:, :, 0].reshape(7, 2, 2, 64), lv, rule="mse", scale_dtype="e4m3")
    torch.testing.assert_close(
        back, dequantize_blocks(codes, scales, None, lv).reshape(7, 2, 128), rtol=0, atol=0
    )
    before = [t.clone() for t in (layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales)]
    none = torch.zeros(0, dtype=torch.int32)
    Fp2Writer(head_dim=128).write(y[:0], none, none, layer, batch.block_table)  # no token: nothing written
    assert all(torch.equal(a, b) for a, b in zip(before, (layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales), strict=True))


def test_cpu_writer_refuses_bad_tables_pools_and_values_and_writes_nothing() -> None:
    """The writer's boundary: the block table's dtype and shape, the layer's pools against the
    writer's head dim and blocks, and (on CPU) seq_idx / fp2_idx within the table, the page ids
    found there within the pool and y finite and within the stored range, each refused before
    anything is written."""
    from dataclasses import replace

    from zerodram.runtime.kv.errors import KVNonFiniteError

    g = torch.Generator().manual_seed(11)
    layer = random_fp2_layer(4, 2, 64, 128, generator=g)
    batch = random_decode_batch([70, 10], [0, 0], 4, 2, 64, 128, generator=g)  # row 1: one page, then -1
    table = batch.block_table
    y = torch.randn(3, 2, 2, 128, generator=g)
    s, f = torch.tensor([0, 1, 0], dtype=torch.int32), torch.tensor([69, 9, 3], dtype=torch.int32)
    w = Fp2Writer(head_dim=128)
    before = [t.clone() for t in (layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales)]

    def refuses(match: str, *, y=y, s=s, f=f, layer=layer, table=table, writer=w, error=KVInputError) -> None:
        with pytest.raises(error, match=match):
            writer.write(y, s, f, layer, table)

    refuses("block_table must be torch.int32", table=table.long())
    refuses("block_table must be torch.int32", table=table.float())
    refuses(r"block_table has shape \(2,\), expected \[B, max_pages\]", table=table[0])
    refuses("block_table must be contiguous", table=table.t().contiguous().t())
    refuses(r"token 1: seq_idx 2, fp2_idx 9 outside the block table \(2 rows", s=torch.tensor([0, 2, 0], dtype=torch.int32))
    refuses("fp2_idx -1 outside", f=torch.tensor([69, 9, -1], dtype=torch.int32))
    refuses("fp2_idx 128 outside", f=torch.tensor([69, 9, 128], dtype=torch.int32))
    # row 1's second column is -1 (no page): FP2 token 70 of it is in no page
    refuses(r"token 1: FP2 token 70 of block-table row 1 is in page -1, outside the pool of 4 pages",
            f=torch.tensor([69, 70, 3], dtype=torch.int32))  # fmt: skip
    refuses("outside the pool of 4 pages", table=table + 4)
    refuses(r"k_scales has shape \(4, 2, 64, 2\), expected \(4, 2, 64, 4\)", writer=Fp2Writer(head_dim=128, k_block=32))
    refuses(r"v_scales has shape \(4, 2, 64, 2\), expected \(4, 2, 64, 1\)",
            layer=random_fp2_layer(4, 2, 64, 128, v_block=64, generator=g), writer=Fp2Writer(head_dim=128, v_block=128))  # fmt: skip
    refuses(r"k_codes has shape \(4, 3, 64, 8\)", layer=random_fp2_layer(4, 3, 64, 128, generator=g))
    refuses("k_codes must be torch.int32", layer=replace(layer, k_codes=layer.k_codes.long()))
    refuses("levels must be torch.float32", layer=replace(layer, levels=layer.levels.double()))
    for bad in (float("nan"), float("inf")):
        y_bad = y.clone()
        y_bad[2, 1, 1, 5] = bad
        refuses(
            rf"non-finite V value {bad} at token 2 \(block-table row 0, FP2 token 3\), KV head 1, channel 5; "
            "nothing was written", y=y_bad, error=KVNonFiniteError,
        )  # fmt: skip
    y_big = y.clone()
    y_big[1, 0, 0, 9] = -(2.0**57)  # past the stored range (2^56), where the kernel equals the reference
    refuses(r"K value -1\.44\d*e\+17 at token 1 \(block-table row 1, FP2 token 9\), KV head 0, channel 9 is past "
            r"the stored range \+-2\^56", y=y_big)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, (layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales), strict=True))
    w.write(y, s, f, layer, table)  # the same call, valid, writes
    assert not torch.equal(before[1], layer.k_scales)


@pytest.mark.parametrize("scale", ["e4m3", "e8m0"])
@pytest.mark.parametrize("levels", ["lm", "sig"])
def test_write_kernel_search_rule_picks_the_cpu_scales(levels: str, scale: str) -> None:
    """attn_fp2_write's MSE search in torch: codes placed by y >= round(s * m_i) (fp32 products),
    errors (y - round(s * L))^2 summed in fp32, the first least error. It must choose the scale the
    CPU quantizer's closed-form search (`_search_scales`, fp64 prefix sums) chooses."""
    from zerodram.runtime.kv.levels import midpoints, named_levels
    from zerodram.runtime.kv.quantize import MSE_FRACTIONS, _search_scales
    from zerodram.runtime.kv.scales import round_scale

    g = torch.Generator().manual_seed(7)
    lv = named_levels(levels).float()
    for bs in (16, 64, 128):
        y = torch.randn(4000, bs, generator=g) * torch.rand(4000, 1, generator=g) * 3  # [NB, BS]
        s0 = y.abs().amax(-1) / lv.abs().max()
        cand = round_scale(s0[:, None] * MSE_FRACTIONS.float(), scale)  # [NB, C]
        code = (y[:, None, :, None] >= cand[..., None, None] * midpoints(lv)).sum(-1)  # [NB, C, BS]
        err = ((y[:, None, :] - lv[code] * cand[..., None]) ** 2).sum(-1)  # [NB, C]
        kernel_rule = cand.gather(1, err.argmin(1, keepdim=True))[:, 0]
        assert torch.equal(kernel_rule, _search_scales(y, torch.ones_like(y), lv, s0, scale)), bs


def test_validation_names_both_sides() -> None:
    from dataclasses import replace

    att = make_attention("cpu")
    g = torch.Generator().manual_seed(3)
    layer = random_fp2_layer(4, 2, 64, 128, generator=g)
    batch = random_decode_batch([10], [0], 4, 2, 64, 128, generator=g)
    with pytest.raises(KVInputError, match=r"q has shape"):
        att(torch.randn(1, 4, 128), layer, batch)
    with pytest.raises(KVInputError, match=r"q has shape \(\), expected \[B, 8, 128\]"):
        att(torch.randn(()), layer, batch)
    bad = DecodeBatch(batch.block_table.long(), *list(vars(batch).values())[1:])
    with pytest.raises(KVInputError, match=r"block_table must be torch.int32"):
        att(torch.randn(1, 8, 128), layer, bad)
    with pytest.raises(KVInputError, match=r"q must be torch.float32"):  # the kernel reads q as it is
        att(torch.randn(1, 8, 128).half(), layer, batch)
    with pytest.raises(KVInputError, match=r"q must be contiguous"):
        att(torch.randn(1, 128, 8).transpose(1, 2), layer, batch)
    with pytest.raises(KVInputError, match=r"num_splits must be at least 1"):
        att(torch.randn(1, 8, 128), layer, batch, num_splits=0)
    oob = DecodeBatch(batch.block_table + 100, *list(vars(batch).values())[1:])
    with pytest.raises(KVInputError, match=r"outside the pool of 4 pages"):
        att.check_tables(layer, oob)
    att.check_tables(layer, batch)
    for side in (0, 4):  # K's levels, then V's
        for bad in ("inf", "unsorted", "tie"):
            lv = layer.levels.clone()
            if bad == "inf":  # e5m2 holds inf: only the finiteness check refuses it
                lv[side + 3] = float("inf")
            elif bad == "unsorted":
                lv[side : side + 4] = lv[side : side + 4].flip(0)
            else:
                lv[side + 1] = lv[side]
            with pytest.raises(KVInputError, match=r"levels must be finite and strictly increasing"):
                att.check_tables(replace(layer, levels=lv), batch)
    with pytest.raises(ConfigError, match=r"1..8 query heads"):
        make_attention("cpu", Hq=32, Hkv=2)
    with pytest.raises(ConfigError, match=r"multiple of 32"):
        make_attention("cpu", P=48)


def test_forced_splits_cover_the_range_in_stages() -> None:
    """`split` (the plan's rounding, and `num_splits=` forced): multiples of the 32-token stage
    whose count covers max_len, fewer than asked where max_len is short."""
    for L in (1, 31, 33, 1000, 8192, 131072):
        for s in (1, 3, 6, 48):
            n, tokens = Fp2DecodeAttention.split(L, s)
            assert tokens % 32 == 0 and 1 <= n <= s and (n - 1) * tokens < L <= n * tokens, (L, s, n, tokens)
    assert Fp2DecodeAttention.split(8192, 6) == (6, 1376) and Fp2DecodeAttention.split(40, 4) == (2, 32)


def test_plan_fills_whole_waves_and_respects_the_minimum_split() -> None:
    att = make_attention("cpu", Hq=32, Hkv=8, max_tokens=131072)
    slots = att.CTA_SLOTS_CPU
    for B in (1, 3, 8, 32, 100):
        splits, tokens = att.plan(B, 131072)
        assert splits * tokens >= 131072
        assert tokens % 32 == 0
        ctas = B * 8 * splits
        waves = math.ceil(ctas / slots)
        assert ctas / (waves * slots) >= 0.85, (B, splits, ctas)  # the last wave is nearly full
    assert att.plan(8, 131072)[0] == 8  # 512 of 528 slots, not 9 splits = 576 CTAs in two waves
    assert att.plan(1, 100) == (1, 128)
    # Each row also has a short bf16 CTA: on the H200's 396 slots (3 CTAs per SM) B = 1 takes 48
    # splits, so that 8 x 48 splits and the 8 bf16 CTAs all start at once (49: 4 would wait).
    att.cta_slots = 132 * 3
    assert att.plan(1, 131072)[0] == 48
    assert att.plan(8, 131072)[0] == 6  # 384 splits; the 64 bf16 CTAs wait, but 5 splits cost more


def test_all_early_bytes_hold_every_partial_and_no_more() -> None:
    """`merge_all_early_bytes(n)` against the merge's own count of early partials (the kernel's
    `n_early`, written out here): exactly n partials fit, one float less holds n - 1."""

    def n_early(cfg: Fp2KernelConfig, smem: int, n: int) -> int:  # attn_fp2_decode_merge.cuh
        g, d = cfg.group, cfg.head_dim
        early_at = (2 * g * n + g + 3) & ~3
        return max(0, min(n, (smem // 4 - early_at) // (g * d)))

    for cfg in CONFIGS:
        for n in (1, 2, 17, 33, 49):
            need = cfg.merge_all_early_bytes(n)
            assert need % 16 == 0 and need >= cfg.merge_smem_bytes(n), (cfg, n)
            assert n_early(cfg, need, n) == n and n_early(cfg, need - 4, n) == n - 1, (cfg, n)


# ---------------------------------------------------------------------------------------------- GPU


def test_matches_kv_reference_decode_on_a_real_cache() -> None:
    from zerodram.runtime.kv.attention import reference_decode_attention

    cache, sids, q = kv_cache_case("cpu", [1, 5, 40, 300])
    att = make_attention("cpu", max_tokens=1024, v_layout=cache.v.layout)
    ref = reference_decode_attention(q, cache, sids)
    torch.testing.assert_close(kernel_side(att, cache, sids, q, 4), ref, rtol=1e-4, atol=1e-4)


def test_bench_refuses_negative_split_counts_and_runs_only_on_a_gpu() -> None:
    """`zerodram bench attention`: a bad --splits, --shape, --page-size or --write-kv is refused before anything else
    (exit 2, named); without a GPU the benchmark says it needs one."""
    for bad in ("0,4,-1", "0,waves"):
        out = run_bench(["attention", "--splits", bad])
        assert out.returncode == 2 and "--splits takes counts >= 0 (0: the plan's) or 'wave'" in out.stderr, out.stderr
    out = run_bench(["attention", "--shape", "32x8"])
    assert out.returncode == 2 and "--shape takes HQxHKVxD, three positive integers, got '32x8'" in out.stderr
    out = run_bench(["attention", "--page-size", "48"])
    assert out.returncode == 2 and "--page-size takes a positive multiple of 32, got 48" in out.stderr
    out = run_bench(["attention", "--write-kv", "fp2:tail=1,window=47"])
    assert out.returncode == 2 and "feedback on both sides" in out.stderr, out.stderr[-2000:]
    assert_refuses_without_gpu("attention")


def test_bench_output_check_passes_the_module_and_catches_a_wrong_output() -> None:
    """`benchmarks/attention.py`'s check of every timed variant: the module's own output (here the
    CPU path) is within the tolerance of reference_decode on the first and the last sequence, and
    an output 1% off on the last sequence alone is not (so the check can fail, and looks there)."""
    bench = load_script("attention")
    layer, batch, gen = paged_case([70, 5, 130], [3, 0, 36], 11, Hkv=2, P=64, D=64, device="cpu")
    att = make_attention("cpu", Hq=8, Hkv=2, D=64, max_tokens=256)
    q = torch.randn(3, 8, 64, generator=gen)
    assert bench.check_rel_err(att, q, layer, batch, 130, None) < 1e-5

    class LastOff:  # the module, with its last sequence's output scaled by 1.01
        def __getattr__(self, name):
            return getattr(att, name)

        def __call__(self, *a, **kw):
            out = att(*a, **kw).clone()
            out[-1] *= 1.01
            return out

    assert bench.check_rel_err(LastOff(), q, layer, batch, 130, None) == pytest.approx(0.01, rel=1e-3)
    assert bench.CHECK_TOL < 0.01
