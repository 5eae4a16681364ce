"""The plain-torch definition of FP2 decode attention, which the kernels are tested against, and
the [D, D] products around it (the query into the stored key space, the output back).

Shape legend: B seqs, Hq query heads, Hkv kv heads, G = Hq / Hkv, D head dim, NP pages, P page
size, HP bf16 tokens per sequence.
"""

from __future__ import annotations

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


def int8_key_levels(levels: torch.Tensor) -> bool:
    """Whether four key levels (any device) are what the int8-key kernel's table holds exactly: the
    levels times f integers within +-127, f = 64 if every |L| < 2 (so levels on a 1/64 grid) else 32
    (a 1/32 grid, |L| < 4). For e5m2-exact levels that means inner levels >= 1/16 (>= 1/8 when a
    level reaches 2): the named codebooks, and calibrated ones in practice."""
    lv = levels.detach().float().cpu()
    kf = lv * (64 if float(lv.abs().max()) < 2 else 32)
    return bool(((kf == kf.round()) & (kf.abs() <= 127)).all())
