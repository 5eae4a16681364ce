"""The paged KV cache interface and its factory; one cache object holds one layer.

Dimensions: T tokens appended in one call, H KV heads, D head dim, P page size, n sequence length.

Formats (chosen once, at construction): 'fp2' (docs/fp2-format.md), 'bf16', 'fp8' (e4m3, scale 1).
Every format shares the page allocator and block tables; only the page contents differ.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from zerodram.runtime.device import canonical_device
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.allocator import BlockTables, PageAllocator
from zerodram.runtime.kv.errors import KVInputError
from zerodram.runtime.kv.format import check_paged_kv
from zerodram.runtime.kv.quantize import check_finite


class KVCache(ABC):
    """One layer's paged KV cache for up to `max_seqs` sequences.

    Args:
        num_pages: size of the page pool (shared by all sequences).
        page_size: tokens per page (multiple of 32).
        num_kv_heads, head_dim: shape of one token's K (and V).
        max_seqs: sequence slots; max_pages_per_seq bounds the block table width.
        device: where every tensor of the cache lives; inputs must be there too.
    """

    format: str = ""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_seqs: int = 8,
        max_pages_per_seq: int | None = None,
        device: torch.device | str = "cpu",
        layer_idx: int = 0,
    ) -> None:
        check_paged_kv(page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = canonical_device(device)
        self.layer_idx = layer_idx
        self.allocator = PageAllocator(num_pages)
        self.tables = BlockTables(max_seqs, max_pages_per_seq or num_pages)

    # -- sequence lifetime --
    def new_sequence(self) -> int:
        """Open an empty sequence; returns its id. Raises KVCapacityError when no slot is free."""
        sid = self.tables.open()
        self._reset_slot(sid)
        return sid

    def free(self, seq_id: int) -> None:
        """Release a sequence's pages and slot."""
        self.allocator.release(self.tables.close(seq_id))

    def seq_len(self, seq_id: int) -> int:
        self.tables.check(seq_id)
        return self.tables.lens[seq_id]

    def fork(self, seq_id: int) -> int:
        """A new sequence holding a copy of `seq_id` (pages copied, not shared).

        Raises:
            KVCapacityError: not enough free pages or slots (nothing changes).
        """
        self.tables.check(seq_id)
        src = self.tables.pages[seq_id]
        pages = self.allocator.allocate(len(src))
        try:
            sid = self.tables.open()
        except Exception:
            self.allocator.release(pages)
            raise
        self.tables.pages[sid] = pages
        self.tables.lens[sid] = self.tables.lens[seq_id]
        for s, d in zip(src, pages, strict=True):
            self._copy_page(s, d)
        self._copy_slot(seq_id, sid)
        return sid

    # -- writing --
    def append(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T tokens (T = 1 for decode, a prefill chunk otherwise). k, v: [T, H, D].

        Token by token and as one chunk give identical cache contents.

        Raises:
            KVInputError: unknown sequence, wrong shape / dtype / device, NaN or Inf (nothing written).
            KVCapacityError: the page pool cannot hold the new tokens (nothing written).
        """
        self.tables.check(seq_id)
        self._check_pair(k, v)
        pos0 = self.tables.lens[seq_id]
        check_finite(k, what="K", layer_idx=self.layer_idx, pos0=pos0)
        check_finite(v, what="V", layer_idx=self.layer_idx, pos0=pos0)
        self._grow([(seq_id, self._pages_needed(pos0, k.shape[0]))])
        self._write(seq_id, pos0, k, v)
        self.tables.lens[seq_id] = pos0 + k.shape[0]

    def append_decode(
        self, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, *, on_nonfinite: str = "raise"
    ) -> torch.Tensor | None:
        """Append one token to each of B distinct sequences (a decode step). k, v: [B, H, D].

        The same cache contents as B calls of `append(seq_ids[i], k[i:i+1], v[i:i+1])`, in a
        number of tensor operations that does not grow with B (the formats batch the writes).
        NaN/Inf: `on_nonfinite="raise"` checks the batch once (one host sync) and raises before
        writing anything; `"zero"` does not sync: it stores zeros for every non-finite element and
        returns bool [B] on the device, True for the rows that had one (the caller must treat
        those sequences as failed). Any other error leaves the cache unchanged.

        Raises:
            KVInputError: unknown or repeated sequence, wrong shape / dtype / device, NaN or Inf
                (raise mode).
            KVCapacityError: the page pool or a block table cannot hold the new tokens.
        """
        if on_nonfinite not in ("raise", "zero"):
            raise ConfigError(f"on_nonfinite must be 'raise' or 'zero', got {on_nonfinite!r}")
        seq_ids = self._decode_seqs(seq_ids)
        self._check_pair(k, v)
        if k.shape[0] != len(seq_ids):
            raise KVInputError(f"K and V are {tuple(k.shape)}, need [{len(seq_ids)}, H, D]: one row per sequence")
        pos0 = [self.tables.lens[sid] for sid in seq_ids]
        bad = None
        if on_nonfinite == "zero":
            k, v, bad = zero_nonfinite_rows(k, v)
        elif not bool(torch.isfinite(k).all() & torch.isfinite(v).all()):  # one host sync for the batch
            for i, p in enumerate(pos0):  # the error path: name the first offender
                check_finite(k[i : i + 1], what="K", layer_idx=self.layer_idx, pos0=p)
                check_finite(v[i : i + 1], what="V", layer_idx=self.layer_idx, pos0=p)
        self._grow([(sid, self._pages_needed(p, 1)) for sid, p in zip(seq_ids, pos0, strict=True)])
        self._write_decode(seq_ids, pos0, k, v)
        for sid, p in zip(seq_ids, pos0, strict=True):
            self.tables.lens[sid] = p + 1
        return bad

    def _decode_seqs(self, seq_ids: Sequence[int]) -> list[int]:
        """The sequences of a decode append, checked: open and each named once."""
        seq_ids = list(seq_ids)
        for sid in seq_ids:
            self.tables.check(sid)
        if len(set(seq_ids)) != len(seq_ids):
            raise KVInputError(f"a decode append names a sequence twice: {seq_ids}")
        return seq_ids

    def _check_pair(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_input(k, "K")
        self._check_input(v, "V")
        if k.shape != v.shape:
            raise KVInputError(f"K has shape {tuple(k.shape)} but V has {tuple(v.shape)}")

    def _grow(self, wants: list[tuple[int, int]]) -> None:
        """Give each (sequence, pages it must hold) its missing pages: all of them, or none (raises
        KVCapacityError when the pool or a block table is short)."""
        need = [(sid, n - len(self.tables.pages[sid])) for sid, n in wants]
        need = [(sid, n) for sid, n in need if n > 0]
        total = sum(n for _, n in need)
        if total > self.allocator.num_free:
            self.allocator.allocate(total)  # raises KVCapacityError, takes nothing
        for sid, n in need:
            self._check_table_width(sid, n)
        for sid, n in need:
            self.tables.pages[sid].extend(self.allocator.allocate(n))

    def _write_decode(self, seq_ids: list[int], pos0: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token per sequence (pages already allocated); formats override with one batch."""
        for i, (sid, p) in enumerate(zip(seq_ids, pos0, strict=True)):
            self._write(sid, p, k[i : i + 1], v[i : i + 1])

    def _check_table_width(self, seq_id: int, need: int) -> None:
        from zerodram.runtime.kv.errors import KVCapacityError

        have = len(self.tables.pages[seq_id])
        if have + need > self.tables.max_pages_per_seq:
            raise KVCapacityError(
                f"sequence {seq_id} would need {have + need} pages, the block table holds "
                f"{self.tables.max_pages_per_seq}"
            )

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise KVInputError(f"{what} must be a tensor, got {type(x).__name__}")
        if x.dim() != 3 or tuple(x.shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise KVInputError(
                f"{what} must be [T, {self.num_kv_heads}, {self.head_dim}] (tokens, KV heads, head dim), "
                f"got {tuple(x.shape)}"
            )
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise KVInputError(f"{what} must be fp32, bf16 or fp16, got {x.dtype}")
        if x.device != self.device:
            raise KVInputError(f"{what} is on {x.device} but the cache lives on {self.device}")

    # -- reading --
    @abstractmethod
    def gather(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of a sequence read back, dequantized: (K, V), each fp32 [n, H, D]."""

    def gather_batch(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first lengths[i] tokens of each sequence, padded with zeros to L = max(lengths):
        (K, V), each [B, L, H, D], in the pages' dtype (dense formats) or fp32 (dequantized).

        Raises:
            KVInputError: an unknown sequence, or a length outside [0, its stored tokens].
        """
        self._check_gather(seq_ids, lengths)
        L = max(lengths, default=0)
        ks, vs = [], []
        for sid, n in zip(seq_ids, lengths, strict=True):
            k, v = self.gather(sid)  # [n', H, D]
            pad = (0, 0, 0, 0, 0, L - n)
            ks.append(torch.nn.functional.pad(k[:n], pad))
            vs.append(torch.nn.functional.pad(v[:n], pad))
        if not ks:
            empty = torch.zeros(0, 0, self.num_kv_heads, self.head_dim, device=self.device)
            return empty, empty
        return torch.stack(ks), torch.stack(vs)

    def _check_gather(self, seq_ids: Sequence[int], lengths: Sequence[int]) -> None:
        # Past its stored tokens a batched gather would read pages the sequence does not hold
        # (another sequence's, or the pad page 0 of `batch_page_index`) or return a short row.
        for sid, n in zip(seq_ids, lengths, strict=True):
            if not 0 <= n <= self.seq_len(sid):
                raise KVInputError(f"gather of {n} tokens of sequence {sid}, which holds {self.seq_len(sid)}")

    @abstractmethod
    def bits_per_elem(self, ctx: int) -> float:
        """All-inclusive storage bits per element at context `ctx` (see format.bits_per_elem)."""

    # -- format hooks --
    @abstractmethod
    def _pages_needed(self, pos0: int, num_tokens: int) -> int: ...

    @abstractmethod
    def _write(self, seq_id: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    @abstractmethod
    def _copy_page(self, src: int, dst: int) -> None: ...

    def _reset_slot(self, seq_id: int) -> None:
        """Clear per-slot storage (the FP2 high-precision region); none by default."""
        return

    def _copy_slot(self, src: int, dst: int) -> None:
        """Copy per-slot storage on fork; none by default."""
        return


def zero_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """x with every NaN/Inf replaced by 0 (on the device, no sync)."""
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def zero_nonfinite_rows(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [B, ...] with NaN/Inf replaced by 0, and bool [B]: the rows that had one (device, no sync).

    A finite value is left exactly as it is, so an element changed iff it was NaN or +-Inf (NaN
    differs from everything, 0 from +-Inf). Seven elementwise / reduction kernels: this runs in
    every layer of every decode step."""
    zk = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
    zv = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    bad = (zk != k).flatten(1).any(1) | (zv != v).flatten(1).any(1)
    return zk, zv, bad


def batch_page_index(
    tables: Sequence[Sequence[int]], lengths: Sequence[int], page_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages holding the first lengths[i] tokens of each block table, for one batched gather:
    int64 [B, W] page ids (W pages of the longest; 0 pads) and bool [B, L] (L = max(lengths)),
    True where a row of the gathered [B, W * page_size] tokens is one of the sequence's."""
    L = max(lengths, default=0)
    W = max(1, -(-L // page_size))
    rows = [list(t[: -(-n // page_size)]) for t, n in zip(tables, lengths, strict=True)]
    idx = torch.tensor([r + [0] * (W - len(r)) for r in rows], dtype=torch.long).to(device)
    valid = (torch.arange(L)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]).to(device)
    return idx, valid


def make_kv_cache(format: str = "fp2", **kwargs) -> KVCache:
    """A paged cache of the given format.

    format: 'bf16', 'fp8', or an FP2 spec string ('fp2' or 'fp2:...', see format.parse_kv_spec).
    kwargs: those of KVCache; FP2 also takes `params=(k_params, v_params)` (SideParams of this
    layer, default: uncalibrated constants from the spec).

    Raises:
        ConfigError: unknown format, or an FP2 option the paged cache does not support.
    """
    from zerodram.runtime.kv.dense_cache import DenseKVCache
    from zerodram.runtime.kv.format import DenseSpec, Fp2Spec, parse_kv_spec
    from zerodram.runtime.kv.fp2_cache import Fp2KVCache

    spec = parse_kv_spec(format).spec
    if isinstance(spec, DenseSpec) and spec.dtype in ("bf16", "fp8"):
        return DenseKVCache(dtype=spec.dtype, **kwargs)
    if isinstance(spec, Fp2Spec):
        kwargs.setdefault("page_size", spec.page_size)
        return Fp2KVCache(spec=spec, **kwargs)
    raise ConfigError(f"no paged cache for format {format!r} (bf16, fp8, fp2[:...])")
