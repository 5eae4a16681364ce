"""Paged caches: token-by-token equals chunked appends, fork/free, errors, reference attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.kv.attention import reference_decode_attention
from zerodram.runtime.kv.cache import make_kv_cache
from zerodram.runtime.kv.errors import KVCapacityError, KVInputError
from zerodram.runtime.kv.pack import unpack_codes

H, D, P = 2, 64, 64
FORMATS = [
    "bf16",
    "fp8",
    "fp2",
    "fp2:kblk=t32,vblk=c32,scale=e8m0,asym=1,rot=0",
    "fp2:sinks=0,tail=64",
    "fp2:tail=1,window=32",
    "fp2:kblk=t16,tail=16,window=8",
]


def _cache(fmt: str, num_pages: int = 8, **kw):
    return make_kv_cache(fmt, num_pages=num_pages, page_size=P, num_kv_heads=H, head_dim=D, **kw)


def _tokens(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V whose values encode their token index (self-checking rows)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.float32)[:, None, None]
    k = torch.randn(n, H, D, generator=gen) + 0.01 * pos
    v = torch.randn(n, H, D, generator=gen) - 0.01 * pos
    return k, v


@settings(max_examples=6, deadline=None)
@given(st.sampled_from(FORMATS), st.integers(1, 200), st.lists(st.integers(1, 70), min_size=1, max_size=4))
def test_token_by_token_equals_chunks(fmt: str, n: int, chunks: list[int]) -> None:
    k, v = _tokens(n)
    a, b = _cache(fmt), _cache(fmt)
    sa, sb = a.new_sequence(), b.new_sequence()
    for i in range(n):
        a.append(sa, k[i : i + 1], v[i : i + 1])
    i = 0
    for c in chunks * (n // max(sum(chunks), 1) + 1):
        if i >= n:
            break
        b.append(sb, k[i : i + c], v[i : i + c])
        i += c
    ka, va = a.gather(sa)
    kb, vb = b.gather(sb)
    assert a.seq_len(sa) == b.seq_len(sb) == n
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize(("fmt", "tol"), [("bf16", 0.01), ("fp8", 0.05), ("fp2", 0.4)])
def test_read_back_error(fmt: str, tol: float) -> None:
    k, v = _tokens(300, seed=1)
    c = _cache(fmt)
    s = c.new_sequence()
    c.append(s, k, v)
    kh, vh = c.gather(s)
    assert kh.shape == k.shape
    assert float((kh - k).norm() / k.norm()) < tol
    assert float((vh - v).norm() / v.norm()) < tol


def test_fp2_sinks_and_tail_stay_high_precision() -> None:
    c = _cache("fp2:sinks=4,tail=32")
    k, v = _tokens(4 + 64 + 10)
    s = c.new_sequence()
    c.append(s, k, v)
    kh, _ = c.gather(s)
    bf = lambda x: float((kh[x] - k[x]).abs().max())  # noqa: E731
    assert bf(slice(0, 4)) < 0.05 and bf(slice(68, 78)) < 0.05  # bf16 rows (rotation rounding)
    assert bf(slice(4, 68)) > 0.1  # quantized
    assert len(c.tables.pages[s]) == 1  # 64 FP2 tokens: exactly one page


def test_fp2_pages_match_documented_layout() -> None:
    """Word codes[p, h, t, c // 16] bits 2*(c % 16) hold the code of (t, h, c)."""
    from zerodram.runtime.kv.quantize import quantize_tokens, to_stored_space

    c = _cache("fp2:sinks=0,tail=64,rot=0")
    k, v = _tokens(64, seed=3)
    s = c.new_sequence()
    c.append(s, k, v)
    page = c.tables.pages[s][0]
    words = c.k.codes[page]  # [H, P, D/16]
    codes = unpack_codes(words)  # [H, P, D]
    y = to_stored_space(k, c.params[0]).to(torch.bfloat16).float()
    ref = quantize_tokens(
        y, c.spec.k, c.params[0].__class__(levels=c.params[0].levels, anchor=torch.ones(H, D))
    )
    assert torch.equal(codes.transpose(0, 1), ref.codes)
    t, h, ch = 5, 1, 37
    bit = (int(words[h, t, ch // 16]) & 0xFFFFFFFF) >> (2 * (ch % 16)) & 3
    assert bit == int(ref.codes[t, h, ch])


def test_fork_copies_and_free_returns_pages() -> None:
    c = _cache("fp2", num_pages=4)
    k, v = _tokens(100)
    s = c.new_sequence()
    c.append(s, k, v)
    f = c.fork(s)
    assert torch.equal(c.gather(s)[0], c.gather(f)[0])
    kk, vv = _tokens(40, seed=9)
    c.append(f, kk, vv)
    assert c.seq_len(s) == 100 and c.seq_len(f) == 140
    used = c.allocator.num_free
    c.free(f)
    assert c.allocator.num_free > used
    with pytest.raises(KVInputError, match="unknown sequence"):
        c.gather(f)


@pytest.mark.parametrize("fmt", ["bf16", "fp2"])
def test_exhausted_pool_raises_capacity_error_and_writes_nothing(fmt: str) -> None:
    c = _cache(fmt, num_pages=2)
    s = c.new_sequence()
    k, v = _tokens(400)
    with pytest.raises(KVCapacityError, match="exhausted"):
        c.append(s, k, v)
    assert c.seq_len(s) == 0 and c.allocator.num_free == 2
    assert issubclass(KVCapacityError, ZerodramError)


def test_slots_exhausted() -> None:
    c = _cache("bf16", max_seqs=1)
    c.new_sequence()
    with pytest.raises(KVCapacityError, match="slots"):
        c.new_sequence()


@pytest.mark.parametrize(
    ("k", "match"),
    [
        (torch.zeros(3, H + 1, D), "must be"),
        (torch.zeros(3, H, D, dtype=torch.int32), "fp32, bf16 or fp16"),
        (torch.zeros(H, D), "must be"),
    ],
)
def test_bad_inputs(k: torch.Tensor, match: str) -> None:
    c = _cache("fp2")
    s = c.new_sequence()
    with pytest.raises(KVInputError, match=match):
        c.append(s, k, k)


def test_wrong_device_is_rejected() -> None:
    c = _cache("fp2", device="meta")
    s = c.new_sequence()
    with pytest.raises(KVInputError, match="lives on meta"):
        c.append(s, torch.zeros(1, H, D), torch.zeros(1, H, D))


def test_nan_rejected_and_not_written() -> None:
    c = _cache("fp2", layer_idx=3)
    s = c.new_sequence()
    k, v = _tokens(10)
    c.append(s, k, v)
    bad = torch.zeros(2, H, D)
    bad[1, 0, 5] = float("inf")
    with pytest.raises(KVInputError, match=r"layer 3, KV head 0, position 11"):
        c.append(s, bad, torch.zeros(2, H, D))
    assert c.seq_len(s) == 10


def test_unsupported_options_and_formats() -> None:
    with pytest.raises(ConfigError):
        _cache("int4")
    with pytest.raises(ConfigError, match="outliers"):
        _cache("fp2:kout=0.01")


@pytest.mark.parametrize("fmt", ["bf16", "fp2"])
def test_reference_decode_attention_gqa(fmt: str) -> None:
    c = _cache(fmt)
    seqs, lens = [], [5, 130]
    kv = {}
    for n in lens:
        s = c.new_sequence()
        k, v = _tokens(n, seed=n)
        c.append(s, k, v)
        seqs.append(s)
        kv[s] = c.gather(s)
    q = torch.randn(len(seqs), 2 * H, D)
    out = reference_decode_attention(q, c, seqs)
    for b, s in enumerate(seqs):
        k, v = kv[s]
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # [n, Hq, D]
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b], kk) / D**0.5, -1)
        assert torch.allclose(out[b], torch.einsum("hn,nhd->hd", p, vv), atol=1e-5)
    with pytest.raises(KVInputError, match="multiple"):
        reference_decode_attention(torch.randn(2, 3, D), c, seqs)


def _state(c) -> list[torch.Tensor]:
    """Every tensor a cache writes (pages, scales, offsets, the bf16 region's live rows; its rows
    past a sequence's tail, the scratch page and the scratch slot are unspecified)."""
    if c.format != "fp2":
        return [c.k_pages, c.v_pages]
    NP, slots = c.num_pages, c.tables.max_seqs
    hp_k, hp_v = c.hp_k[:slots].clone(), c.hp_v[:slots].clone()
    S = c.spec.num_sinks
    for slot, n in c.tables.lens.items():
        live = min(n, S) if n <= S else n - c.rule.num_quantized(n)  # sinks + tail rows
        hp_k[slot, :, live:] = 0
        hp_v[slot, :, live:] = 0
    out = [hp_k, hp_v]
    for side in (c.k, c.v):
        out += [side.codes[:NP], side.scales[:NP]] + ([side.offsets[:NP]] if side.offsets is not None else [])
    return out


@pytest.mark.parametrize(
    ("fmt", "device"),
    [(f, "cpu") for f in FORMATS]
    + [
        pytest.param(f, "cuda", marks=pytest.mark.gpu) for f in ("fp2", "fp2:tail=1,window=32")
    ],  # the CUDA kernels
)
def test_decode_append_equals_per_sequence_appends(fmt: str, device: str) -> None:
    """append_decode over a batch writes exactly what one append per sequence writes: sequences at
    different lengths (sinks, a filling tail, flushes, page boundaries), joining and leaving."""
    a, b = (_cache(fmt, num_pages=24, max_seqs=6, device=device) for _ in range(2))
    b2 = _cache(fmt, num_pages=24, max_seqs=6, device=device)  # a second "layer" of b's partition
    if hasattr(b, "index_memo"):
        b2.index_memo = b.index_memo  # as RuntimeKVPartition shares it: b2 reuses b's indices
    gen = torch.Generator().manual_seed(5)
    starts = [0, 3, 31, 46, 63, 90]  # prefilled lengths before the decode steps
    seqs = []
    for n0 in starts:
        sa, sb = a.new_sequence(), b.new_sequence()
        assert sa == sb == b2.new_sequence()
        if n0:
            k, v = (t.to(device) for t in _tokens(n0, seed=n0))
            a.append(sa, k, v)
            b.append(sb, k, v)
            b2.append(sb, k, v)
        seqs.append(sa)
    for step in range(70):
        live = [s for i, s in enumerate(seqs) if step < 40 or i % 2]  # half of them leave at step 40
        k = torch.randn(len(live), H, D, generator=gen).to(device)
        v = torch.randn(len(live), H, D, generator=gen).to(device)
        for i, s in enumerate(live):
            a.append(s, k[i : i + 1], v[i : i + 1])
        b.append_decode(live, k, v)
        b2.append_decode(live, k, v)
        assert [a.seq_len(s) for s in live] == [b.seq_len(s) for s in live]
        assert a.tables.pages == b.tables.pages == b2.tables.pages
    for ta, tb, tb2 in zip(_state(a), _state(b), _state(b2), strict=True):
        assert torch.equal(ta, tb) and torch.equal(ta, tb2)


@pytest.mark.parametrize(
    ("fmt", "device"),
    [
        ("fp2:tail=1,window=32", "cpu"),
        ("fp2:sinks=0,tail=1,window=0,scale=e8m0", "cpu"),
        pytest.param("fp2:tail=1,window=32", "cuda", marks=pytest.mark.gpu),
        pytest.param("fp2:fb=1,tail=1,window=47", "cuda", marks=pytest.mark.gpu),  # DEFAULT_FP2
        pytest.param(
            "fp2:fb=1,tail=1,window=7,blk=c32,scale=e8m0,krule=absmax", "cuda", marks=pytest.mark.gpu
        ),
    ],
)
def test_static_decode_write_equals_append_decode(fmt: str, device: str) -> None:
    """The fixed-shape decode write (host plan + device write over a padded batch, what a CUDA
    graph captures) leaves exactly the cache `append_decode` leaves: sinks, a filling window,
    flushes, page boundaries, sequences leaving; padding rows of garbage go to the scratch slot.
    On CUDA the write is the decode-write kernel (kernels/kv_write.py) and `append_decode` the
    torch reference; error feedback gets a random factor (calibration's shape, not its values)."""
    import dataclasses

    from zerodram.runtime.kv.decode_index import StaticDecodeIndex

    a = _cache(fmt, num_pages=24, max_seqs=6, device=device, static_kernel=False)  # the torch body
    b = _cache(fmt, num_pages=24, max_seqs=6, device=device)
    assert a._static_write is None and (b._static_write is not None) == (device == "cuda")
    if "fb=1" in fmt:
        g = torch.Generator().manual_seed(3)
        factor = (torch.eye(D) + 0.2 * torch.randn(H, D, D, generator=g).tril(-1)).transpose(1, 2)  # upper
        for c in (a, b):
            c.params = tuple(dataclasses.replace(p, feedback=factor) for p in c.params)
    gen = torch.Generator().manual_seed(7)
    seqs = []
    for n0 in (0, 3, 31, 46, 63, 90):
        sa, sb = a.new_sequence(), b.new_sequence()
        assert sa == sb
        if n0:
            k, v = (t.to(device) for t in _tokens(n0, seed=n0))
            a.append(sa, k, v)
            b.append(sb, k, v)
        seqs.append(sa)
    Bp = 8
    ix = StaticDecodeIndex.allocate(Bp, torch.device(device))
    k_in, v_in = (torch.zeros(Bp, H, D, device=device) for _ in range(2))  # a graph's static inputs
    graph = None
    if device == "cuda":  # the write captured once, replayed every step (what the engine does)
        ix.fill_scratch(b.scratch_slot, b.scratch_page)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b.write_decode_static(k_in, v_in, ix)  # warm-up, on scratch rows only
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b.write_decode_static(k_in, v_in, ix)
    for step in range(70):
        live = [s for i, s in enumerate(seqs) if step < 40 or i % 2]
        k = torch.randn(Bp, H, D, generator=gen).to(device) * 3  # rows past len(live): padding
        v = torch.randn(Bp, H, D, generator=gen).to(device) * 3
        a.append_decode(live, k[: len(live)], v[: len(live)])
        ix.fill(b.plan_decode_static(live), b.scratch_slot, b.scratch_page)
        k_in.copy_(k)
        v_in.copy_(v)
        if graph is None:
            b.write_decode_static(k_in, v_in, ix)
        else:
            graph.replay()
        assert [a.seq_len(s) for s in live] == [b.seq_len(s) for s in live]
    assert a.tables.pages == b.tables.pages
    for ta, tb in zip(_state(a), _state(b), strict=True):
        assert torch.equal(ta, tb)
    assert not _cache("fp2:tail=4,window=8").static_decode_ok
    with pytest.raises(ConfigError, match="flush 1"):
        _cache("fp2:tail=4,window=8").plan_decode_static([])


def test_mirrored_decode_plan_equals_planning_every_layer() -> None:
    """A partition plans a decode step on layer 0 and mirrors it on the others: the same pages and
    lengths as planning each layer, and a layer that has parted (another length, other pages)
    raises instead of writing where the plan says."""
    fmt = "fp2:tail=1,window=32"
    lead, own, mirror = (_cache(fmt, num_pages=24, max_seqs=6) for _ in range(3))
    seqs = []
    for n0 in (0, 3, 31, 46, 63, 90):
        for c in (lead, own, mirror):
            sid = c.new_sequence()
            if n0:
                c.append(sid, *_tokens(n0, seed=n0))
        seqs.append(sid)
    for step in range(70):
        live = [s for i, s in enumerate(seqs) if step < 40 or i % 2]
        assert own.plan_decode_static(live) == lead.plan_decode_static(live)
        mirror.mirror_decode_static(live, lead, live)
        assert mirror.tables.pages == own.tables.pages and mirror.tables.lens == own.tables.lens
    other = _cache(fmt, num_pages=24, max_seqs=6)
    other.new_sequence()  # a slot the lead does not have: this layer keeps seqs[0] in slot 1
    with pytest.raises(ZerodramError, match=r"slot 1, layer 0 in slot 0: .*parted"):
        other.mirror_decode_static([1], lead, [seqs[0]])
    one = [seqs[1]]  # at 73 tokens
    mirror.tables.lens[one[0]] -= 1
    lead.plan_decode_static(one)
    with pytest.raises(ZerodramError, match=r"holds 72 tokens, layer 0's 73: .*parted"):
        mirror.mirror_decode_static(one, lead, one)
    mirror.tables.lens[one[0]] = lead.tables.lens[one[0]]
    mirror.allocator.allocate(1)  # the mirror's pool moves alone: its next page differs
    while len(lead.tables.pages[one[0]]) == len(mirror.tables.pages[one[0]]):
        lead.plan_decode_static(one)
        if len(lead.tables.pages[one[0]]) == len(mirror.tables.pages[one[0]]):
            mirror.mirror_decode_static(one, lead, one)
    with pytest.raises(ZerodramError, match=r"holds pages .*parted"):
        mirror.mirror_decode_static(one, lead, one)


def test_decode_append_refuses_and_writes_nothing() -> None:
    c = _cache("fp2", num_pages=3, layer_idx=2)
    s0, s1 = c.new_sequence(), c.new_sequence()
    k, v = _tokens(40)
    c.append(s0, k, v)
    before = [t.clone() for t in _state(c)]
    bad = torch.zeros(2, H, D)
    bad[1, 1, 7] = float("nan")
    with pytest.raises(KVInputError, match=r"layer 2, KV head 1, position 0"):
        c.append_decode([s0, s1], torch.zeros(2, H, D), bad)
    with pytest.raises(KVInputError, match="twice"):
        c.append_decode([s0, s0], torch.zeros(2, H, D), torch.zeros(2, H, D))
    with pytest.raises(KVInputError, match=r"\[2, H, D\]"):
        c.append_decode([s0, s1], torch.zeros(3, H, D), torch.zeros(3, H, D))
    assert (c.seq_len(s0), c.seq_len(s1)) == (40, 0)
    assert all(torch.equal(x, y) for x, y in zip(before, _state(c), strict=True))


@pytest.mark.parametrize("fmt", ["bf16", "fp2"])
def test_decode_append_zero_mode_flags_rows_without_raising(fmt: str) -> None:
    """on_nonfinite="zero": no exception and no host sync; the bad row is stored as zeros (what an
    append of zeros stores) and flagged, the other rows are stored as given."""
    a, b = _cache(fmt, num_pages=8), _cache(fmt, num_pages=8)
    s = [a.new_sequence(), a.new_sequence()]
    assert s == [b.new_sequence(), b.new_sequence()]
    k, v = _tokens(2, seed=9)
    bad_k = k.clone()
    bad_k[1, 0, 3] = float("nan")
    flags = a.append_decode(s, bad_k, v, on_nonfinite="zero")
    assert flags.tolist() == [False, True]
    clean_k = k.clone()
    clean_k[1, 0, 3] = 0.0
    b.append_decode(s, clean_k, v)
    assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b), strict=True))
    with pytest.raises(ConfigError, match="on_nonfinite"):
        a.append_decode(s, k, v, on_nonfinite="skip")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp2"])
def test_gather_batch_equals_per_sequence_gathers(fmt: str) -> None:
    """One batched read (dense pages: one page gather) = each sequence's gather, zero-padded."""
    c = _cache(fmt, num_pages=16, max_seqs=4)
    lens = [70, 1, 0, 129]
    seqs = []
    for i, n in enumerate(lens):
        s = c.new_sequence()
        if n:
            k, v = _tokens(n, seed=i)
            c.append(s, k, v)
        seqs.append(s)
    want = [c.gather(s) for s in seqs]
    use = [60, 1, 0, 129]  # a prefix of the first sequence, all of the others
    k, v = c.gather_batch(seqs, use)
    assert k.shape == v.shape == (4, 129, H, D)
    for i, n in enumerate(use):
        for got, ref in ((k, want[i][0]), (v, want[i][1])):
            assert torch.equal(got[i, :n].float(), ref[:n].float())
            assert not got[i, n:].float().any()  # padding is zero


@pytest.mark.parametrize("fmt", ["fp2", "fp2:tail=1,window=8", "fp2:kblk=t32,vblk=c32,scale=e8m0,rot=0"])
def test_value_pages_in_the_quad_layout_hold_the_token_layout_s_codes(fmt: str, monkeypatch) -> None:
    """Channel-block values are stored in the quad layout (docs/fp2-format.md): the same codes as a
    cache that keeps the token layout, byte-permuted, and both read back the same."""
    from zerodram.runtime.kv import fp2_cache
    from zerodram.runtime.kv.pack import token_to_quad

    quad = _cache(fmt)
    monkeypatch.setattr(fp2_cache, "value_layout", lambda *a: "token")
    token = _cache(fmt)
    assert (quad.v.layout, token.v.layout, quad.k.layout) == ("quad", "token", "token")
    k, v = _tokens(150, seed=5)
    for c in (quad, token):
        s = c.new_sequence()
        c.append(s, k[:100], v[:100])
        for i in range(100, 150):  # and token by token (the decode append)
            c.append_decode([s], k[i : i + 1], v[i : i + 1])
    assert torch.equal(quad.v.codes, token_to_quad(token.v.codes))
    assert torch.equal(quad.k.codes, token.k.codes)
    for a, b in zip(quad.gather(0), token.gather(0), strict=True):
        assert torch.equal(a, b)


def test_values_no_kernel_reads_keep_the_token_layout() -> None:
    for fmt in ("fp2:vblk=t32", "fp2:asym=1", "fp2:scale=bf16", "fp2:vcenter=1", "fp2:vblk=c8"):
        assert _cache(fmt).v.layout == "token", fmt
