"""`Fp2Writer`: stored-space K/V tokens quantized into FP2 pages, by the CUDA write kernel or the
reference quantizer (chosen at construction).

Shape legend: N written tokens, Hkv kv heads, D head dim, NP pages, P page size.
"""

from __future__ import annotations

import math

import torch

from zerodram.runtime.attention.inputs import Fp2Layer, expect_input, expect_layer
from zerodram.runtime.device import canonical_device
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.errors import KVInputError, KVNonFiniteError
from zerodram.runtime.kv.pack import CodeLayout
from zerodram.runtime.kv.quantize import STORED_MAX


class Fp2Writer:
    """Quantize stored-space K/V tokens into FP2 pages (the CUDA write kernel, or the reference).

    Channel blocks, symmetric, no outliers; rule 'absmax' or 'mse' per side, as runtime/kv's
    quantizer; value pages in the token or the quad layout (`v_layout`, as `Fp2Layer`). Raises
    ConfigError for a format the kernel does not write.
    """

    def __init__(
        self, *, head_dim: int, k_block: int = 64, v_block: int = 64, scale_dtype: str = "e4m3",
        k_rule: str = "mse", v_rule: str = "mse", device: torch.device | str = "cpu", v_layout: CodeLayout = "token",
    ) -> None:  # fmt: skip
        if k_rule not in ("absmax", "mse") or v_rule not in ("absmax", "mse"):
            raise ConfigError(f"the write kernel implements absmax and mse, got {k_rule!r} / {v_rule!r}")
        if scale_dtype not in ("e4m3", "e8m0"):
            raise ConfigError(f"the write kernel writes e4m3 or e8m0 scales, got {scale_dtype!r}")
        if head_dim not in (64, 128) or head_dim % k_block or head_dim % v_block:
            raise ConfigError(
                f"blocks ({k_block}, {v_block}) must divide a head dim of 64 or 128, got {head_dim}"
            )
        if v_layout not in ("token", "quad"):
            raise ConfigError(f"v_layout must be 'token' or 'quad', got {v_layout!r}")
        self.head_dim, self.k_block, self.v_block, self.scale_dtype = head_dim, k_block, v_block, scale_dtype
        self.rules, self.v_layout = (k_rule, v_rule), v_layout
        self.device = canonical_device(device)
        self.on_gpu = self.device.type == "cuda"
        from zerodram.runtime.kv.quantize import MSE_FRACTIONS

        self.fracs = MSE_FRACTIONS.float().to(self.device)
        if self.on_gpu:
            from zerodram.kernels.attention import Fp2KernelConfig, Fp2Kernels

            cfg = Fp2KernelConfig(head_dim, 1, k_block, v_block, scale_dtype, v_quad=v_layout == "quad")
            self.kernels = Fp2Kernels(cfg)
            _ = self.kernels._write

    def write(
        self,
        y: torch.Tensor,
        seq_idx: torch.Tensor,
        fp2_idx: torch.Tensor,
        layer: Fp2Layer,
        block_table: torch.Tensor,
    ) -> None:
        """y [N, Hkv, 2, D] fp32 (K, V in the stored space) -> codes and scales of FP2 token
        fp2_idx[i] of block-table row seq_idx[i] (pages must be allocated).

        seq_idx, fp2_idx: [N] int32. block_table: [B, max_pages] int32 (-1: no page), as
        `DecodeBatch.block_table`. What is checked where: on every call, host only (no sync, so a
        CUDA graph may capture the GPU write, as benchmarks/attention.py does), the dtypes, shapes,
        devices and contiguity of every input, and the layer's pools against this writer's head
        dim and blocks. On CPU also the values: seq_idx within the table's rows, fp2_idx within its
        pages, the page ids found there within the pool, y finite and within +-STORED_MAX (2^56,
        the stored range, where the kernel equals this reference). On a GPU the values are the caller's (reading
        them back would sync every call): the kernel reads the table and writes through its page ids
        unchecked (docs/fp2-kernel.md), and nothing refuses a NaN or Inf in y, or a value past the
        stored range (finite codes and scales still; with E8M0 scales, from ~2^60, not the CPU's).

        Raises:
            KVInputError: any of the above, before anything is written (KVNonFiniteError for
                NaN/Inf in y).
        """
        N, Hkv = y.shape[:2] if y.dim() == 4 else (-1, -1)
        D = self.head_dim
        expect_input(y, "y", torch.float32, (N, Hkv, 2, D), self.device)
        expect_input(seq_idx, "seq_idx", torch.int32, (N,), self.device)
        expect_input(fp2_idx, "fp2_idx", torch.int32, (N,), self.device)
        if block_table.dim() != 2:
            raise KVInputError(f"block_table has shape {tuple(block_table.shape)}, expected [B, max_pages]")
        expect_input(block_table, "block_table", torch.int32, block_table.shape, self.device)
        P = layer.k_codes.shape[2] if layer.k_codes.dim() == 4 else -1
        expect_layer(layer, Hkv, P, D, self.k_block, self.v_block, self.device)
        if layer.v_layout != self.v_layout:
            raise KVInputError(f"value pages in the {layer.v_layout!r} layout, the writer stores {self.v_layout!r}")
        if N == 0:
            return
        if self.on_gpu:
            rules = int(self.rules[0] == "mse") | (int(self.rules[1] == "mse") << 1)
            self.kernels.write(
                y, seq_idx, fp2_idx, block_table, layer.k_codes, layer.k_scales, layer.v_codes,
                layer.v_scales, layer.levels, self.fracs, rules,
            )  # fmt: skip
            return
        from zerodram.runtime.kv.pack import pack_codes, store_quad_rows
        from zerodram.runtime.kv.quantize import quantize_blocks
        from zerodram.runtime.kv.scales import encode_scale

        page = _checked_pages(y, seq_idx, fp2_idx, block_table, layer.k_codes.shape[0], P)  # [N]
        slot = (fp2_idx % P).long()
        for side, (bs, codes_t, scales_t) in enumerate(
            ((self.k_block, layer.k_codes, layer.k_scales), (self.v_block, layer.v_codes, layer.v_scales))
        ):
            yb = y[:, :, side].reshape(N, Hkv, D // bs, bs)
            codes, scales, _ = quantize_blocks(
                yb, layer.levels[4 * side : 4 * side + 4], rule=self.rules[side], scale_dtype=self.scale_dtype
            )
            if side == 1 and self.v_layout == "quad":
                store_quad_rows(codes_t, page, slot, codes.reshape(N, Hkv, D))
            else:
                codes_t[page, :, slot] = pack_codes(codes.reshape(N, Hkv, D))
            scales_t[page, :, slot] = encode_scale(scales, self.scale_dtype)


def _checked_pages(
    y: torch.Tensor, seq_idx: torch.Tensor, fp2_idx: torch.Tensor, block_table: torch.Tensor, NP: int, P: int
) -> torch.Tensor:
    """The CPU write's value checks (`Fp2Writer.write`); returns each token's page id, int64 [N]."""
    rows, width = block_table.shape
    bad = (seq_idx < 0) | (seq_idx >= rows) | (fp2_idx < 0) | (fp2_idx >= width * P)  # [N]
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise KVInputError(
            f"token {i}: seq_idx {int(seq_idx[i])}, fp2_idx {int(fp2_idx[i])} outside the block table "
            f"({rows} rows of {width} pages of {P} tokens)"
        )
    page = block_table[seq_idx.long(), (fp2_idx // P).long()].long()  # [N]
    bad = (page < 0) | (page >= NP)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise KVInputError(
            f"token {i}: FP2 token {int(fp2_idx[i])} of block-table row {int(seq_idx[i])} is in page "
            f"{int(page[i])}, outside the pool of {NP} pages (-1: none allocated)"
        )
    bad = ~(y.abs() <= STORED_MAX)  # [N, Hkv, 2, D]: NaN, +-Inf, or past the stored range
    if bool(bad.any()):  # worded as the cache's appends word it (runtime/kv/quantize.check_finite)
        i, h, side, c = (int(j) for j in bad.nonzero()[0])
        value = float(y[i, h, side, c])
        where = (
            f"{'KV'[side]} value {value} at token {i} (block-table row {int(seq_idx[i])}, "
            f"FP2 token {int(fp2_idx[i])}), KV head {h}, channel {c}"
        )
        if not math.isfinite(value):
            raise KVNonFiniteError(where)
        # Past the stored range: from ~2^60 the E8M0 write kernel's fp32 squared errors overflow and
        # it keeps the first candidate scale, unlike this reference.
        raise KVInputError(f"{where} is past the stored range +-2^56 (STORED_MAX); nothing was written")
    return page
