"""Reference decode attention over a paged cache: dequantize, then fp32 attention with GQA.

The fused CUDA decode kernel is tested against this. Dimensions: B sequences, Hq query heads,
H KV heads, G = Hq / H, D head dim, n tokens of a sequence.
"""

from __future__ import annotations

import torch

from zerodram.runtime.kv.cache import KVCache
from zerodram.runtime.kv.errors import KVInputError


def reference_decode_attention(
    q: torch.Tensor, cache: KVCache, seq_ids: list[int], scale: float | None = None
) -> torch.Tensor:
    """One decode step: q [B, Hq, D] attends over every cached token of its sequence.

    Query head h uses KV head h // G (GQA, as in Llama's repeat_kv). Returns fp32 [B, Hq, D].

    Raises:
        KVInputError: shape mismatch, Hq not a multiple of H, unknown or empty sequence.
    """
    if q.dim() != 3 or q.shape[0] != len(seq_ids) or q.shape[2] != cache.head_dim:
        raise KVInputError(
            f"q must be [{len(seq_ids)}, Hq, {cache.head_dim}] (one row per sequence), got {tuple(q.shape)}"
        )
    Hq, H = q.shape[1], cache.num_kv_heads
    if Hq % H:
        raise KVInputError(f"{Hq} query heads are not a multiple of {H} KV heads")
    if q.device != cache.device:
        raise KVInputError(f"q is on {q.device} but the cache lives on {cache.device}")
    G = Hq // H
    s = scale if scale is not None else cache.head_dim**-0.5
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, sid in enumerate(seq_ids):
        if cache.seq_len(sid) == 0:
            raise KVInputError(f"sequence {sid} is empty: nothing to attend to")
        k, v = cache.gather(sid)  # [n, H, D]
        qb = q[b].float().reshape(H, G, -1)  # [H, G, D]
        scores = torch.einsum("hgd,nhd->hgn", qb, k) * s
        p = torch.softmax(scores, -1)
        out[b] = torch.einsum("hgn,nhd->hgd", p, v).reshape(Hq, -1)
    return out
