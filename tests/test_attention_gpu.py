"""FP2 decode attention on the GPU: the CUDA kernels against the torch reference on random ragged
batches (head dims, GQA groups, codebooks, scale formats, value layouts, contexts up to 128k, CUDA
graphs), the write kernel against the CPU quantizer, and a real runtime/kv cache. Skipped without
a GPU; the CPU side (compilation, reference, validation, plan) is test_attention.py.

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, P page size.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import kernel_side, kv_cache_case, make_attention, paged_case, rel_error

from zerodram.runtime.attention import (
    DecodeBatch,
    Fp2DecodeAttention,
    Fp2Writer,
    random_decode_batch,
    random_fp2_layer,
    reference_decode,
)


def _ragged(rng: torch.Generator, B: int, top: int, P: int) -> list[int]:
    """Page-boundary lengths first (1, P - 1, P, P + 1, ...), then random ones up to `top`."""
    edges = [n for n in (1, 31, 33, P - 1, P, P + 1, 2 * P + 1, top) if n <= top]
    rand = [int(x) for x in torch.randint(1, top + 1, (B,), generator=rng)]
    return (edges + rand)[:B]


GPU_CASES = [
    # D, G, Hkv, scale, block, lengths bound
    (128, 4, 2, "e4m3", 64, 3000),
    (128, 1, 4, "e4m3", 64, 3000),
    (128, 8, 1, "e4m3", 64, 3000),
    (64, 4, 2, "e4m3", 64, 3000),
    (64, 1, 2, "e8m0", 64, 3000),
    (64, 8, 2, "e4m3", 32, 3000),
    (128, 4, 2, "e8m0", 32, 3000),
    (128, 2, 4, "e4m3", 64, 3000),  # paired query terms with padding heads
    (64, 3, 3, "e4m3", 64, 3000),  # SmolLM2's group and head dim
    (64, 4, 2, "e4m3", 16, 3000),  # 4 value blocks per token: four scaled copies of P
]


# and the int8-key variant where its format allows (key blocks of at least 64 channels), each with
# value pages in the token and in the quad layout
GPU_CASES_S8 = [
    (*c, s8, vl)
    for c in GPU_CASES
    for s8 in (False, True)
    for vl in ("token", "quad")
    if c[4] >= 64 or not s8
]


@pytest.mark.gpu
@pytest.mark.parametrize(("D", "G", "Hkv", "scale", "block", "top", "key_s8", "v_layout"), GPU_CASES_S8)
def test_gpu_decode_matches_reference(
    D: int, G: int, Hkv: int, scale: str, block: int, top: int, key_s8: bool, v_layout: str
) -> None:
    rng = torch.Generator().manual_seed(D * 100 + G * 10 + Hkv + block)
    P, B, dev = 64, 8, "cuda"
    lengths = _ragged(rng, B, top, P)
    hp = [int(torch.randint(0, 37, (1,), generator=rng)) for _ in range(B)]
    lengths[1], hp[1] = 0, 5  # a sequence with only bf16 tokens
    pages = sum(math.ceil(n / P) for n in lengths) + 3
    gdev = torch.Generator(device=dev).manual_seed(7)
    layer = random_fp2_layer(
        pages, Hkv, P, D, k_block=block, v_block=block, scale_dtype=scale, device=dev, generator=gdev,
        v_layout=v_layout,
    )  # fmt: skip
    batch = random_decode_batch(lengths, hp, pages, Hkv, P, D, device=dev, generator=gdev)
    att = make_attention(
        dev, Hq=G * Hkv, Hkv=Hkv, D=D, P=P, max_tokens=top, k_block=block, v_block=block, scale_dtype=scale,
        key_s8=key_s8, v_layout=v_layout,
    )  # fmt: skip
    att.check_tables(layer, batch)
    for _ in range(2):  # fresh queries, poisoned buffers, twice
        q = torch.randn(B, G * Hkv, D, device=dev)
        for buf in (att.out, att.o_part, att.ml_part):
            buf.fill_(float("nan"))
        out = att(q, layer, batch, max_len=max(lengths)).clone()
        ref = reference_decode(q, layer, batch, att.softmax_scale, scale)
        assert not out.isnan().any()
        for b in range(B):
            assert rel_error(out[b], ref[b]) < 3e-3, (b, lengths[b], hp[b], rel_error(out[b], ref[b]))


@pytest.mark.gpu
@pytest.mark.parametrize(("key_s8", "v_layout"), [(False, "token"), (True, "token"), (True, "quad")])
@pytest.mark.parametrize("L", [1, 8191, 32768, 131072])
def test_gpu_decode_long_context(L: int, key_s8: bool, v_layout: str) -> None:
    D, G, Hkv, P, dev = 128, 4, 8, 64, "cuda"
    lengths = [L, max(1, L // 3)]
    layer, batch, gdev = paged_case(lengths, [4, 36], L, Hkv=Hkv, P=P, D=D, device=dev, v_layout=v_layout)
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=131072, key_s8=key_s8, v_layout=v_layout)
    q = torch.randn(2, G * Hkv, D, device=dev, generator=gdev)
    att.out.fill_(float("nan"))
    out = att(q, layer, batch, max_len=L).clone()
    ref = reference_decode(q, layer, batch, att.softmax_scale, "e4m3")
    assert rel_error(out, ref) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize(("key_s8", "v_layout"), [(False, "token"), (True, "token"), (True, "quad")])
@pytest.mark.parametrize("q_scale", [1.0, 6.0])
def test_gpu_decode_growing_and_peaky_scores(q_scale: float, key_s8: bool, v_layout: str) -> None:
    """Key scales that grow along each sequence (x16 from first to last page) move the running max
    again and again, so the kernel's lazy rescaling must take the exact max often; q_scale 6 makes
    the softmax peaky."""
    from zerodram.runtime.kv.scales import encode_scale, round_scale

    D, G, Hkv, P, B, dev = 128, 4, 2, 64, 3, "cuda"
    lengths = [3000, 2048, 700]
    layer, batch, gdev = paged_case(
        lengths, [4, 0, 36], int(q_scale) * 10, Hkv=Hkv, P=P, D=D, device=dev, v_layout=v_layout
    )
    for b, n in enumerate(lengths):
        used = math.ceil(n / P)
        for i in range(used):  # page i of the sequence gets key scales around 2^(-2 + 4 i / used)
            page = int(batch.block_table[b, i])
            s = torch.exp2(-2 + 4 * i / used + 0.1 * torch.rand(layer.k_scales[page].shape, device=dev))
            layer.k_scales[page] = encode_scale(round_scale(s, "e4m3"), "e4m3")
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=4096, key_s8=key_s8, v_layout=v_layout)
    q = torch.randn(B, G * Hkv, D, device=dev, generator=gdev) * q_scale
    att.out.fill_(float("nan"))
    out = att(q, layer, batch, max_len=max(lengths)).clone()
    ref = reference_decode(q, layer, batch, att.softmax_scale, "e4m3")
    for b in range(B):
        assert rel_error(out[b], ref[b]) < 3e-3, (b, rel_error(out[b], ref[b]))


@pytest.mark.gpu
@pytest.mark.parametrize(("scale", "v_block"), [("e4m3", 64), ("e8m0", 32), ("e4m3", 16), ("e4m3", 128)])
def test_gpu_quad_layout_value_scales_over_their_whole_range(scale: str, v_block: int) -> None:
    """The quad layout multiplies P (<= 2^7) by the value scales in fp16: scales over the format's
    whole range (E4M3 2^-9..448; E8M0 2^-14..2^8, what the fold keeps) and a peaky softmax must
    neither overflow nor lose the small terms."""
    from zerodram.runtime.kv.scales import encode_scale, round_scale

    D, G, Hkv, P, B, dev = 128, 4, 2, 64, 3, "cuda"
    lengths = [3000, 640, 65]
    pages = sum(math.ceil(n / P) for n in lengths)
    gdev = torch.Generator(device=dev).manual_seed(v_block)
    layer = random_fp2_layer(
        pages, Hkv, P, D, v_block=v_block, scale_dtype=scale, device=dev, generator=gdev, v_layout="quad"
    )
    lo, hi = (-9.0, math.log2(448)) if scale == "e4m3" else (-14.0, 8.0)
    s = torch.exp2(lo + (hi - lo) * torch.rand(layer.v_scales.shape, device=dev, generator=gdev))
    layer.v_scales.copy_(encode_scale(round_scale(s, scale), scale))
    batch = random_decode_batch(lengths, [4, 0, 36], pages, Hkv, P, D, device=dev, generator=gdev)
    att = make_attention(
        dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=4096, v_block=v_block, scale_dtype=scale, v_layout="quad"
    )
    for q_scale in (1.0, 6.0):
        q = torch.randn(B, G * Hkv, D, device=dev, generator=gdev) * q_scale
        att.out.fill_(float("nan"))
        out = att(q, layer, batch, max_len=max(lengths)).clone()
        ref = reference_decode(q, layer, batch, att.softmax_scale, scale)
        for b in range(B):
            assert rel_error(out[b], ref[b]) < 3e-3, (q_scale, b, rel_error(out[b], ref[b]))


@pytest.mark.gpu
@pytest.mark.parametrize("key_levels", ["sig", "wide"])
def test_gpu_int8_keys_other_codebooks(key_levels: str) -> None:
    """Int8 keys with the signature lattice (table x 64) and a codebook reaching 2 (table x 32), both
    e5m2-exact, against the reference on the same pages."""
    from zerodram.runtime.kv.levels import named_levels

    D, G, Hkv, P, dev = 128, 4, 2, 64, "cuda"
    lengths = [3000, 700, 33]
    layer, batch, gdev = paged_case(lengths, [4, 0, 36], 11, Hkv=Hkv, P=P, D=D, device=dev)
    kl = named_levels("sig") if key_levels == "sig" else torch.tensor([-2.0, -0.25, 0.25, 2.0])
    layer.levels[:4] = kl.float().to(dev)
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=4096)
    assert att.key_s8
    att.check_tables(layer, batch)
    q = torch.randn(3, G * Hkv, D, device=dev, generator=gdev)
    out = att(q, layer, batch, max_len=max(lengths)).clone()
    ref = reference_decode(q, layer, batch, att.softmax_scale, "e4m3")
    for b in range(3):
        assert rel_error(out[b], ref[b]) < 3e-3, (b, rel_error(out[b], ref[b]))


@pytest.mark.gpu
@pytest.mark.parametrize("key_s8", [False, True])
def test_gpu_query_heads_of_very_different_size(key_s8: bool) -> None:
    """The query heads of one group differ by up to 2^12 in size: every head, not only the group's
    largest, must keep its precision (the int8 keys scale each head's query on its own)."""
    D, G, Hkv, P, dev = 128, 8, 2, 64, "cuda"
    lengths = [2000, 300]
    layer, batch, gdev = paged_case(lengths, [4, 36], 13, Hkv=Hkv, P=P, D=D, device=dev)
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=4096, key_s8=key_s8)
    size = torch.exp2(-torch.arange(G, device=dev, dtype=torch.float32) * 12 / (G - 1)).repeat(Hkv)  # [Hq]
    q = torch.randn(2, G * Hkv, D, device=dev, generator=gdev) * 4 * size[None, :, None]
    out = att(q, layer, batch, max_len=max(lengths)).clone()
    ref = reference_decode(q, layer, batch, att.softmax_scale, "e4m3")
    for b in range(2):
        for h in range(G * Hkv):
            assert rel_error(out[b, h], ref[b, h]) < 3e-3, (b, h, rel_error(out[b, h], ref[b, h]))


@pytest.mark.gpu
@pytest.mark.parametrize(("D", "G"), [(128, 4), (128, 8), (64, 3)])
def test_gpu_merge_of_many_partials(D: int, G: int) -> None:
    """The merge past what its shared memory holds: rows of about 100, 46, 16 and 3 partials (100
    forced splits of 128k, or the workspace's most) take the early copies into shared memory, one
    and many register chunks, and one and two (m, l) loads a lane (attn_fp2_decode_merge.cuh)."""
    Hkv, P, dev = 2, 64, "cuda"
    lengths = [131072, 60000, 20000, 3000]
    layer, batch, gdev = paged_case(lengths, [4, 36, 0, 9], 11, Hkv=Hkv, P=P, D=D, device=dev, v_layout="quad")
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, D=D, max_tokens=131072, key_s8=True, v_layout="quad")
    splits = min(100, att.max_splits)
    assert splits >= 64, att.max_splits  # else the rows above do not reach past two (m, l) loads a lane
    q = torch.randn(len(lengths), G * Hkv, D, device=dev, generator=gdev)
    for buf in (att.out, att.o_part, att.ml_part):
        buf.fill_(float("nan"))
    out = att(q, layer, batch, max_len=131072, num_splits=splits).clone()
    ref = reference_decode(q, layer, batch, att.softmax_scale, "e4m3")
    for b, n in enumerate(lengths):
        assert rel_error(out[b], ref[b]) < 3e-3, (b, n, rel_error(out[b], ref[b]))


@pytest.mark.gpu
def test_gpu_sequence_beyond_max_len_is_nan_not_truncated() -> None:
    """A grid sized for max_len cannot cover a longer sequence: that sequence's output must be NaN
    (loud), the others exact."""
    D, G, Hkv, P, dev = 128, 4, 2, 64, "cuda"
    lengths = [5000, 300]
    layer, batch, gdev = paged_case(lengths, [4, 4], 5, Hkv=Hkv, P=P, D=D, device=dev)
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=8192)
    q = torch.randn(2, G * Hkv, D, device=dev, generator=gdev)
    out = att(q, layer, batch, max_len=1024).clone()  # 1 split of 1024 tokens
    assert out[0].isnan().all()
    assert rel_error(out[1], reference_decode(q, layer, batch, att.softmax_scale, "e4m3")[1]) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_bf16_region_in_chunks_and_sequences_without_tokens(G: int) -> None:
    """The row's bf16 CTA takes its tokens 64 at a time (100 here: two rounds); a sequence with
    neither FP2 nor bf16 tokens gets zeros; and the per-row partial counts reset between launches
    of different batch sizes (a stale count would leave a row unmerged: the poisoned NaN)."""
    D, Hkv, P, dev = 128, 2, 64, "cuda"
    lengths, hp = [700, 0, 2000, 0, 65], [100, 70, 33, 0, 32]
    layer, batch, gdev = paged_case(lengths, hp, G, Hkv=Hkv, P=P, D=D, device=dev, hp_max=100, v_layout="quad")
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=4096, v_layout="quad")
    for B in (5, 3, 5, 1):
        sub = DecodeBatch(*(t[:B] if t.dim() < 4 else t for t in vars(batch).values()))
        q = torch.randn(B, G * Hkv, D, device=dev, generator=gdev)
        for buf in (att.out, att.o_part, att.ml_part):
            buf.fill_(float("nan"))
        out = att(q, layer, sub, max_len=max(lengths[:B])).clone()
        ref = reference_decode(q, layer, sub, att.softmax_scale, "e4m3")
        for b in range(B):
            if lengths[b] == 0 and hp[b] == 0:
                assert (out[b] == 0).all(), b
            else:
                assert rel_error(out[b], ref[b]) < 3e-3, (B, b, rel_error(out[b], ref[b]))


@pytest.mark.gpu
def test_gpu_plan_takes_the_packaged_split_tables() -> None:
    """Every measured split table the package has for this GPU (the benchmark's shape, Hq 32 / Hkv 8
    / D 128 on pages of 64; the packaged SmolLM2's, 9 / 3 / 64 on the engine's pages of 32): the
    module built as the table's kernel key says takes it, its plan is the table's count, the
    workspace holds it, and a ragged batch planned by it (grid and off-grid sizes) matches the
    reference. Where the package has none for this GPU the wave model plans and this test skips."""
    from zerodram.kernels.attention import Fp2KernelConfig
    from zerodram.runtime.attention.split_table import device_file, parse_tables

    path = device_file(torch.cuda.get_device_name())
    if not path.exists():
        pytest.skip(f"no split tables for {torch.cuda.get_device_name()}")
    for table in parse_tables(path.read_text(), str(path)):
        c = Fp2KernelConfig.from_split_key(table.kernel)
        D, G, Hkv, P, dev = c.head_dim, c.group, table.num_kv_heads, table.page_size, "cuda"
        blocks = {"k_block": c.k_block, "v_block": c.v_block, "scale_dtype": c.scale_dtype}
        top = max(table.lengths)
        att = Fp2DecodeAttention(
            num_q_heads=G * Hkv, num_kv_heads=Hkv, head_dim=D, page_size=P, max_batch=32, max_fp2_tokens=top,
            device=dev, **blocks, num_warps=c.num_warps, stages=c.stages, min_blocks=c.min_blocks, key_s8=c.key_s8,
            v_layout="quad" if c.v_quad else "token",
        )  # fmt: skip
        assert att.kernels.cfg.split_key() == table.kernel and att.split_table == table, table.kernel
        grid_b = sorted(table.counts)
        for B, L in ((1, top), (grid_b[-1], top * 3 // 4), (grid_b[-1], min(table.lengths))):
            assert att.plan(B, L) == att.split(L, min(table.lookup(B, L), math.ceil(L / 1024))), (B, L)
        off = [b for b in range(1, 33) if b not in table.counts][:2]
        for B, L in zip(off, (top // 6, top * 3 // 4), strict=True):  # between the grid's batch sizes: the wave model
            assert table.lookup(B, L) is None and att.plan(B, L) == att.wave_plan(B, L), (B, L)
        assert att.max_splits >= max(att.plan(b, n)[0] for b in range(1, 33) for n in range(1, top + 1, 997))
        for lengths in ([top // 6, 7, top // 6 - 1], [top // 25, top // 32, 1, 300, 64]):
            layer, batch, gdev = paged_case(
                lengths, [4] * len(lengths), 13, Hkv=Hkv, P=P, D=D, device=dev, v_layout=att.v_layout, **blocks
            )
            q = torch.randn(len(lengths), G * Hkv, D, device=dev, generator=gdev)
            att.out.fill_(float("nan"))
            out = att(q, layer, batch, max_len=max(lengths)).clone()
            ref = reference_decode(q, layer, batch, att.softmax_scale, att.scale_dtype)
            for b, n in enumerate(lengths):
                assert rel_error(out[b], ref[b]) < 3e-3, (table.kernel, lengths, n, att.plan(len(lengths), max(lengths)))


@pytest.mark.gpu
def test_gpu_decode_under_cuda_graph() -> None:
    D, G, Hkv, P, dev = 128, 4, 2, 64, "cuda"
    lengths = [500, 64, 1]
    pages = 20
    gdev = torch.Generator(device=dev).manual_seed(11)
    layer = random_fp2_layer(pages, Hkv, P, D, device=dev, generator=gdev)
    batch = random_decode_batch(lengths, [0, 4, 36], pages, Hkv, P, D, device=dev, generator=gdev)
    att = make_attention(dev, Hq=G * Hkv, Hkv=Hkv, max_tokens=1024)
    q = torch.randn(3, G * Hkv, D, device=dev)
    att(q, layer, batch, max_len=1024)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = att(q, layer, batch, max_len=1024)
    q.copy_(torch.randn_like(q))
    batch.fp2_len.copy_(torch.tensor([450, 33, 1], dtype=torch.int32))  # lengths may move under the bound
    att.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, reference_decode(q, layer, batch, att.softmax_scale, "e4m3")) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("v_layout", ["token", "quad"])
@pytest.mark.parametrize(
    ("rule", "scale", "block"),
    # 16: half the lanes hold no channel (and a quad byte spans two blocks); 128: four channels per lane
    [
        ("absmax", "e4m3", 64),
        ("mse", "e4m3", 64),
        ("mse", "e8m0", 32),
        ("mse", "e4m3", 16),
        ("mse", "e4m3", 128),
    ],
)
def test_gpu_write_matches_cpu_quantizer(rule: str, scale: str, block: int, v_layout: str) -> None:
    D, Hkv, P, N, dev = 128, 4, 64, 512, "cuda"
    gdev = torch.Generator(device=dev).manual_seed(5)
    layer = random_fp2_layer(
        16, Hkv, P, D, k_block=block, v_block=block, scale_dtype=scale, device=dev, generator=gdev,
        v_layout=v_layout,
    )  # fmt: skip
    batch = random_decode_batch([1000], [0], 16, Hkv, P, D, device=dev, generator=gdev)
    y = (
        torch.randn(N, Hkv, 2, D, device=dev, generator=gdev)
        * torch.rand(N, Hkv, 2, 1, device=dev, generator=gdev)
        * 3
    )
    f = torch.randperm(1000, device=dev, generator=gdev)[:N].to(torch.int32)
    s = torch.zeros(N, dtype=torch.int32, device=dev)
    kw = {
        "head_dim": D,
        "k_block": block,
        "v_block": block,
        "scale_dtype": scale,
        "k_rule": rule,
        "v_rule": rule,
        "v_layout": v_layout,
    }
    gpu_writer = Fp2Writer(device=dev, **kw)
    # a short grid first (a decode append: search warps), then a long one (one warp per block)
    gpu_writer.write(y[:8], s[:8], f[:8], layer, batch.block_table)
    gpu_writer.write(y[8:], s[8:], f[8:], layer, batch.block_table)
    cpu = type(layer)(
        *(
            t.cpu().clone()
            for t in (layer.k_codes, layer.k_scales, layer.v_codes, layer.v_scales, layer.levels)
        ),
        v_layout=layer.v_layout,
    )
    Fp2Writer(device="cpu", **kw).write(y.cpu(), s.cpu(), f.cpu(), cpu, batch.block_table.cpu())
    for gpu_t, cpu_t in ((layer.k_scales, cpu.k_scales), (layer.v_scales, cpu.v_scales)):
        agree = float((gpu_t.cpu() == cpu_t).float().mean())
        assert agree == 1.0 if rule == "absmax" else agree >= 0.999, agree
    for gpu_t, cpu_t in ((layer.k_codes, cpu.k_codes), (layer.v_codes, cpu.v_codes)):
        agree = float((gpu_t.cpu() == cpu_t).float().mean())
        assert agree == 1.0 if rule == "absmax" else agree >= 0.999, agree


@pytest.mark.gpu
def test_gpu_matches_kv_reference_decode_on_a_real_cache() -> None:
    from zerodram.runtime.kv.attention import reference_decode_attention

    cache, sids, q = kv_cache_case("cuda", [1, 5, 40, 300, 1000])
    att = make_attention("cuda", max_tokens=1024, v_layout=cache.v.layout)
    att.out.fill_(float("nan"))
    ref = reference_decode_attention(q, cache, sids)
    assert rel_error(kernel_side(att, cache, sids, q, 4), ref) < 3e-3
