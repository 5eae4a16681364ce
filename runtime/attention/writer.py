"""`Fp2Writer`: stored-space K/V tokens quantized into FP2 pages, by the CUDA write kernel or the
reference quantizer (chosen at construction).

Shape legend: N written tokens, Hkv kv heads, D head dim, NP pages, P page size.
"""

from __future__ import annotations

import torch

from zerodram.runtime.attention.inputs import Fp2Layer, expect_input
from zerodram.runtime.device import canonical_device
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.errors import KVInputError
from zerodram.runtime.kv.pack import CodeLayout


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
        fp2_idx[i] of block-table row seq_idx[i] (pages must be allocated)."""
        N, Hkv, _, D = y.shape
        expect_input(y, "y", torch.float32, (N, Hkv, 2, self.head_dim), self.device)
        expect_input(seq_idx, "seq_idx", torch.int32, (N,), self.device)
        expect_input(fp2_idx, "fp2_idx", torch.int32, (N,), self.device)
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

        P = layer.k_codes.shape[2]
        page = block_table[seq_idx.long(), (fp2_idx // P).long()].long()
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
