"""The engine's view of a rank's KV partition, and a plain-torch paged implementation.

Shape legend: Ly layers, P pages, S page size (tokens), Hkv KV heads, Dh head dim, L tokens.

`KVPartition` is what the scheduler (capacity, admission) and attention (`KVStore`: write / read)
need. `TorchPagedKV` stores K/V pages in bf16 or fp32 with a free-page list and per-sequence block
tables; `make_kv_partition` adapts runtime/kv's paged caches for FP2 / bf16 / fp8 pages and uses
`TorchPagedKV` for fp32 / fp16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.cache import batch_page_index, zero_nonfinite, zero_nonfinite_rows
from zerodram.runtime.kv.errors import KVCapacityError
from zerodram.runtime.kv.format import TORCH_PAGED_FORMATS
from zerodram.runtime.model.attention import KVStore


class KVPartition(KVStore, Protocol):
    """A rank's KV partition: attention's `KVStore` (write / read, per sequence and per decode
    batch) plus what the scheduler and the engine need."""

    page_size: int
    num_pages: int
    kv_format: str

    def num_free_pages(self) -> int: ...

    def pages_for(self, num_tokens: int) -> int: ...

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make room for `seq_id` to hold `num_tokens` tokens in all; raises KVCapacityError."""
        ...

    def free(self, seq_id: int) -> None: ...

    def take_nonfinite(self) -> dict[int, str]:
        """Sequences whose K/V held NaN/Inf since the last call, with the first message each (their
        rows were stored as zeros, so every layer's pages moved together); clears the record."""
        ...

    def roundtrip(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What k, v [n, Hkv, Dh] read back as once stored (fp32), for KV-quality telemetry."""
        ...


_TORCH_FORMATS = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class NonFiniteLedger:
    """The sequences whose K/V arrived with NaN/Inf during a step, and what was wrong (the first
    message per sequence). A partition never stores a non-finite value: it records the sequence,
    stores zeros in its place (so page allocation stays the same in every layer, which the fused
    decode path's shared block table relies on) and goes on; the engine fails those requests at
    the end of the step and frees their pages, and no other request is touched. Decode writes
    record device flags (`record_rows`, no host sync); `take` reads them all at once."""

    def __init__(self) -> None:
        self._failed: dict[int, str] = {}
        self._pending: list[tuple[int, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []

    def record(self, seq_id: int, message: str) -> None:
        self._failed.setdefault(seq_id, message)

    def record_rows(
        self, layer_idx: int, seq_ids: Sequence[int], positions: Sequence[int], bad: torch.Tensor
    ) -> None:
        """bad: bool [B] on the device, True where row i (sequence seq_ids[i]) had NaN/Inf."""
        self._pending.append((layer_idx, tuple(seq_ids), tuple(positions), bad))

    def take(self) -> dict[int, str]:
        if self._pending:  # one host read for the whole step, in write order (layer order)
            flags = torch.cat([bad for *_, bad in self._pending]).tolist()
            i = 0
            for layer_idx, seq_ids, positions, _ in self._pending:
                for sid, pos in zip(seq_ids, positions, strict=True):
                    if flags[i]:
                        self.record(sid, f"non-finite K/V at layer {layer_idx}, position {pos} (stored as zeros)")
                    i += 1
            self._pending = []
        failed, self._failed = self._failed, {}
        return failed


class TorchPagedKV:
    """Paged K/V in a full-precision dtype; one page pool shared by all layers' block tables.

    Args:
        num_layers, num_kv_heads, head_dim: the model's.
        num_pages, page_size: pool size (pages) and tokens per page.
        kv_format: "bf16", "fp16" or "fp32".
        compute_dtype: dtype `read` returns.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        kv_format: str = "bf16",
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if kv_format not in _TORCH_FORMATS:
            raise ConfigError(
                f"kv format {kv_format!r} needs runtime/kv; plain torch pages: {list(_TORCH_FORMATS)}"
            )
        self.page_size, self.num_pages, self.kv_format = page_size, num_pages, kv_format
        self.compute_dtype = compute_dtype
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)  # [Ly, P, S, Hkv, Dh]
        self.k_pages = torch.zeros(shape, dtype=_TORCH_FORMATS[kv_format], device=device)
        # bytes of one page (K and V, all layers): what the dashboard's KV panel reports
        self.page_bytes = 2 * num_layers * page_size * num_kv_heads * head_dim * self.k_pages.element_size()
        self.v_pages = torch.zeros_like(self.k_pages)
        self._free = list(range(num_pages - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self.nonfinite = NonFiniteLedger()

    def take_nonfinite(self) -> dict[int, str]:
        return self.nonfinite.take()

    def num_free_pages(self) -> int:
        return len(self._free)

    def stored_bytes(self) -> tuple[int, int]:
        """(bytes of the pages in use, the same pages in bf16)."""
        used = self.num_pages - len(self._free)
        return used * self.page_bytes, used * self.page_bytes * 2 // self.k_pages.element_size()

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        table = self._tables.setdefault(seq_id, [])
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self._free):
            raise KVCapacityError(
                f"sequence {seq_id} needs {need} more KV page(s) of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages} free"
            )
        for _ in range(max(need, 0)):
            table.append(self._free.pop())

    def free(self, seq_id: int) -> None:
        self._free.extend(reversed(self._tables.pop(seq_id, [])))

    def _slots(self, seq_id: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables[seq_id]
        pos = torch.arange(start, start + n)
        if start + n > len(table) * self.page_size:
            raise KVCapacityError(f"sequence {seq_id}: position {start + n - 1} beyond its reserved pages")
        pages = torch.tensor(table, dtype=torch.int64)[pos // self.page_size]
        return pages.to(self.k_pages.device), (pos % self.page_size).to(self.k_pages.device)

    def write(self, layer_idx: int, seq_id: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):
            self.nonfinite.record(
                seq_id, f"non-finite K/V at layer {layer_idx}, positions {start_pos}..{start_pos + k.shape[0] - 1}"
            )
            k, v = zero_nonfinite(k), zero_nonfinite(v)
        self._store(layer_idx, seq_id, start_pos, k, v)

    def _store(self, layer_idx: int, seq_id: int, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pages, offs = self._slots(seq_id, start_pos, k.shape[0])
        self.k_pages[layer_idx, pages, offs] = k.to(self.k_pages.dtype)
        self.v_pages[layer_idx, pages, offs] = v.to(self.v_pages.dtype)

    def write_decode(
        self, layer_idx: int, seq_ids: tuple[int, ...], positions: tuple[int, ...], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        k, v, bad = zero_nonfinite_rows(k, v)  # no host sync: the flags are read once per step
        self.nonfinite.record_rows(layer_idx, seq_ids, positions, bad)
        S = self.page_size
        for seq_id, pos in zip(seq_ids, positions, strict=True):
            if pos >= len(self._tables[seq_id]) * S:
                raise KVCapacityError(f"sequence {seq_id}: position {pos} beyond its reserved pages")
        dev = self.k_pages.device
        pages = torch.tensor([self._tables[s][p // S] for s, p in zip(seq_ids, positions, strict=True)]).to(dev)
        offs = torch.tensor([p % S for p in positions]).to(dev)
        self.k_pages[layer_idx, pages, offs] = k.to(self.k_pages.dtype)  # one row per sequence
        self.v_pages[layer_idx, pages, offs] = v.to(self.v_pages.dtype)

    def roundtrip(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """k, v [n, Hkv, Dh] as they read back from these pages (a cast there and back), fp32."""
        return k.to(self.k_pages.dtype).float(), v.to(self.v_pages.dtype).float()

    def read(self, layer_idx: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        pages, offs = self._slots(seq_id, 0, length)
        k = self.k_pages[layer_idx, pages, offs]  # [L, Hkv, Dh]
        v = self.v_pages[layer_idx, pages, offs]
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def read_decode(
        self, layer_idx: int, seq_ids: tuple[int, ...], lengths: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, dev = len(seq_ids), max(lengths, default=0), self.k_pages.device
        idx, valid = batch_page_index([self._tables[s] for s in seq_ids], lengths, self.page_size, dev)
        out = []
        for pages in (self.k_pages, self.v_pages):
            x = pages[layer_idx][idx].reshape(B, -1, *pages.shape[3:])[:, :L]  # [B, L, Hkv, Dh]
            x = torch.where(valid[:, :, None, None], x, torch.zeros((), dtype=x.dtype, device=dev))
            out.append(x.to(self.compute_dtype))
        return out[0], out[1]


def make_kv_partition(
    kv_format: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_pages: int,
    page_size: int,
    compute_dtype: torch.dtype,
    device: torch.device,
    kv_params: Sequence[tuple] | None = None,
) -> KVPartition:
    """The rank's KV partition in `kv_format` ("fp2[:options]", "fp8", "bf16", "fp16", "fp32").

    fp2 / fp8 / bf16 use runtime/kv's paged caches (page size a multiple of 32); fp32 / fp16 use
    `TorchPagedKV`. kv_params: FP2 only, (k, v)
    `SideParams` per layer (the engine's calibration); None: the format's uncalibrated constants.

    Raises:
        ConfigError: an unknown format, a bad page size, or
            params for a format without any.
    """
    if kv_params is not None and not kv_format.startswith("fp2"):
        raise ConfigError(f"KV params were given for {kv_format!r}, which takes none (FP2 only)")
    from zerodram.runtime.engine.kv_adapter import RuntimeKVPartition

    try:
        if kv_format in TORCH_PAGED_FORMATS:
            return TorchPagedKV(
                num_layers, num_kv_heads, head_dim, num_pages, page_size, kv_format, compute_dtype, device
            )
        return RuntimeKVPartition(
            kv_format, num_layers, num_kv_heads, head_dim, num_pages, page_size, compute_dtype, device, kv_params
        )
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
        # MemoryError: the page allocator's free list; the CPU allocator's refusal and a size past
        # int64 are plain RuntimeErrors, told by their text (any other is not ours to rename)
        words = ("DefaultCPUAllocator", "size calculation overflowed")
        if isinstance(err, RuntimeError) and not isinstance(err, torch.OutOfMemoryError) and not any(
            w in str(err) for w in words
        ):
            raise
        raise ConfigError(
            f"the KV partition ({num_layers} layers x {num_pages} pages of {page_size} tokens, {kv_format}) does "
            f"not fit in {device} memory: lower --num-kv-pages or --page-size "
            f"({type(err).__name__}: {(str(err).splitlines() or [''])[0]})"
        ) from None
