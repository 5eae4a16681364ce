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

from zerodram.runtime.attention import (
    DecodeBatch,
    Fp2DecodeAttention,
    Fp2Layer,
    finish_output,
    int8_key_levels,
    layer_from_cache,
    prepare_query,
)
from zerodram.runtime.device import Staging
from zerodram.runtime.errors import ConfigError, ZerodramError

log = logging.getLogger("zerodram.engine")


def length_bucket(max_fp2: int) -> int:
    """The FP2 length a captured step's kernel grid is sized for: the next power of two, at least
    1024 (a split's minimum); the graph serves every length up to it. Eager steps size the grid for
    their exact longest range and their B rows instead, so the two may split the work differently
    and agree to rounding, not to the bit."""
    return max(1024, 1 << max(0, max_fp2 - 1).bit_length())


@dataclass(frozen=True)
class _LayerConsts:
    """One layer's kernel view and per-query-head anchors, rebuilt if the cache's params change
    (calibration replaces `cache.params`). q_anchor / v_anchor [Hq, Dh] (repeated over G once,
    not every step)."""

    params: tuple
    layer: Fp2Layer
    q_anchor: torch.Tensor
    v_anchor: torch.Tensor


@dataclass(frozen=True)
class StaticDecodeMeta:
    """One batch bucket's decode metadata in static device buffers (a captured graph reads them
    at every replay): block_table [Bp, W] int32 (W: a sequence's most pages), fp2_len, hp_len,
    hp_slot [Bp] int32, and the upload buffer [4, Bp] int64 (those three, then each row's slot,
    the row of the device table to take)."""

    block_table: torch.Tensor
    fp2_len: torch.Tensor
    hp_len: torch.Tensor
    hp_slot: torch.Tensor
    staging: Staging


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
        value_product: `Fp2DecodeAttention`'s ("exact"; "e4m3" is a CPU emulation for kernel design).
        defer_write: on a GPU, whether the whole-step graph makes each layer's KV write after the
            decode that attends its tokens (`static_call`'s pending; docs/fp2-kernel.md, "Codes at
            arrival"): True (or ConfigError where the kernels or the format cannot), False, or
            "auto" (wherever they can). Ignored on CPU, where the write and the reference decode
            run apart as always.

    Raises:
        ConfigError: the caches are not FP2 or the kernels cannot read their format.
    """

    def __init__(
        self,
        kv,
        *,
        num_q_heads: int,
        scale: float,
        max_batch: int,
        value_product: str = "exact",
        defer_write: bool | str = False,
    ) -> None:
        if defer_write not in (True, False, "auto"):
            raise ConfigError(f"defer_write must be True, False or 'auto', got {defer_write!r}")
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
        self.num_kv_heads = c0.num_kv_heads
        # Whether the static steps defer the KV write (`defers_write`): False where the kernels
        # cannot (on CPU above all) and without a window (W = 0: the decode reads the new codes).
        writers = all(getattr(c, "_static_write", None) is not None for c in kv.caches)
        if defer_write is True and c0.device.type == "cuda" and not (writers and c0.rule.window):
            raise ConfigError(
                f"defer_write: the caches' format {kv.kv_format!r} has no decode-write kernel to defer "
                "(kernels/kv_write.py `unsupported`) or no window"
            )
        self.defer_write = defer_write if c0.device.type == "cuda" and writers and c0.rule.window else False
        self.group = num_q_heads // c0.num_kv_heads
        self.rule, self.page_size = c0.rule, c0.page_size
        self.device = c0.device
        # Int8 keys (the kernels' default where key blocks allow) only if every layer's key codebook
        # is exact in their int8 table (`int8_key_levels`); one calibrated codebook that is not takes
        # every layer to the fp16-key kernel, never a rounded key. Decided once, here: the caches
        # hold their final (calibrated) levels before the engine builds this path.
        inexact = [i for i, c in enumerate(kv.caches) if not int8_key_levels(layer_from_cache(c).levels[:4])]
        if inexact and self.device.type == "cuda":
            log.warning(
                "key levels of layers %s are not int8-exact: decode attention uses fp16 keys", inexact
            )
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
            key_s8=False if inexact else None,
            v_layout=c0.v.layout,
            value_product=value_product,
        )
        if self.device.type == "cuda":
            log.info("FP2 decode attention: %s", self.attn.plan_source())
        self._consts: list[_LayerConsts | None] = [None] * len(kv.caches)
        # Host mirror of the block tables, one row per cache slot: pages are appended, never moved,
        # so a step copies only the new ones. _mirror_of[slot] is the page list the row mirrors: the
        # cache opens a new list for every new sequence, so identity tells a reused slot (request ids
        # can repeat across generate() calls, list objects held here cannot).
        width = c0.tables.max_pages_per_seq
        self._table = torch.full((c0.tables.max_seqs, width), -1, dtype=torch.int32)
        self._table_dev: torch.Tensor | None = None  # a device copy, for the static path
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
        layer = layer_from_cache(cache)
        if self.attn.on_gpu and self.attn.key_s8 and not int8_key_levels(layer.levels[:4]):
            # The key path was chosen at construction from the levels then; params replaced since
            # with a codebook off the int8 grid would be rounded silently by the kernel's table.
            raise ConfigError(
                f"layer {layer_idx}'s key levels {layer.levels[:4].tolist()} are not int8-exact, but the "
                "decode path chose int8 keys when it was built: build it after the final (calibrated) levels"
            )
        c = _LayerConsts(
            params=cache.params,
            layer=layer,
            q_anchor=kp.anchor.float().repeat_interleave(G, dim=0),  # [Hq, Dh]
            v_anchor=vp.anchor.float().repeat_interleave(G, dim=0),
        )
        self._consts[layer_idx] = c
        return c

    # --- per step ------------------------------------------------------------------------------

    def _mirror(self, seq_ids: tuple[int, ...], fp2: list[int]) -> list[int]:
        """Bring the host block-table mirror (and its device copy, once the static path made one)
        up to the step's FP2 lengths; returns the sequences' cache slots."""
        kv, cache0, P = self.kv, self.kv.caches[0], self.page_size
        slots = [kv._slots[s][0] for s in seq_ids]
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
                if self._table_dev is not None:
                    self._table_dev[slot, have:need].copy_(self._table[slot, have:need], non_blocking=True)
                self._mirror_len[slot] = need
        return slots

    def _meta(self, seq_ids: tuple[int, ...], lengths: tuple[int, ...]) -> _StepMeta:
        """The step's DecodeBatch (host bookkeeping, one copy to the device)."""
        cache0, P, B = self.kv.caches[0], self.page_size, len(seq_ids)
        fp2 = [self.rule.num_quantized(n) for n in lengths]
        slots = self._mirror(seq_ids, fp2)
        max_fp2 = max(fp2)
        width = max(1, (max_fp2 + P - 1) // P)
        # One host buffer (pinned on a GPU), one copy to the device: fp2_len, hp_len, hp_slot [B]
        # each, then the table.
        on_gpu = self.device.type == "cuda"
        host = torch.empty(3 * B + B * width, dtype=torch.int32, pin_memory=on_gpu)
        host[:B] = torch.tensor(fp2, dtype=torch.int32)
        # bf16 tokens (sinks + the unflushed tail): all that is not FP2
        host[B : 2 * B] = torch.tensor([n - f for n, f in zip(lengths, fp2, strict=True)], dtype=torch.int32)
        slot_idx = torch.tensor(slots, dtype=torch.int64)
        host[2 * B : 3 * B] = slot_idx
        host[3 * B :] = self._table[slot_idx, :width].flatten()  # rows past fp2_len are unread
        dev = host.to(self.device, non_blocking=True) if on_gpu else host
        batch = DecodeBatch(
            block_table=dev[3 * B :].view(B, width),
            fp2_len=dev[:B],
            hp_k=cache0.hp_k,
            hp_v=cache0.hp_v,
            hp_len=dev[B : 2 * B],
            hp_slot=dev[2 * B : 3 * B],
        )
        return _StepMeta(batch, max_fp2)

    def grid_len(self, max_fp2: int) -> int:
        """The FP2 length a captured step's grid is sized for: `length_bucket`, at most the pool."""
        return min(length_bucket(max_fp2), self.attn.max_fp2_tokens)

    @property
    def defers_write(self) -> bool:
        """Whether the static steps make the KV write after the decode that attends its tokens
        (`defer_write`, where possible)."""
        return self.defer_write is not False

    # --- the static path (the whole decode step in one CUDA graph) ------------------------------

    def static_meta(self, bucket: int) -> StaticDecodeMeta:
        """Static metadata buffers for a bucket of Bp rows (its first use makes the device table)."""
        if self._table_dev is None:
            self._table_dev = self._table.to(self.device)
        i32 = {"dtype": torch.int32, "device": self.device}
        return StaticDecodeMeta(
            block_table=torch.zeros(bucket, self._table.shape[1], **i32),
            fp2_len=torch.zeros(bucket, **i32),
            hp_len=torch.zeros(bucket, **i32),
            hp_slot=torch.zeros(bucket, **i32),
            staging=Staging((4, bucket), torch.int64, self.device),
        )

    def fill_static(self, meta: StaticDecodeMeta, seq_ids: tuple[int, ...], lengths: tuple[int, ...]) -> int:
        """The step's metadata into `meta` (host bookkeeping, a few small copies, one gather of the
        block-table rows on the device); rows past B attend to one scratch-slot token of fp2_len 0.
        Returns the FP2 length the step's grid is sized for (`grid_len` of its longest range after
        the write), whether the step makes the write before the decode or after it (the codes of
        the range's rows were written when they arrived). Empty `seq_ids`: all scratch."""
        scratch = self.kv.caches[0].scratch_slot
        fp2 = [self.rule.num_quantized(n) for n in lengths]
        slots = self._mirror(seq_ids, fp2)
        pad = meta.fp2_len.shape[0] - len(slots)
        hp = [n - f for n, f in zip(lengths, fp2, strict=True)]  # sinks + tail: all that is not FP2
        grid = self.grid_len(max(fp2, default=0))
        dev = meta.staging.upload(
            [[*fp2, *[0] * pad], [*hp, *[1] * pad], [*slots, *[scratch] * pad], [*slots, *[0] * pad]]
        )  # [4, Bp]: one copy; then casts and one gather on the device
        for i, dst in enumerate((meta.fp2_len, meta.hp_len, meta.hp_slot)):
            dst.copy_(dev[i])
        torch.index_select(self._table_dev, 0, dev[3], out=meta.block_table)  # rows past fp2_len unread
        return grid

    def static_call(
        self, layer_idx: int, q: torch.Tensor, meta: StaticDecodeMeta, max_len: int, pending=None
    ) -> torch.Tensor:
        """`__call__` for a padded batch q [Bp, Hq, Dh] from `meta`, the grid sized for `max_len`
        FP2 tokens: fixed shapes, no host sync (what a CUDA graph captures). pending: where
        `defers_write`, the step's KV write of this layer, not yet made (the partition's
        `pending_append`), whose tokens the kernel attends; the caller makes the write after."""
        c, cache = self._layer(layer_idx), self.kv.caches[layer_idx]
        batch = DecodeBatch(meta.block_table, meta.fp2_len, cache.hp_k, cache.hp_v, meta.hp_len, meta.hp_slot)
        kp, vp = c.params
        x = prepare_query(q, kp.rotation, c.q_anchor, 1)  # [Bp, Hq, Dh] stored key space, fp32
        o = self.attn(x, c.layer, batch, max_len=max_len, pending=pending)
        return finish_output(o, vp.rotation, c.v_anchor, 1).to(q.dtype)

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
        kp, vp = c.params
        x = prepare_query(q, kp.rotation, c.q_anchor, 1)  # [B, Hq, Dh] stored key space, fp32
        o = self.attn(x, c.layer, batch, max_len=meta.max_fp2_len)  # stored value space
        return finish_output(o, vp.rotation, c.v_anchor, 1).to(q.dtype)


def make_decode_attention(
    kv,
    *,
    num_q_heads: int,
    scale: float,
    max_batch: int,
    value_product: str = "exact",
    defer_write: bool | str = False,
) -> Fp2FusedDecode | None:
    """The partition's fused decode path, or None for PagedAttention's gather + SDPA (logged once
    when the partition is FP2 but its format is one the kernels cannot read).

    Raises:
        ConfigError: a value_product other than "exact", or defer_write=True, where no fused path
            can serve it.
    """
    caches = getattr(kv, "caches", None)
    if not caches or getattr(caches[0], "format", None) != "fp2":
        if value_product != "exact":
            raise ConfigError(
                f"value_product {value_product!r} needs the fused FP2 decode path; the partition's KV format "
                f"is {getattr(kv, 'kv_format', None)!r}"
            )
        return None
    try:
        return Fp2FusedDecode(
            kv, num_q_heads=num_q_heads, scale=scale, max_batch=max_batch, value_product=value_product,
            defer_write=defer_write,
        )  # fmt: skip
    except ConfigError as err:
        if value_product != "exact":
            raise ConfigError(f"value_product {value_product!r} needs the fused FP2 decode path: {err}") from err
        if defer_write is True and caches[0].device.type == "cuda":  # asked for by name: not a quiet
            # fall back to the slower gather path (on CPU the option means nothing)
            raise ConfigError(f"defer_write=True needs the fused FP2 decode path: {err}") from err
        log.info("FP2 KV %r: decode reads the pages back through gather + SDPA (%s)", kv.kv_format, err)
        return None
