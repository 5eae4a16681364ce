"""Paged bf16 / FP8-e4m3 caches: the baselines the FP2 cache is compared with.

Pages: k_pages, v_pages [num_pages, H, P, D] (bf16, or float8_e4m3fn with a static scale of 1).
Token j of a sequence is row j % P of page block_table[j // P].
"""

from __future__ import annotations

import torch

from zerodram.runtime.kv.cache import KVCache, batch_page_index
from zerodram.runtime.kv.format import DenseSpec, bits_per_elem


class DenseKVCache(KVCache):
    """bf16 or fp8 (e4m3, values clamped to +-448) pages, no high-precision region."""

    def __init__(self, *, dtype: str = "bf16", **kwargs) -> None:
        super().__init__(**kwargs)
        self.format = dtype
        self.spec = DenseSpec(dtype=dtype)  # type: ignore[arg-type]
        self.dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[dtype]
        shape = (self.num_pages, self.num_kv_heads, self.page_size, self.head_dim)
        self.k_pages = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [num_pages, H, P, D]
        self.v_pages = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _pages_needed(self, pos0: int, num_tokens: int) -> int:
        return -(-(pos0 + num_tokens) // self.page_size)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float8_e4m3fn:
            x = x.float().clamp(-448, 448)
        return x.to(self.dtype)

    def _write(self, seq_id, pos0, k, v):
        pages = self.tables.pages[seq_id]
        for j in range(k.shape[0]):
            p, r = divmod(pos0 + j, self.page_size)
            self.k_pages[pages[p], :, r] = self._encode(k[j])
            self.v_pages[pages[p], :, r] = self._encode(v[j])

    def _write_decode(self, seq_ids, pos0, k, v):
        pages = [self.tables.pages[sid][p // self.page_size] for sid, p in zip(seq_ids, pos0, strict=True)]
        page_t = torch.tensor(pages, dtype=torch.long).to(self.device, non_blocking=True)  # [B]
        row_t = torch.tensor([p % self.page_size for p in pos0], dtype=torch.long).to(self.device, non_blocking=True)
        self.k_pages[page_t, :, row_t] = self._encode(k)  # [B, H, D] into (page, :, row) of each
        self.v_pages[page_t, :, row_t] = self._encode(v)

    def _copy_page(self, src, dst):
        self.k_pages[dst] = self.k_pages[src]
        self.v_pages[dst] = self.v_pages[src]

    def gather(self, seq_id):
        n = self.seq_len(seq_id)
        idx = torch.tensor(self.tables.pages[seq_id], dtype=torch.long, device=self.device)
        k = self.k_pages[idx].float().transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)
        v = self.v_pages[idx].float().transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)
        return k[:n], v[:n]

    def gather_batch(self, seq_ids, lengths):
        # one page gather for the whole batch; rows past each length zeroed (other tokens, stale data)
        self._check_gather(seq_ids, lengths)
        P, B, L = self.page_size, len(seq_ids), max(lengths, default=0)
        idx, valid = batch_page_index([self.tables.pages[s] for s in seq_ids], lengths, P, self.device)  # [B, W], [B, L]
        out = []
        for pages in (self.k_pages, self.v_pages):
            x = pages[idx].transpose(2, 3).reshape(B, -1, self.num_kv_heads, self.head_dim)[:, :L]  # [B, L, H, D]
            out.append(torch.where(valid[:, :, None, None], x, torch.zeros((), dtype=x.dtype, device=x.device)))
        return out[0], out[1]

    def bits_per_elem(self, ctx):
        return bits_per_elem(self.spec, ctx, self.head_dim)
