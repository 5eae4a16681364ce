"""The two KV paths of `zerodram bench decode` (benchmarks/decode.py, whose docstring says what each
stores and reads): how one layer's decode step keeps its keys and values, writes the new token's,
attends, and how many bytes that reads. Both write the same row every pass: the work is what
counts, not the values.

Shape legend: B sequences, L context tokens per sequence, Hq / Hkv heads, Dh head dim, P page size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

PAGE, NUM_SINKS, TAIL = 64, 4, 32  # FP2 layout: 4 sinks + up to 32 tail tokens in bf16 (HP = 36)


class Fp2PathKV:
    """FP2 pages for B sequences of L tokens (L - 36 FP2 tokens + 36 bf16), the decode kernel that
    reads them, the stored space's rotations and anchors, and the engine's decode write."""

    name = "DEFAULT_FP2 static write"

    def __init__(self, cfg: Any, dev: Any, B: int, L: int, gen: Any) -> None:
        import torch

        from zerodram.runtime.attention import Fp2DecodeAttention, random_decode_batch, random_fp2_layer

        self.cfg, self.G = cfg, cfg.num_heads // cfg.num_kv_heads
        hp = self.hp = min(L, NUM_SINKS + TAIL)
        self.n_fp2 = L - hp
        pages = max(1, B * math.ceil(self.n_fp2 / PAGE))
        self.cache, self.index = self._writer(cfg, dev, B, L, gen)
        v_layout = self.cache.v.layout  # the value layout the engine's cache stores (and its kernel reads)
        self.layer = random_fp2_layer(
            pages, cfg.num_kv_heads, PAGE, cfg.head_dim, device=dev, generator=gen, v_layout=v_layout
        )
        self.batch = random_decode_batch(
            [self.n_fp2] * B, [hp] * B, pages, cfg.num_kv_heads, PAGE, cfg.head_dim, hp_max=NUM_SINKS + TAIL,
            device=dev, generator=gen,
        )  # fmt: skip
        self.attn = Fp2DecodeAttention(
            num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=PAGE,
            max_batch=B, max_fp2_tokens=max(self.n_fp2, 1), device=dev, v_layout=v_layout,
        )  # fmt: skip
        # The cache's stored space: a random rotation per side and unit anchors (values don't matter).
        self.rot = torch.linalg.qr(torch.randn(2, cfg.head_dim, cfg.head_dim, device=dev, generator=gen))[0]
        self.anchor = torch.ones(cfg.num_kv_heads, cfg.head_dim, device=dev)
        # per token and kv head: Dh/4 code bytes + Dh/64 e4m3 scale bytes, for K and V; bf16 sinks and tail
        self.kv_bytes = B * cfg.num_kv_heads * (self.n_fp2 * 2 * (cfg.head_dim // 4 + cfg.head_dim // 64))
        self.kv_bytes += B * cfg.num_kv_heads * hp * cfg.head_dim * 2 * 2

    @staticmethod
    def _writer(cfg: Any, dev: Any, B: int, L: int, gen: Any) -> tuple:
        """(cache, static index) for the engine's decode write of B sequences that hold L tokens:
        an `Fp2KVCache` of `DEFAULT_FP2` whose block tables name one page per FP2 page of the
        sequence (the write touches only the current one), positioned at L."""
        import torch

        from zerodram.runtime.kv.cache import make_kv_cache
        from zerodram.runtime.kv.decode_index import StaticDecodeIndex
        from zerodram.runtime.kv.format import DEFAULT_FP2

        H, D = cfg.num_kv_heads, cfg.head_dim
        cache = make_kv_cache(
            DEFAULT_FP2, num_pages=3 * B + 1, page_size=PAGE, num_kv_heads=H, head_dim=D, max_seqs=B,
            max_pages_per_seq=L // PAGE + 2, device=dev,
        )  # fmt: skip
        factor = torch.eye(D, device=dev) + 0.1 * torch.randn(H, D, D, device=dev, generator=gen).tril(-1)
        cache.params = tuple(
            dataclasses.replace(p, feedback=factor) if side.feedback else p
            for p, side in zip(cache.params, (cache.spec.k, cache.spec.v), strict=True)
        )
        for _ in range(B):
            sid = cache.new_sequence()
            page = cache.allocator.allocate(1)[0]
            cache.tables.pages[sid] = [page] * cache._pages_needed(L, 0)
            cache.tables.lens[sid] = L
        ix = StaticDecodeIndex.allocate(B, dev)
        ix.fill(cache.plan_decode_static(range(B)), cache.scratch_slot, cache.scratch_page)
        return cache, ix

    @property
    def keys(self) -> str | None:
        """The kernel variant's key product (int8 or fp16) on a GPU; None for the CPU reference."""
        return ("int8" if self.attn.key_s8 else "fp16") if self.attn.on_gpu else None

    def write(self, k: Any, v: Any) -> None:
        """k, v: [B, Hkv, Dh], the new token's."""
        self.cache.write_decode_static(k, v, self.index)

    def attend(self, q: Any) -> Any:
        """q: [B, Hq, Dh] after RoPE -> o [B, Hq, Dh] fp32."""
        from zerodram.runtime.attention import finish_output, prepare_query

        q_stored = prepare_query(q, self.rot[0], self.anchor, self.G)
        o = self.attn(q_stored, self.layer, self.batch, max_len=max(self.n_fp2, 1))  # [B, Hq, Dh]
        return finish_output(o, self.rot[1], self.anchor, self.G)


class Bf16PathKV:
    """Contiguous bf16 keys and values [B, Hkv, L, Dh], read by SDPA."""

    name = "bf16 row store"
    keys = None

    def __init__(self, cfg: Any, dev: Any, B: int, L: int, gen: Any) -> None:
        import torch

        shape = (B, cfg.num_kv_heads, L, cfg.head_dim)  # [B, Hkv, L, Dh]
        self.k = torch.randn(shape, device=dev, generator=gen, dtype=torch.bfloat16)
        self.v = torch.randn(shape, device=dev, generator=gen, dtype=torch.bfloat16)
        self.kv_bytes = B * cfg.num_kv_heads * L * cfg.head_dim * 2 * 2

    def write(self, k: Any, v: Any) -> None:
        self.k[:, :, -1] = k
        self.v[:, :, -1] = v

    def attend(self, q: Any) -> Any:
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(q[:, :, None, :], self.k, self.v, enable_gqa=True)[:, :, 0, :]
