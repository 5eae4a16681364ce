"""Adapts runtime/kv's paged caches (one `KVCache` per layer, FP2 / bf16 / fp8 pages) to the
engine's `KVPartition`.

Shape legend: n tokens of a sequence, Hkv KV heads, Dh head dim.

runtime/kv allocates pages lazily as tokens are appended, per layer; the scheduler reserves a
request's whole budget (prompt + max_tokens) at admission. This adapter keeps the reservation
ledger on top: a reservation never exceeds what every layer's pool can still give, so appends of
admitted requests cannot fail. Every layer sees the same appends, so their pools move together.
Writes are appends: attention writes each sequence's tokens in position order (decode token, or
a prefill chunk after its attention), which the adapter checks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from zerodram.runtime.engine.kv import NonFiniteLedger
from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.kv.cache import zero_nonfinite, zero_nonfinite_rows
from zerodram.runtime.kv.errors import KVCapacityError, KVNonFiniteError


class RuntimeKVPartition:
    """A rank's KV partition over runtime/kv caches, one per layer (see module docstring)."""

    def __init__(
        self,
        kv_format: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        params: Sequence[tuple] | None = None,
    ) -> None:
        from zerodram.runtime.kv.cache import make_kv_cache

        self.kv_format, self.num_pages, self.compute_dtype = kv_format, num_pages, compute_dtype
        max_seqs = min(num_pages, 256)
        if params is not None and len(params) != num_layers:
            raise ConfigError(f"KV params for {len(params)} layers, the model has {num_layers}")
        # FP2 caches take their layer's (k, v) SideParams, e.g. from the engine's calibration
        extra = [{} if params is None else {"params": params[i]} for i in range(num_layers)]
        self.caches = [
            make_kv_cache(
                kv_format,
                num_pages=num_pages,
                page_size=page_size,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                max_seqs=max_seqs,
                device=device,
                layer_idx=i,
                **extra[i],
            )
            for i in range(num_layers)
        ]
        if hasattr(self.caches[0], "index_memo"):  # FP2: one step's decode-append indices serve every layer
            from zerodram.runtime.kv.decode_index import DecodeIndexMemo

            memo = DecodeIndexMemo()
            for c in self.caches:
                c.index_memo = memo
        self.page_size = self.caches[0].page_size
        bits = self.caches[0].bits_per_elem(self.page_size)
        self.page_bytes = int(2 * num_layers * self.page_size * num_kv_heads * head_dim * bits / 8)
        self._reserved: dict[int, int] = {}  # seq_id -> pages reserved
        self._slots: dict[int, list[int]] = {}  # seq_id -> the cache's sequence id, per layer
        self._param_copies: dict[tuple[int, str], tuple] = {}  # (layer, device) -> FP2 params there
        self.nonfinite = NonFiniteLedger()

    def stored_bytes(self) -> tuple[int, int]:
        """(bytes the live tokens take in this format, bytes they would take in bf16), all layers.

        From the format's all-inclusive bits per element at each sequence's length (FP2 keeps a
        recent window in full precision, so short sequences save little).
        """
        c0 = self.caches[0]
        elems = 2 * len(self.caches) * c0.num_kv_heads * c0.head_dim  # K and V, every layer
        used = bf16 = 0
        for slots in self._slots.values():
            n = c0.seq_len(slots[0])
            if n:
                used += int(c0.bits_per_elem(n) * n * elems / 8)
                bf16 += 2 * n * elems
        return used, bf16

    def num_free_pages(self) -> int:
        return self.num_pages - sum(self._reserved.values())

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        need = self.pages_for(num_tokens) - self._reserved.get(seq_id, 0)
        if need > self.num_free_pages():
            raise KVCapacityError(
                f"sequence {seq_id} needs {need} more KV page(s) of {self.page_size} tokens, "
                f"{self.num_free_pages()} of {self.num_pages} free"
            )
        if seq_id not in self._slots:
            self._slots[seq_id] = [c.new_sequence() for c in self.caches]
        self._reserved[seq_id] = self._reserved.get(seq_id, 0) + max(need, 0)

    def free(self, seq_id: int) -> None:
        for cache, slot in zip(self.caches, self._slots.pop(seq_id, ()), strict=False):
            cache.free(slot)
        self._reserved.pop(seq_id, None)

    def write(self, layer_idx: int, seq_id: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache, slot = self.caches[layer_idx], self._slots[seq_id][layer_idx]
        have = cache.seq_len(slot)
        if start_pos != have:
            raise ZerodramError(
                f"layer {layer_idx} sequence {seq_id}: write at position {start_pos}, "
                f"cache holds {have} tokens "
                "(runtime/kv caches are append-only)"
            )
        try:
            cache.append(slot, k, v)
        except KVNonFiniteError as err:  # nothing written: record, store zeros (see NonFiniteLedger)
            self.nonfinite.record(seq_id, f"non-finite {err.where} (stored as zeros)")
            cache.append(slot, zero_nonfinite(k), zero_nonfinite(v))

    def take_nonfinite(self) -> dict[int, str]:
        return self.nonfinite.take()

    def write_decode(
        self,
        layer_idx: int,
        seq_ids: tuple[int, ...],
        positions: tuple[int, ...],
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """One token per decode sequence, k, v [B, Hkv, Dh]: the cache's batched append."""
        cache, slots = self.caches[layer_idx], [self._slots[s][layer_idx] for s in seq_ids]
        for seq_id, slot, pos in zip(seq_ids, slots, positions, strict=True):
            if pos != cache.tables.lens[slot]:
                raise ZerodramError(
                    f"layer {layer_idx} sequence {seq_id}: write at position {pos}, cache holds "
                    f"{cache.tables.lens[slot]} tokens (runtime/kv caches are append-only)"
                )
        # no host sync: NaN/Inf rows are stored as zeros and flagged on the device (NonFiniteLedger)
        bad = cache.append_decode(slots, k, v, on_nonfinite="zero")
        self.nonfinite.record_rows(layer_idx, seq_ids, positions, bad)

    # -- fixed-shape decode writes (the whole decode step in one CUDA graph) --
    @property
    def static_decode_ok(self) -> bool:
        """Every layer's cache takes fixed-shape decode writes (FP2 flushing one token at a time)."""
        return all(getattr(c, "static_decode_ok", False) for c in self.caches)

    def plan_decode_static(
        self, seq_ids: tuple[int, ...], positions: tuple[int, ...]
    ) -> tuple[list[int], ...]:
        """Host half of one decode step's writes, every layer: checks, pages and lengths move now;
        returns the per-row (slot, row, flush, page, page row) lists, the same in every layer.
        Layer 0 plans; the others mirror it (their pools move together: checked per row)."""
        lead = self.caches[0]
        lead_slots = [self._slots[s][0] for s in seq_ids]
        for seq_id, slot, pos in zip(seq_ids, lead_slots, positions, strict=True):
            if pos != lead.tables.lens[slot]:
                raise ZerodramError(
                    f"layer 0 sequence {seq_id}: write at position {pos}, cache holds "
                    f"{lead.tables.lens[slot]} tokens (runtime/kv caches are append-only)"
                )
        plan = lead.plan_decode_static(lead_slots)
        for layer_idx, cache in enumerate(self.caches[1:], start=1):
            cache.mirror_decode_static([self._slots[s][layer_idx] for s in seq_ids], lead, lead_slots)
        return plan

    def write_decode_static(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, ix: object, bad: torch.Tensor
    ) -> None:
        """Device half, one layer: k, v [Bp, Hkv, Dh] where `ix` (a `StaticDecodeIndex`) says;
        NaN/Inf rows are stored as zeros and flagged in `bad` [Bp] (no host sync)."""
        k, v, flags = zero_nonfinite_rows(k, v)
        bad.copy_(flags)
        self.caches[layer_idx].write_decode_static(k, v, ix)

    def pending_append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, ix: object, bad: torch.Tensor):
        """`write_decode_static`'s write not launched, for the decode to attend first (the cache's
        `pending_append`); the NaN/Inf handling is the same."""
        k, v, flags = zero_nonfinite_rows(k, v)
        bad.copy_(flags)
        return self.caches[layer_idx].pending_append(k, v, ix)

    @property
    def scratch(self) -> tuple[int, int]:
        """(scratch slot, scratch page) of the caches (the same in every layer)."""
        return self.caches[0].scratch_slot, self.caches[0].scratch_page

    def roundtrip(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What k, v [n, Hkv, Dh] read back as once stored in this format, fp32 (KV-quality
        telemetry; k, v may be host copies of device data); None when that cannot be told from
        these tokens alone.

        FP2: quantized then dequantized with the layer's parameters, the values the tokens take
        once they leave the bf16 tail (exact for the default per-token channel blocks; token-axis
        blocks need whole blocks of tokens). Dense formats: a cast to the page dtype and back.
        """
        cache = self.caches[layer_idx]
        if cache.format != "fp2":
            if cache.dtype == torch.float8_e4m3fn:  # the cache clamps to e4m3's range
                return k.float().clamp(-448, 448).to(cache.dtype).float(), v.float().clamp(-448, 448).to(
                    cache.dtype
                ).float()
            return k.to(cache.dtype).float(), v.to(cache.dtype).float()
        from zerodram.runtime.kv.quantize import fake_quantize

        spec = cache.spec
        if any(s.block_axis == "token" and k.shape[0] % s.block_size for s in (spec.k, spec.v)):
            return None
        params = cache.params if k.device == cache.device else self._params_on(layer_idx, k.device)
        return (
            fake_quantize(k.float(), spec.k, params[0], what="K", layer_idx=layer_idx),
            fake_quantize(v.float(), spec.v, params[1], what="V", layer_idx=layer_idx),
        )

    def _params_on(self, layer_idx: int, device: torch.device) -> tuple:
        """The layer's FP2 side parameters on `device` (the host, for telemetry), copied once."""
        key = (layer_idx, str(device))
        if key not in self._param_copies:
            self._param_copies[key] = tuple(
                dataclasses.replace(
                    p,
                    **{
                        f.name: getattr(p, f.name).to(device)
                        for f in dataclasses.fields(p)
                        if isinstance(getattr(p, f.name), torch.Tensor)
                    },
                )
                for p in self.caches[layer_idx].params
            )
        return self._param_copies[key]

    def read(self, layer_idx: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.caches[layer_idx].gather(self._slots[seq_id][layer_idx])  # [n, Hkv, Dh] fp32
        return k[:length].to(self.compute_dtype), v[:length].to(self.compute_dtype)

    def read_decode(
        self, layer_idx: int, seq_ids: tuple[int, ...], lengths: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.caches[layer_idx]
        k, v = cache.gather_batch([self._slots[s][layer_idx] for s in seq_ids], lengths)  # [B, L, Hkv, Dh]
        return k.to(self.compute_dtype), v.to(self.compute_dtype)
