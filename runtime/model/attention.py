"""Attention over a rank's paged KV partition: the model's narrow view of the KV cache.

Shape legend: T tokens in the step, B decode sequences, n tokens of one prefill chunk, L keys of one
sequence, Hq query heads, Hkv KV heads, Dh head dim.

Decode rows read all their keys from the cache (which may store them as FP2 pages and hands them
back dequantized, or runs a fused decode kernel). A prefill chunk attends to its own K/V in the
compute dtype (bf16/fp32) plus the sequence's earlier chunks read from the cache; its K/V are
written to the cache afterwards, so prompt attention never sees its own quantization error.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from zerodram.runtime.model.batch import ForwardBatch


class KVStore(Protocol):
    """What attention needs from a KV partition (the engine adapts the KV module's cache to it)."""

    def write(self, layer_idx: int, seq_id: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, Hkv, Dh] of `seq_id` at positions [start_pos, start_pos + n)."""
        ...

    def write_decode(
        self, layer_idx: int, seq_ids: tuple[int, ...], positions: tuple[int, ...], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """One token per decode sequence (k, v [B, Hkv, Dh]): `write` of each row, batched."""
        ...

    def read(self, layer_idx: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of `seq_id`, [L, Hkv, Dh] in the compute dtype."""
        ...

    def read_decode(
        self, layer_idx: int, seq_ids: tuple[int, ...], lengths: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decode sequence's keys and values at once, [B, L, Hkv, Dh] (L = max(lengths), rows
        past a sequence's length zero), in the compute dtype."""
        ...


class DecodeAttention(Protocol):
    """A decode-attention path: q [B, Hq, Dh] of sequences whose keys are all in the cache."""

    def __call__(
        self, layer_idx: int, q: torch.Tensor, seq_ids: tuple[int, ...], lengths: tuple[int, ...]
    ) -> torch.Tensor: ...


class KVProbe(Protocol):
    """Sees each layer's K/V right after they were written (KV-quality telemetry; must be cheap)."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


class PagedAttention:
    """Runs one layer's attention for a `ForwardBatch` against a `KVStore`.

    Args:
        kv: the rank's KV partition.
        scale: softmax scale (head_dim ** -0.5).
        decode: optional fused decode path; defaults to reading the cache and one padded SDPA.
    """

    def __init__(self, kv: KVStore, scale: float, decode: DecodeAttention | None = None) -> None:
        self.kv = kv
        self.scale = scale
        self.decode = decode or self._decode_sdpa
        self.probe: KVProbe | None = None  # the engine's metrics hook (see Engine.attach_observer)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq, Dh], k/v [T, Hkv, Dh] (already rotated) -> out [T, Hq, Dh]."""
        out = torch.empty_like(q)
        B = batch.num_decode
        if B:
            self.kv.write_decode(layer_idx, batch.decode_seq_ids, batch.decode_positions, k[:B], v[:B])
            lengths = tuple(p + 1 for p in batch.decode_positions)
            out[:B] = self.decode(layer_idx, q[:B], batch.decode_seq_ids, lengths)
        row = B
        for seg in batch.prefill:
            rows = slice(row, row + seg.num_tokens)
            k_new, v_new = k[rows], v[rows]  # [n, Hkv, Dh], full precision
            if seg.start_pos:
                k_old, v_old = self.kv.read(layer_idx, seg.seq_id, seg.start_pos)
                k_all, v_all = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])  # [L, Hkv, Dh]
            else:
                k_all, v_all = k_new, v_new
            out[rows] = self._prefill_sdpa(q[rows], k_all, v_all, seg.start_pos)
            self.kv.write(layer_idx, seg.seq_id, seg.start_pos, k_new, v_new)
            row += seg.num_tokens
        if self.probe is not None and q.shape[0]:
            self.probe(layer_idx, q, k, v)
        return out

    def _prefill_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        n, L = q.shape[0], k.shape[0]
        q_pos = torch.arange(start, start + n, device=q.device)[:, None]  # [n, 1]
        mask = torch.arange(L, device=q.device)[None, :] <= q_pos  # [n, L]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, Hq, n, Dh]
            k.transpose(0, 1)[None],  # [1, Hkv, L, Dh]
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)  # [n, Hq, Dh]

    def _decode_sdpa(
        self, layer_idx: int, q: torch.Tensor, seq_ids: tuple[int, ...], lengths: tuple[int, ...]
    ) -> torch.Tensor:
        L = max(lengths)
        k, v = self.kv.read_decode(layer_idx, seq_ids, lengths)  # [B, L, Hkv, Dh], one read per layer
        lens = torch.tensor(lengths, device=q.device)
        mask = (torch.arange(L, device=q.device)[None, :] < lens[:, None])[:, None, None, :]  # [B,1,1,L]
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],
            k.transpose(1, 2).to(q.dtype),  # [B, Hkv, L, Dh]
            v.transpose(1, 2).to(q.dtype),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )  # [B, Hq, 1, Dh]
        return o[:, :, 0, :]
