"""Paged caches: token-by-token equals chunked appends, fork/free, errors, reference attention,
batched gathers, the quad value layout. The decode-time writes are test_kv_decode_write.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cases import FORMATS, D, H, kv_tokens, make_cache

from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.kv.attention import reference_decode_attention
from zerodram.runtime.kv.errors import KVCapacityError, KVInputError
from zerodram.runtime.kv.pack import unpack_codes


@settings(max_examples=6, deadline=None)
@given(st.sampled_from(FORMATS), st.integers(1, 200), st.lists(st.integers(1, 70), min_size=1, max_size=4))
def test_token_by_token_equals_chunks(fmt: str, n: int, chunks: list[int]) -> None:
    k, v = kv_tokens(n)
    a, b = make_cache(fmt), make_cache(fmt)
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
    k, v = kv_tokens(300, seed=1)
    c = make_cache(fmt)
    s = c.new_sequence()
    c.append(s, k, v)
    kh, vh = c.gather(s)
    assert kh.shape == k.shape
    assert float((kh - k).norm() / k.norm()) < tol
    assert float((vh - v).norm() / v.norm()) < tol


def test_fp2_sinks_and_tail_stay_high_precision() -> None:
    c = make_cache("fp2:sinks=4,tail=32")
    k, v = kv_tokens(4 + 64 + 10)
    s = c.new_sequence()
    c.append(s, k, v)
    kh, _ = c.gather(s)
    bf = lambda x: float((kh[x] - k[x]).abs().max())  # noqa: E731
    assert bf(slice(0, 4)) < 0.05 and bf(slice(68, 78)) < 0.05  # bf16 rows (rotation rounding)
    assert bf(slice(4, 68)) > 0.1  # quantized
    assert len(c.tables.pages[s]) == 1  # 64 FP2 tokens: exactly one page


@pytest.mark.parametrize(("fmt", "no_window"), [
    ("fp2:tail=1,window=32", "fp2:tail=1,window=0"),
    ("fp2:kblk=t16,tail=16,window=8", "fp2:kblk=t16,tail=16,window=0"),
])  # fmt: skip
def test_fp2_codes_are_written_at_arrival(fmt: str, no_window: str) -> None:
    """A token's codes go to its page row when it arrives (its F-token group when complete), not
    when it leaves the window: the pages of a cache with a window equal, row for row, those of the
    same format without one (where every token is attended as FP2 as soon as its group is
    complete), the tail's tokens included, whether appended as one chunk or token by token."""
    n = 4 + 150  # sinks, then groups that complete and one that does not
    k, v = kv_tokens(n, seed=7)
    a, b, z = make_cache(fmt), make_cache(fmt), make_cache(no_window)
    sa, sb, sz = a.new_sequence(), b.new_sequence(), z.new_sequence()
    a.append(sa, k, v)
    for i in range(n):
        b.append(sb, k[i : i + 1], v[i : i + 1])
    z.append(sz, k, v)
    coded = a._coded(n)
    assert a.rule.num_quantized(n) < coded == z.rule.num_quantized(n)  # tail tokens are coded
    assert a.tables.pages[sa] == b.tables.pages[sb] == z.tables.pages[sz]
    idx = torch.tensor(a.tables.pages[sa])
    for side in ("k", "v"):
        pa, pb, pz = (getattr(c, side) for c in (a, b, z))
        tok = 1 if pa.side.block_axis == "channel" else pa.side.block_size  # tokens per scale row
        # codes [pages, H, P, D] -> [tokens, H, D]; scale rows [pages, H, P / tok, NB] -> [rows, H, NB]
        codes = [x.load(idx).transpose(1, 2).flatten(0, 1)[:coded] for x in (pa, pb, pz)]
        scales = [x.scales[idx].transpose(1, 2).flatten(0, 1)[: coded // tok] for x in (pa, pb, pz)]
        for got in (codes, scales):
            assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[2]), side


def test_fp2_pages_match_documented_layout() -> None:
    """Word codes[p, h, t, c // 16] bits 2*(c % 16) hold the code of (t, h, c)."""
    from zerodram.runtime.kv.quantize import quantize_tokens, to_stored_space

    c = make_cache("fp2:sinks=0,tail=64,rot=0")
    k, v = kv_tokens(64, seed=3)
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
    c = make_cache("fp2", num_pages=4)
    k, v = kv_tokens(100)
    s = c.new_sequence()
    c.append(s, k, v)
    f = c.fork(s)
    assert torch.equal(c.gather(s)[0], c.gather(f)[0])
    kk, vv = kv_tokens(40, seed=9)
    c.append(f, kk, vv)
    assert c.seq_len(s) == 100 and c.seq_len(f) == 140
    used = c.allocator.num_free
    c.free(f)
    assert c.allocator.num_free > used
    with pytest.raises(KVInputError, match="unknown sequence"):
        c.gather(f)


@pytest.mark.parametrize("fmt", ["bf16", "fp2"])
def test_exhausted_pool_raises_capacity_error_and_writes_nothing(fmt: str) -> None:
    c = make_cache(fmt, num_pages=2)
    s = c.new_sequence()
    k, v = kv_tokens(400)
    with pytest.raises(KVCapacityError, match="exhausted"):
        c.append(s, k, v)
    assert c.seq_len(s) == 0 and c.allocator.num_free == 2
    assert issubclass(KVCapacityError, ZerodramError)


def test_slots_exhausted() -> None:
    c = make_cache("bf16", max_seqs=1)
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
    c = make_cache("fp2")
    s = c.new_sequence()
    with pytest.raises(KVInputError, match=match):
        c.append(s, k, k)


def test_wrong_device_is_rejected() -> None:
    c = make_cache("fp2", device="meta")
    s = c.new_sequence()
    with pytest.raises(KVInputError, match="lives on meta"):
        c.append(s, torch.zeros(1, H, D), torch.zeros(1, H, D))


def test_nan_rejected_and_not_written() -> None:
    c = make_cache("fp2", layer_idx=3)
    s = c.new_sequence()
    k, v = kv_tokens(10)
    c.append(s, k, v)
    bad = torch.zeros(2, H, D)
    bad[1, 0, 5] = float("inf")
    with pytest.raises(KVInputError, match=r"layer 3, KV head 0, position 11"):
        c.append(s, bad, torch.zeros(2, H, D))
    assert c.seq_len(s) == 10


def test_unsupported_options_and_formats() -> None:
    with pytest.raises(ConfigError):
        make_cache("int4")
    with pytest.raises(ConfigError, match="outliers"):
        make_cache("fp2:kout=0.01")


@pytest.mark.parametrize("fmt", ["bf16", "fp2"])
def test_reference_decode_attention_gqa(fmt: str) -> None:
    c = make_cache(fmt)
    seqs, lens = [], [5, 130]
    kv = {}
    for n in lens:
        s = c.new_sequence()
        k, v = kv_tokens(n, seed=n)
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


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp2"])
def test_gather_batch_equals_per_sequence_gathers(fmt: str) -> None:
    """One batched read (dense pages: one page gather) = each sequence's gather, zero-padded."""
    c = make_cache(fmt, num_pages=16, max_seqs=4)
    lens = [70, 1, 0, 129]
    seqs = []
    for i, n in enumerate(lens):
        s = c.new_sequence()
        if n:
            k, v = kv_tokens(n, seed=i)
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


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp2", "fp2:tail=1,window=8"])
def test_gather_batch_refuses_lengths_past_the_sequence(fmt: str) -> None:
    """A length beyond a sequence's stored tokens would read pages it does not hold (another
    sequence's, or page 0) or give a short row: refused, naming both numbers."""
    c = make_cache(fmt, num_pages=8, max_seqs=4)
    a, b = c.new_sequence(), c.new_sequence()
    for s, n, seed in ((a, 70, 1), (b, 3, 2)):  # a holds pages 0 and 1, b page 2
        c.append(s, *kv_tokens(n, seed=seed))
    for lens in ([70, 4], [70, 65], [70, -1]):
        with pytest.raises(KVInputError, match=rf"gather of {lens[1]} tokens of sequence {b}, which holds 3"):
            c.gather_batch([a, b], lens)
    with pytest.raises(KVInputError, match="unknown sequence"):
        c.gather_batch([a, 3], [1, 0])
    k, _ = c.gather_batch([b, a], [3, 70])  # at the sequence's length: served
    assert k.shape == (2, 70, H, D) and torch.equal(k[0, :3].float(), c.gather(b)[0].float())


@pytest.mark.parametrize("fmt", ["fp2", "fp2:tail=1,window=8", "fp2:kblk=t32,vblk=c32,scale=e8m0,rot=0"])
def test_value_pages_in_the_quad_layout_hold_the_token_layout_s_codes(fmt: str, monkeypatch) -> None:
    """Channel-block values are stored in the quad layout (docs/fp2-format.md): the same codes as a
    cache that keeps the token layout, byte-permuted, and both read back the same."""
    from zerodram.runtime.kv import fp2_cache
    from zerodram.runtime.kv.pack import token_to_quad

    quad = make_cache(fmt)
    monkeypatch.setattr(fp2_cache, "value_layout", lambda *a: "token")
    token = make_cache(fmt)
    assert (quad.v.layout, token.v.layout, quad.k.layout) == ("quad", "token", "token")
    k, v = kv_tokens(150, seed=5)
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
        assert make_cache(fmt).v.layout == "token", fmt
