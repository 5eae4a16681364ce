"""Shared by the paged-cache tests (test_kv_cache.py, test_kv_decode_write.py): the test sizes,
the formats every test runs, a cache of them, and self-checking tokens."""

from __future__ import annotations

import torch

from zerodram.runtime.kv.cache import make_kv_cache

H, D, P = 2, 64, 64
FORMATS = [
    "bf16",
    "fp8",
    "fp2",
    "fp2:kblk=t32,vblk=c32,scale=e8m0,asym=1,rot=0",
    "fp2:sinks=0,tail=64",
    "fp2:tail=1,window=32",
    "fp2:kblk=t16,tail=16,window=8",
]


def make_cache(fmt: str, num_pages: int = 8, head_dim: int = D, **kw):
    """A cache of format `fmt` at the test sizes (H KV heads of D channels, pages of P tokens)."""
    return make_kv_cache(fmt, num_pages=num_pages, page_size=P, num_kv_heads=H, head_dim=head_dim, **kw)


def kv_tokens(n: int, seed: int = 0, head_dim: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V whose values encode their token index (self-checking rows)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.float32)[:, None, None]
    k = torch.randn(n, H, head_dim, generator=gen) + 0.01 * pos
    v = torch.randn(n, H, head_dim, generator=gen) - 0.01 * pos
    return k, v
