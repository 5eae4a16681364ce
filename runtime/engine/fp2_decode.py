"""The engine's fused FP2 decode attention: runtime/attention's kernels over the partition's pages.

Shape legend: B decode sequences, Hq query heads, Hkv KV heads, G = Hq / Hkv, Dh head dim,
W block-table width (pages of the longest FP2 range in the step).

`make_decode_attention` picks the decode path once, at engine construction: this class when the
partition stores FP2 pages that the kernels read (`layer_from_cache` accepts the spec), else None
(PagedAttention keeps its gather + SDPA path; the reason is logged once). On a GPU the fused path
runs the CUDA kernels, on CPU runtime/attention's plain-torch reference, with the same API.

Everything the kernels see is in the cache's stored space (docs/fp2-format.md): q is rotated by
R_k and scaled by the key anchor, the output scaled by the value anchor and rotated back by R_v^T.
The key center is dropped on purpose: it shifts every score of a query row by the same q . c,
which softmax ignores. A value center would have to be added back; the kernels' layout has no
place for it and `layer_from_cache` refuses it, so a spec with `vcenter=1` keeps the gather path.

Host bookkeeping is done once per step, not per layer: every layer's cache sees the same appends
and frees in the same order, so their slot ids and allocators move together and one block table
serves every layer (checked for slots when a sequence first appears).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zerodram.runtime.attention import DecodeBatch, Fp2DecodeAttention, Fp2Layer, layer_from_cache
from zerodram.runtime.errors import ConfigError, ZerodramError

log = logging.getLogger("zerodram.engine")


@dataclass(frozen=True)
class _LayerConsts:
    """One layer's kernel view and stored-space transforms, rebuilt if the cache's params change
    (calibration replaces `cache.params`). q_anchor / v_anchor [Hq, Dh] (repeated over G);
    k_rot, v_rot_t [Dh, Dh] or None."""

    params: tuple
    layer: Fp2Layer
    k_rot: torch.Tensor | None
    q_anchor: torch.Tensor
    v_anchor: torch.Tensor
    v_rot_t: torch.Tensor | None


@dataclass(frozen=True)
class _StepMeta:
    """A step's decode metadata on the device, and the longest FP2 range (sizes the kernel grid)."""

    batch: DecodeBatch
    max_fp2_len: int


class Fp2FusedDecode:
    """`DecodeAttention` over a `RuntimeKVPartition` of FP2 caches (see module docstring).

    Args:
        kv: the rank's partition (`RuntimeKVPartition` holding `Fp2KVCache`s).
        num_q_heads: the model's query heads.
        scale: softmax scale (the one PagedAttention's SDPA uses).
        max_batch: most decode sequences in one step (the scheduler's max_num_seqs).

    Raises:
        ConfigError: the caches are not FP2 or the kernels cannot read their format.
    """

    def __init__(self, kv, *, num_q_heads: int, scale: float, max_batch: int) -> None:
        c0 = kv.caches[0]
        if getattr(c0, "format", None) != "fp2":
            raise ConfigError(f"the fused decode path reads FP2 pages, the partition is {kv.kv_format!r}")
        layer_from_cache(c0)  # raises ConfigError for what the kernels cannot read
        spec = c0.spec
        if spec.v.center:
            raise ConfigError("vcenter=1: the kernels do not add a value center back to the output")
        if spec.k.scale_dtype != spec.v.scale_dtype:
            raise ConfigError(
                f"the kernels read one scale dtype, K has {spec.k.scale_dtype}, V {spec.v.scale_dtype}"
            )
        self.kv, self.scale = kv, scale
        self.group = num_q_heads // c0.num_kv_heads
        self.rule, self.num_sinks, self.page_size = c0.rule, spec.num_sinks, c0.page_size
        self.device = c0.device
        self.attn = Fp2DecodeAttention(
            num_q_heads=num_q_heads,
            num_kv_heads=c0.num_kv_heads,
            head_dim=c0.head_dim,
            page_size=c0.page_size,
            k_block=spec.k.block_size,
            v_block=spec.v.block_size,
            scale_dtype=spec.k.scale_dtype,
            max_batch=max_batch,
            max_fp2_tokens=c0.num_pages * c0.page_size,
            device=self.device,
            softmax_scale=scale,
        )
        self._consts: list[_LayerConsts | None] = [None] * len(kv.caches)
        # Host mirror of the block tables, one row per cache slot: pages are appended, never moved,
        # so a step copies only the new ones. _mirror_of[slot] is the page list the row mirrors: the
        # cache opens a new list for every new sequence, so identity tells a reused slot (request ids
        # can repeat across generate() calls, list objects held here cannot).
        width = c0.tables.max_pages_per_seq
        self._table = torch.full((c0.tables.max_seqs, width), -1, dtype=torch.int32)
        self._mirror_of: dict[int, list[int]] = {}
        self._mirror_len: dict[int, int] = {}
        self._step: _StepMeta | None = None

    # --- per layer -----------------------------------------------------------------------------

    def _layer(self, layer_idx: int) -> _LayerConsts:
        cache = self.kv.caches[layer_idx]
        c = self._consts[layer_idx]
        if c is not None and c.params is cache.params:
            return c
        kp, vp = cache.params
        G = self.group
        c = _LayerConsts(
            params=cache.params,
            layer=layer_from_cache(cache),
            k_rot=kp.rotation,
            q_anchor=kp.anchor.float().repeat_interleave(G, dim=0),  # [Hq, Dh]
            v_anchor=vp.anchor.float().repeat_interleave(G, dim=0),
            v_rot_t=None if vp.rotation is None else vp.rotation.T.contiguous(),
        )
        self._consts[layer_idx] = c
        return c

    # --- per step ------------------------------------------------------------------------------

    def _meta(self, seq_ids: tuple[int, ...], lengths: tuple[int, ...]) -> _StepMeta:
        """The step's DecodeBatch (host bookkeeping, one copy to the device)."""
        kv, cache0 = self.kv, self.kv.caches[0]
        P, S, B = self.page_size, self.num_sinks, len(seq_ids)
        slots = [kv._slots[s][0] for s in seq_ids]
        fp2 = [self.rule.num_quantized(n) for n in lengths]
        for sid, slot, f in zip(seq_ids, slots, fp2, strict=True):
            pages = cache0.tables.pages[slot]
            if self._mirror_of.get(slot) is not pages:  # a new sequence in this slot
                if any(s != slot for s in kv._slots[sid]):
                    raise ZerodramError(
                        f"sequence {sid} has cache slots {kv._slots[sid]} across layers; the fused "
                        "decode path shares one block table and needs them equal"
                    )
                self._mirror_of[slot], self._mirror_len[slot] = pages, 0
            have, need = self._mirror_len[slot], (f + P - 1) // P
            if need > have:
                self._table[slot, have:need] = torch.tensor(pages[have:need], dtype=torch.int32)
                self._mirror_len[slot] = need
        max_fp2 = max(fp2)
        width = max(1, (max_fp2 + P - 1) // P)
        # One host buffer, one copy to the device: fp2_len, hp_len, hp_slot [B] each, then the table.
        host = torch.empty(3 * B + B * width, dtype=torch.int32)
        host[:B] = torch.tensor(fp2, dtype=torch.int32)
        host[B : 2 * B] = torch.tensor(
            [min(n, S) + max(0, n - S - f) for n, f in zip(lengths, fp2, strict=True)], dtype=torch.int32
        )
        slot_idx = torch.tensor(slots, dtype=torch.int64)
        host[2 * B : 3 * B] = slot_idx
        host[3 * B :] = self._table[slot_idx, :width].flatten()  # rows past fp2_len are unread
        dev = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        batch = DecodeBatch(
            block_table=dev[3 * B :].view(B, width),
            fp2_len=dev[:B],
            hp_k=cache0.hp_k,
            hp_v=cache0.hp_v,
            hp_len=dev[B : 2 * B],
            hp_slot=dev[2 * B : 3 * B],
        )
        return _StepMeta(batch, max_fp2)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, seq_ids: tuple[int, ...], lengths: tuple[int, ...]
    ) -> torch.Tensor:
        """q [B, Hq, Dh] (after RoPE) -> attention output [B, Hq, Dh] in q's dtype."""
        c = self._layer(layer_idx)
        if layer_idx == 0 or self._step is None:  # layer 0 runs first in every step
            self._step = self._meta(seq_ids, lengths)
        meta = self._step
        cache = self.kv.caches[layer_idx]
        batch = meta.batch
        if layer_idx:  # the sinks / tail live in each layer's own bf16 region
            batch = DecodeBatch(
                batch.block_table, batch.fp2_len, cache.hp_k, cache.hp_v, batch.hp_len, batch.hp_slot
            )
        x = q.float()  # [B, Hq, Dh]
        if c.k_rot is not None:
            x = x @ c.k_rot
        o = self.attn((x * c.q_anchor).contiguous(), c.layer, batch, max_len=meta.max_fp2_len)
        o = o * c.v_anchor  # [B, Hq, Dh], stored value space -> rotated value space
        if c.v_rot_t is not None:
            o = o @ c.v_rot_t
        return o.to(q.dtype)


def make_decode_attention(kv, *, num_q_heads: int, scale: float, max_batch: int) -> Fp2FusedDecode | None:
    """The partition's fused decode path, or None for PagedAttention's gather + SDPA (logged once
    when the partition is FP2 but its format is one the kernels cannot read)."""
    caches = getattr(kv, "caches", None)
    if not caches or getattr(caches[0], "format", None) != "fp2":
        return None
    try:
        return Fp2FusedDecode(kv, num_q_heads=num_q_heads, scale=scale, max_batch=max_batch)
    except ConfigError as err:
        log.info("FP2 KV %r: decode reads the pages back through gather + SDPA (%s)", kv.kv_format, err)
        return None
