"""The quality harness without a model: its attention equals the plain definitions, and its
fake-quantizing codecs read back exactly what the paged cache holds.

Dimensions: T tokens, H KV heads, Hq query heads, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.cache import make_kv_cache
from zerodram.runtime.kv.codecs import make_codec
from zerodram.runtime.kv.errors import KVCapacityError, KVInputError
from zerodram.runtime.kv.feedback import feedback_codes, feedback_factor
from zerodram.runtime.kv.format import TailRule, parse_kv_spec, tail_rule
from zerodram.runtime.kv.levels import named_levels, nearest_code
from zerodram.runtime.kv.params import LayerSample
from zerodram.runtime.kv_eval.hook import _masked_attention, codec_attention, full_precision_mask

H, D = 2, 64
FAST = settings(max_examples=10, deadline=None)


def _qkv(T: int, Hq: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Hq, T, D, generator=gen)
    k, v, kh, vh = (torch.randn(H, T, D, generator=gen) for _ in range(4))
    return q, k, v, kh, vh


def _definition(q, k, v, kh, vh, rule: TailRule, scaling: float) -> torch.Tensor:
    """Query i over keys j <= i, full-precision copies where `full_precision_mask` says. [T, Hq, D]"""
    Hq, T, _ = q.shape
    G = Hq // H
    fp = full_precision_mask(T, rule, slice(0, T), "cpu")  # [T, T]
    kk = torch.where(fp[None, :, :, None], k[:, None], kh[:, None]).repeat_interleave(G, 0)  # [Hq, T, T, D]
    vv = torch.where(fp[None, :, :, None], v[:, None], vh[:, None]).repeat_interleave(G, 0)
    s = torch.einsum("hid,hijd->hij", q, kk) * scaling
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hij,hijd->hid", s.softmax(-1), vv).transpose(0, 1)


@FAST
@given(
    st.integers(1, 200),
    st.integers(0, 5),
    st.integers(0, 40),
    st.sampled_from([1, 8, 32]),
    st.integers(0, 2**31 - 1),
)
def test_codec_attention_matches_definition(T: int, sinks: int, window: int, flush: int, seed: int) -> None:
    """The fused (LSE-merged) path and the masked fallback both equal the per-query definition."""
    rule = TailRule(sinks, window, flush)
    q, k, v, kh, vh = _qkv(T, 2 * H, seed)
    want = _definition(q, k, v, kh, vh, rule, 0.125)
    got = codec_attention(q, k, v, kh, vh, scaling=0.125, rule=rule, exact=False)
    assert torch.allclose(got, want, atol=2e-5), float((got - want).abs().max())
    G = 2
    rep = [x.repeat_interleave(G, 0) for x in (k, v, kh, vh)]
    masked = _masked_attention(q, *rep, 0.125, rule, None, None)
    assert torch.allclose(masked, want, atol=2e-5)


def test_codec_attention_exact_and_identity() -> None:
    """Identical quantized and full-precision copies give plain causal attention."""
    q, k, v, _, _ = _qkv(100, 2 * H, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None], k.repeat_interleave(2, 0)[None], v.repeat_interleave(2, 0)[None], is_causal=True
    )[0].transpose(0, 1)
    for exact in (True, False):
        out = codec_attention(q, k, v, k, v, scaling=D**-0.5, rule=TailRule(4, 0, 32), exact=exact)
        assert torch.allclose(out, ref, atol=2e-5)


@pytest.mark.parametrize("kv", ["int4", "kivi2", "fp2", "fp2:tail=1,window=32"])
def test_full_precision_mask_follows_the_tail_rule(kv: str) -> None:
    """Query i reads key j in full precision iff the cache would still hold j in 16 bits at n = i + 1."""
    rule = tail_rule(parse_kv_spec(kv).spec)
    T = 300
    fp = full_precision_mask(T, rule, slice(0, T), "cpu")
    for i in (0, 3, 4, 35, 36, 127, 128, 160, 299):
        n_q = rule.num_quantized(i + 1)
        s = min(rule.num_sinks, i + 1)
        want = [j < s or j >= s + n_q for j in range(T)]
        assert fp[i].tolist() == want


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=gen) * torch.rand(1, H, D, generator=gen) * 3
    v = torch.randn(n, H, D, generator=gen)
    return k, v


CACHE_SPECS = [
    "fp2",
    "fp2:blk=c32,levels=sig,rule=absmax,rot=0",
    "fp2:kblk=t32,vblk=c16,scale=e8m0,asym=1",
    "fp2:rule=rms,sinks=0,tail=64",
    "fp2:tail=16,window=16,kblk=t16",
    "fp2:fb=1,center=1,kanchor=score,levels=cal",
    "fp2:kfb=1,kblk=t32,kasym=1,vfb=1,vrot=0",
]


def _sample(seed: int, G: int = 2) -> LayerSample:
    """Synthetic calibration data: queries with a mean direction, keys with an offset."""
    gen = torch.Generator().manual_seed(seed)
    T = 128
    q = torch.randn(T, H, G, D, generator=gen) + 2 * torch.randn(1, H, 1, D, generator=gen)
    k, v = _tokens(T, seed + 1)
    return LayerSample(q=q, k=k + 1.5, v=v, o_proj=torch.randn(32, H * G * D, generator=gen))


@FAST
@given(st.sampled_from(CACHE_SPECS), st.integers(1, 260), st.integers(0, 2**31 - 1))
def test_codec_reads_back_what_the_paged_cache_holds(kv: str, n: int, seed: int) -> None:
    """Harness (whole-sequence fake quantization) == paged cache (token-by-token) on FP2 tokens;
    the 16-bit tokens differ only by the cache's bf16 storage. Calibrated constants included."""
    spec = parse_kv_spec(kv).spec
    k, v = _tokens(n, seed)
    codec = make_codec(spec, num_layers=1, num_kv_heads=H, head_dim=D, samples={0: _sample(seed)})
    cache = make_kv_cache(kv, num_pages=8, num_kv_heads=H, head_dim=D, params=codec.params[0])
    sid = cache.new_sequence()
    cache.append(sid, k, v)
    ck, cv = cache.gather(sid)
    hk, hv = codec.fake_kv(0, k, v)
    a, b = codec.quantized_span(n)
    assert (a, b) == (min(spec.num_sinks, n), min(spec.num_sinks, n) + cache.rule.num_quantized(n))
    for c, h, x in ((ck, hk, k), (cv, hv, v)):
        assert torch.allclose(c[a:b], h[a:b], atol=1e-5, rtol=1e-5)
        hp = torch.cat([c[:a], c[b:]]) - torch.cat([x[:a], x[b:]])
        assert hp.numel() == 0 or float(hp.abs().max()) <= 0.02 * float(x.abs().max())  # bf16 rounding


def test_fake_quantized_values_are_used_only_where_quantized() -> None:
    spec = parse_kv_spec("fp2:sinks=4,tail=32").spec
    k, v = _tokens(90, 1)  # 4 sinks, 64 FP2 tokens (two flushes of 32), a tail of 22
    hk, _ = make_codec(spec, num_layers=1, num_kv_heads=H, head_dim=D).fake_kv(0, k, v)
    assert torch.equal(hk[:4], k[:4]) and torch.equal(hk[68:], k[68:])
    assert not torch.allclose(hk[4:68], k[4:68], atol=1e-2)


@FAST
@given(st.integers(1, 6), st.lists(st.integers(1, 150), min_size=1, max_size=5))
def test_page_pool_exhaustion_is_exact_and_atomic(num_pages: int, chunks: list[int]) -> None:
    """An append either fits (pages for every FP2 token) or raises and leaves the cache unchanged."""
    cache = make_kv_cache("fp2", num_pages=num_pages, num_kv_heads=H, head_dim=D)
    sid = cache.new_sequence()
    n = 0
    for c in chunks:
        k, v = _tokens(c, c)
        need = -(-cache.rule.num_quantized(n + c) // cache.page_size)
        if need > num_pages:
            before = cache.gather(sid)
            with pytest.raises(KVCapacityError, match=r"exhausted|block table"):
                cache.append(sid, k, v)
            after = cache.gather(sid)
            assert cache.seq_len(sid) == n and all(
                torch.equal(x, y) for x, y in zip(before, after, strict=True)
            )
        else:
            cache.append(sid, k, v)
            n += c
        assert cache.allocator.num_free == num_pages - len(cache.tables.pages[sid])


@FAST
@given(
    st.sampled_from(["bf16", "fp8", "fp2"]),
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int32, torch.float64]),
)
def test_wrong_shapes_and_dtypes_name_the_expected(fmt: str, shape: list[int], dtype: torch.dtype) -> None:
    """Never [T, 2, 64]: every such append raises, names what was expected, and writes nothing."""
    cache = make_kv_cache(fmt, num_pages=2, page_size=64, num_kv_heads=H, head_dim=D)
    sid = cache.new_sequence()
    x = torch.zeros(shape, dtype=dtype)
    with pytest.raises(KVInputError, match=r"\[T, 2, 64\]|fp32, bf16 or fp16"):
        cache.append(sid, x, x)
    assert cache.seq_len(sid) == 0

@FAST
@given(st.integers(0, 2**31 - 1), st.sampled_from(["lm", "sig"]))
def test_feedback_lowers_the_weighted_error(seed: int, levels: str) -> None:
    """Error feedback trades |e|^2 for e^T W e: lower weighted error than nearest rounding when W is
    anisotropic; identical codes when W is diagonal (nothing to feed forward)."""
    gen = torch.Generator().manual_seed(seed)
    T, Hh = 256, 2
    lv = named_levels(levels)
    y = torch.randn(T, Hh, D, generator=gen)
    s = y.abs().amax(-1, keepdim=True).expand_as(y) / float(lv.abs().max())
    mu = torch.randn(Hh, D, 1, generator=gen)
    w = mu @ mu.transpose(1, 2) + 0.05 * torch.eye(D)  # [Hh, D, D]: one dominant direction
    near = lv[nearest_code(y / s, lv).long()] * s
    fb = lv[feedback_codes(y, s, None, lv, feedback_factor(w)).long()] * s
    werr = lambda yh: torch.einsum("thd,hde,the->", y - yh, w, y - yh)  # noqa: E731
    assert float(werr(fb)) < 0.7 * float(werr(near))
    diag = feedback_codes(
        y, s, None, lv, feedback_factor(torch.diag_embed(torch.rand(Hh, D, generator=gen) + 0.1))
    )
    assert torch.equal(diag, nearest_code(y / s, lv))


@FAST
@given(st.integers(0, 2**31 - 1), st.sampled_from([16, 32]))
def test_feedback_in_blocks_is_one_chain_per_block(seed: int, block: int) -> None:
    """`fbblk`: the factor of W's diagonal blocks is block diagonal, and the one chain over the
    head gives, bit for bit, the codes of a chain run on each block alone (what a writer running the
    blocks side by side computes); on an anisotropic W it still beats nearest rounding; a block
    that does not divide the head dim is refused."""
    gen = torch.Generator().manual_seed(seed)
    T, Hh = 64, 2
    lv = named_levels("lm")
    y = torch.randn(T, Hh, D, generator=gen)
    s = y.abs().amax(-1, keepdim=True).expand_as(y) / float(lv.abs().max())
    a = torch.randn(Hh, D, 4, generator=gen)
    w = a @ a.transpose(1, 2) + 0.05 * torch.eye(D)  # [Hh, D, D], dense
    f = feedback_factor(w, block=block)
    blk = torch.arange(D) // block
    assert torch.all(f[:, blk[:, None] != blk[None, :]] == 0)
    codes = feedback_codes(y, s, None, lv, f)
    for b0 in range(0, D, block):
        sl = slice(b0, b0 + block)
        alone = feedback_codes(y[..., sl].contiguous(), s[..., sl].contiguous(), None, lv, f[:, sl, sl].contiguous())
        assert torch.equal(codes[..., sl], alone)
    near = lv[nearest_code(y / s, lv).long()] * s
    werr = lambda yh: torch.einsum("thd,hde,the->", y - yh, w, y - yh)  # noqa: E731
    assert float(werr(lv[codes.long()] * s)) < 0.7 * float(werr(near))
    with pytest.raises(ConfigError, match="do not divide"):
        feedback_factor(w, block=24)
