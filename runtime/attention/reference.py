"""The plain-torch definition of FP2 decode attention, which the kernels are tested against, and
the [D, D] products around it (the query into the stored key space, the output back).

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, NP pages, P page
size, HP bf16 tokens per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodram.runtime.attention.inputs import DecodeBatch, Fp2Layer
from zerodram.runtime.kv.pack import quad_to_token, unpack_codes

LOG2E = 1.4426950408889634


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
    y, s = _levels_and_scales(codes, scales_raw, levels, scale_dtype)
    return (y.unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2)


def token_layout(words: torch.Tensor, layout: str) -> torch.Tensor:
    """Value pages [..., P, D/16] in `layout` (an `Fp2Layer.v_layout`) -> the same pages in the
    token layout."""
    return quad_to_token(words) if layout == "quad" else words


def _levels_and_scales(
    codes: torch.Tensor, scales_raw: torch.Tensor, levels: torch.Tensor, scale_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [..., D/16], scales [..., NB] -> (levels of the codes [..., D], scales [..., NB]) fp32."""
    from zerodram.runtime.kv.scales import decode_scale

    return levels.to(codes.device)[unpack_codes(codes).long()], decode_scale(scales_raw, scale_dtype)


# How the weights meet the values in the FP2 tokens' output product. "exact": fp32, the definition
# (today's kernels round P times the value scale to fp16 and stay within 3e-3 of it). "e4m3": what
# an FP8 value product would compute (docs/fp2-kernel.md, "An FP8 value product"): each FP2 token's
# weight p = 2^(logit - row max) <= 1 times its value scale, times 2^c, rounded to e4m3, with c per
# (KV head, value block) putting the row's largest scale at 2^8 (so nothing saturates at 448 and
# products down to 2^-14 of the largest keep e4m3's normal 3 bits); the sum of weights stays exact.
# The bf16 tokens keep exact weights (their own CTA). CPU reference only: no kernel computes it yet.
VALUE_PRODUCTS = ("exact", "e4m3")


def reference_decode(
    q: torch.Tensor,
    layer: Fp2Layer,
    batch: DecodeBatch,
    softmax_scale: float,
    scale_dtype: str,
    value_product: str = "exact",
) -> torch.Tensor:
    """Dequantize every sequence's FP2 pages, add its bf16 tokens, fp32 attention. -> [B, Hq, D] fp32.

    q [B, Hq, D] in the stored key space. The plain-torch definition the kernels are tested against;
    value_product (VALUE_PRODUCTS, above) "e4m3" rounds the FP2 tokens' weighted values as an FP8
    value product would.
    """
    if value_product not in VALUE_PRODUCTS:
        raise ValueError(f"value_product must be one of {VALUE_PRODUCTS}, got {value_product!r}")
    B, Hq, D = q.shape
    Hkv = layer.k_codes.shape[1]
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        sk = sequence_kv(layer, batch, b, scale_dtype)
        logits = (q[b].float().view(Hkv, G, D) @ sk.k.transpose(1, 2)) * softmax_scale  # [Hkv, G, L]
        n = sk.num_fp2
        if not logits.shape[-1]:
            out[b] = 0.0
        elif value_product == "exact" or not n:
            out[b] = (torch.softmax(logits, -1) @ sk.v).reshape(Hq, D)
        else:
            w = torch.exp(logits - logits.amax(-1, keepdim=True))  # [Hkv, G, L], <= 1
            o = _e4m3_value_product(w[..., :n], sk.v_levels, sk.v_scales) + w[..., n:] @ sk.v[:, n:]  # [Hkv, G, D]
            out[b] = (o / w.sum(-1, keepdim=True)).reshape(Hq, D)
    return out


@dataclass(frozen=True)
class SequenceKV:
    """One sequence's keys and values as the reference reads them: k, v [Hkv, L, D] fp32 (its
    num_fp2 FP2 tokens dequantized, then its bf16 tokens), and the FP2 values as their levels
    [Hkv, num_fp2, D] and scales [Hkv, num_fp2, NB] (v = levels times scales, per block)."""

    k: torch.Tensor
    v: torch.Tensor
    v_levels: torch.Tensor
    v_scales: torch.Tensor
    num_fp2: int


def sequence_kv(layer: Fp2Layer, batch: DecodeBatch, b: int, scale_dtype: str) -> SequenceKV:
    """Sequence b's tokens gathered through its block table (the reference's view; any device)."""
    P = layer.k_codes.shape[2]
    n = int(batch.fp2_len[b])
    pages = batch.block_table[b, : (n + P - 1) // P].long()

    def rows(x: torch.Tensor) -> torch.Tensor:  # the pages [pages, Hkv, P, ...] -> [Hkv, n, ...]
        return x[pages].transpose(0, 1).flatten(1, 2)[:, :n]

    if n:
        k = dequantize_pages(rows(layer.k_codes), rows(layer.k_scales), layer.levels[:4], scale_dtype)
        vc = token_layout(layer.v_codes[pages], layer.v_layout).transpose(0, 1).flatten(1, 2)[:, :n]
        v_lev, v_sc = _levels_and_scales(vc, rows(layer.v_scales), layer.levels[4:], scale_dtype)
    else:  # no FP2 token (the code unpacking does not take empty tensors)
        Hkv, D = layer.k_codes.shape[1], 16 * layer.k_codes.shape[3]
        k = v_lev = torch.zeros(Hkv, 0, D, device=layer.k_codes.device)
        v_sc = torch.zeros(Hkv, 0, layer.v_scales.shape[-1], device=layer.k_codes.device)
    v = (v_lev.unflatten(-1, (v_sc.shape[-1], -1)) * v_sc[..., None]).flatten(-2)
    h, slot = int(batch.hp_len[b]), int(batch.hp_slot[b])
    return SequenceKV(
        torch.cat([k, batch.hp_k[slot, :, :h].float()], 1), torch.cat([v, batch.hp_v[slot, :, :h].float()], 1),
        v_lev, v_sc, n,
    )  # fmt: skip


def _e4m3_value_product(w: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """sum_t e4m3(w_t s_t 2^c) L_t 2^-c: w [Hkv, G, n] weights <= 1, levels [Hkv, n, D], scales
    [Hkv, n, NB] -> [Hkv, G, D] (VALUE_PRODUCTS, "e4m3")."""
    top = scales.amax(1, keepdim=True).clamp(min=2.0**-126)  # [Hkv, 1, NB]
    shift = torch.exp2(8 - torch.ceil(torch.log2(top)))  # the largest scale lands in (2^7, 2^8]
    x = w[..., None] * (scales * shift)[:, None]  # [Hkv, G, n, NB], <= 2^8
    x = x.clamp(max=448.0).to(torch.float8_e4m3fn).float() / shift[:, None]
    return torch.einsum("hgtb,htbc->hgbc", x, levels.unflatten(-1, (scales.shape[-1], -1))).flatten(-2)


def int8_key_levels(levels: torch.Tensor) -> bool:
    """Whether four key levels (any device) are what the int8-key kernel's table holds exactly: the
    levels times f integers within +-127, f = 64 if every |L| < 2 (so levels on a 1/64 grid) else 32
    (a 1/32 grid, |L| < 4). For e5m2-exact levels that means inner levels >= 1/16 (>= 1/8 when a
    level reaches 2): the named codebooks, and calibrated ones in practice."""
    lv = levels.detach().float().cpu()
    kf = lv * (64 if float(lv.abs().max()) < 2 else 32)
    return bool(((kf == kf.round()) & (kf.abs() <= 127)).all())
