"""Shared by the attention tests (test_attention.py on CPU, test_attention_gpu.py on the GPU): a
decode-attention module of test size, the relative error the GPU checks use, and a real
runtime/kv FP2 cache with the kernel-side view of its decode.

Shape legend: Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, P page size.
"""

from __future__ import annotations

import math

import torch

from zerodram.runtime.attention import Fp2DecodeAttention, random_decode_batch, random_fp2_layer


def make_attention(
    device: str, *, Hq: int = 8, Hkv: int = 2, D: int = 128, P: int = 64, max_tokens: int = 4096, **kw
):
    """A decode-attention module for up to 8 sequences of up to max_tokens FP2 tokens each."""
    return Fp2DecodeAttention(
        num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=P, max_batch=8, max_fp2_tokens=max_tokens,
        device=device, **kw,
    )  # fmt: skip


def paged_case(lengths: list[int], hp: list[int], seed: int, *, Hkv: int, P: int, D: int, device: str,
               hp_max: int = 36, **layer_kw):
    """(layer, batch, generator): random FP2 pages for `lengths` FP2 tokens and `hp` bf16 tokens per
    sequence (exactly the pages they need), drawn from a fresh generator seeded with `seed`, which
    is returned for the test's further draws."""
    pages = sum(math.ceil(n / P) for n in lengths)
    gen = torch.Generator(device=device).manual_seed(seed)
    layer = random_fp2_layer(pages, Hkv, P, D, device=device, generator=gen, **layer_kw)
    batch = random_decode_batch(lengths, hp, pages, Hkv, P, D, hp_max=hp_max, device=device, generator=gen)
    return layer, batch, gen


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kv_cache_case(device: str, lengths: list[int], D: int = 128, Hkv: int = 2, G: int = 4):
    """A real runtime/kv Fp2KVCache filled with random tokens, and its kernel-side views."""
    from zerodram.runtime.kv.format import parse_kv_spec
    from zerodram.runtime.kv.fp2_cache import Fp2KVCache

    spec = parse_kv_spec("fp2").spec
    pages = sum(math.ceil(n / spec.page_size) for n in lengths) + 2
    cache = Fp2KVCache(
        spec=spec, num_pages=pages, page_size=spec.page_size, num_kv_heads=Hkv, head_dim=D,
        max_seqs=len(lengths) + 1, device=device,
    )  # fmt: skip
    g = torch.Generator(device=device).manual_seed(sum(lengths))
    sids = []
    for n in lengths:
        sid = cache.new_sequence()
        k = torch.randn(n, Hkv, D, device=device, generator=g) * 2
        cache.append(sid, k, torch.randn(n, Hkv, D, device=device, generator=g))
        sids.append(sid)
    q = torch.randn(len(lengths), G * Hkv, D, device=device, generator=g)
    return cache, sids, q


def kernel_side(att, cache, sids, q, G):
    from zerodram.runtime.attention import batch_from_cache, finish_output, layer_from_cache, prepare_query

    kp, vp = cache.params
    layer, batch = layer_from_cache(cache), batch_from_cache(cache, sids)
    att.check_tables(layer, batch)
    o = att(prepare_query(q, kp.rotation, kp.anchor, G), layer, batch)
    return finish_output(o, vp.rotation, vp.anchor, G)


def e4m3_product_bound(
    q: torch.Tensor, layer, batch, softmax_scale: float, scale_dtype: str = "e4m3", headroom: int = 0
) -> torch.Tensor:
    """[B, Hq, D] fp32: how far an FP8 value product (reference.py, VALUE_PRODUCTS "e4m3") may move
    each output element from the exact attention. Each FP2 token's weight times value scale is
    rounded to e4m3 after a shift 2^c that puts the row's largest scale at 2^7..2^8 (a kernel's
    running shift is at least that, and its running max at most the row's, which only shrinks the
    error): within 2^-4 of itself in e4m3's normal range, within 2^-10 (half the subnormal step)
    below. So |o - o_exact| <= (2^-4 sum_t w_t |v_t| + 2^-10 2^-c sum_t |L_t|) / sum_t w_t with
    w = exp(logit - row max) over all tokens (bf16 ones exact) and v = L s the dequantized FP2 value.
    headroom: binades a kernel keeps free above the largest product (its shift 2^c that much lower),
    which scales the subnormal term by 2^headroom."""
    from zerodram.runtime.attention.reference import sequence_kv

    B, Hq, D = q.shape
    Hkv = layer.k_codes.shape[1]
    out = torch.zeros(B, Hq, D)
    for b in range(B):
        sk = sequence_kv(layer, batch, b, scale_dtype)
        n, lev, sc = sk.num_fp2, sk.v_levels.cpu(), sk.v_scales.cpu()  # [Hkv, n, D], [Hkv, n, NB]
        if not n:
            continue
        logits = (q[b].float().cpu().view(Hkv, Hq // Hkv, D) @ sk.k.cpu().transpose(1, 2)) * softmax_scale
        w = torch.exp(logits - logits.amax(-1, keepdim=True))  # [Hkv, G, L]
        inv_c = torch.exp2(torch.ceil(torch.log2(sc.amax(1))) - 8 + headroom)  # [Hkv, NB]: 2^-c per value block
        under = (lev.abs().unflatten(-1, (sc.shape[-1], -1)) * inv_c[:, None, :, None]).flatten(-2).sum(1)  # [Hkv, D]
        bound = (2.0**-4 * w[..., :n] @ sk.v[:, :n].cpu().abs() + 2.0**-10 * under[:, None]) / w.sum(-1, keepdim=True)
        out[b] = bound.reshape(Hq, D)
    return out

