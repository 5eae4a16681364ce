"""The paged FP2 cache (layout of docs/fp2-format.md, "Physical layout").

Dimensions: T tokens, H KV heads, D head dim, P page size, S sinks, F tail capacity, BS block size.

Writes go to the bf16 high-precision region first: sinks, then the tail. When the tail holds
W + F tokens (window W, flush F) its oldest F are *flushed*: they join the FP2 range that readers
attend, and the remaining W rows move up. A token's codes are written earlier, when it *arrives*
(with F > 1: when the F-token group it belongs to is complete): quantized from its bf16 row into
its own page row, W tokens before readers reach it. A token's codes depend only on its own values
and the layer's constants, never on its neighbours in time, so they are the same bits whenever
they are computed; writing them at arrival lets the engine quantize a decode step's new tokens off
the step's critical path (docs/fp2-kernel.md, "Codes at arrival"). Page rows from the FP2 range's
end up to the newest group hold codes that no reader attends yet. Because every quantization reads
the same bf16 values, appending token by token and appending a chunk produce identical pages.
"""

from __future__ import annotations

import torch

from zerodram.kernels.feedback import load_feedback_kernel, supports_head_dim
from zerodram.runtime.errors import ConfigError
from zerodram.runtime.kv.cache import KVCache
from zerodram.runtime.kv.decode_index import DecodeIndexMemo
from zerodram.runtime.kv.feedback import block_mask
from zerodram.runtime.kv.format import Fp2Spec, Fp2TensorSpec, bits_per_elem, check_paged_kv, tail_rule
from zerodram.runtime.kv.fp2_decode_write import Fp2DecodeWrites
from zerodram.runtime.kv.fp2_pages import SidePages, value_layout
from zerodram.runtime.kv.params import layer_params
from zerodram.runtime.kv.quantize import (
    SideParams,
    _block_view,
    _unblock,
    dequantize_blocks,
    from_stored_space,
    quantize_stored,
    to_stored_space,
)
from zerodram.runtime.kv.scales import decode_scale, encode_scale


class Fp2KVCache(Fp2DecodeWrites, KVCache):
    """FP2 pages plus a bf16 region of S + F rows per sequence slot. The decode-time writes (one
    token per sequence, eager or fixed-shape for CUDA graphs) are `Fp2DecodeWrites`
    (runtime/kv/fp2_decode_write.py).

    Args:
        spec: the FP2 format (page size taken from the cache arguments; must equal spec.page_size
            or divide by the tail).
        params: (k_params, v_params) SideParams of this layer; default: uncalibrated constants.
        static_kernel: whether `write_decode_static` runs as one kernel (kernels/kv_write.py) or as
            its torch body; default: the kernel where the device and the format allow it.
    """

    format = "fp2"

    def __init__(
        self,
        *,
        spec: Fp2Spec,
        params: tuple[SideParams, SideParams] | None = None,
        static_kernel: bool | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        check_paged_kv(self.page_size, spec)
        for name, side in (("k", spec.k), ("v", spec.v)):
            if side.block_axis == "channel" and self.head_dim % side.block_size:
                raise ConfigError(
                    f"{name} channel blocks of {side.block_size} do not divide head dim {self.head_dim}"
                )
        if self.head_dim % 16:
            raise ConfigError(f"head dim {self.head_dim} is not a multiple of 16 codes per word")
        self.spec = spec
        H, D, P, dev = self.num_kv_heads, self.head_dim, self.page_size, self.device
        if params is None:
            params = layer_params(spec, self.layer_idx, H, D)
        # One page and one slot past the pool's are never handed out: a fixed-shape decode write
        # (`write_decode_static`) sends its padding rows there, and a sink's codes to the page.
        self.scratch_page, self.scratch_slot = self.num_pages, self.tables.max_seqs
        self.k = SidePages(spec.k, self.num_pages + 1, H, P, D, dev, "token")
        self.v = SidePages(spec.v, self.num_pages + 1, H, P, D, dev, value_layout(spec.v, D, P))
        self.rule = tail_rule(spec)
        rows = self.rule.hp_rows + 1  # +1: the arriving token is staged here before a flush
        n_slots = self.tables.max_seqs + 1
        self.hp_k = torch.zeros(
            n_slots, H, rows, D, dtype=torch.bfloat16, device=dev
        )  # [slots + 1, H, hp_rows + 1, D]
        self.hp_v = torch.zeros(n_slots, H, rows, D, dtype=torch.bfloat16, device=dev)
        self.index_memo = DecodeIndexMemo()  # the owner may replace it with one its caches share
        self._static_write = self._static_writer(static_kernel)
        self.params = params  # (the setter moves them to the device and derives the kernels' constants)

    @property
    def params(self) -> tuple[SideParams, SideParams]:
        """(k, v) SideParams of this layer, on the cache's device."""
        return self._params

    @params.setter
    def params(self, params: tuple[SideParams, SideParams]) -> None:
        """Set before any CUDA graph captures this cache's writes: a graph keeps the addresses of
        the tensors derived here (and of the params' own), and a later set frees them.

        Raises:
            ConfigError: a feedback factor or levels the decode-write kernel cannot read, or a
                factor that reaches past the format's feedback blocks (`fbblk`).
        """
        dev, H, D = self.device, self.num_kv_heads, self.head_dim
        new = tuple(p.to(dev) for p in params)
        sides = (self.spec.k, self.spec.v)
        feedback = any(s.feedback and p.feedback is not None for s, p in zip(sides, new, strict=True))
        if feedback and dev.type == "cuda" and supports_head_dim(D):
            # compile the error-feedback kernel now, not at the first flush (which may be timed)
            load_feedback_kernel(D, dev)
        # The decode-write kernel's feedback rows: each factor row over its diagonal, the IEEE
        # quotients the torch loop and fp2_feedback.cu compute at each use (bit-identical codes).
        # Fresh contiguous tensors, so 16-byte aligned: the kernel reads them in float4 and stages
        # them by one bulk copy, which needs that alignment.
        fb_rows = tuple(
            (p.feedback.float() / p.feedback.float().diagonal(dim1=-2, dim2=-1)[..., None]).contiguous()
            if s.feedback and p.feedback is not None else None
            for s, p in zip(sides, new, strict=True)
        )  # fmt: skip
        levels = tuple(p.levels.float().contiguous() for p in new)
        for name, side, rows in zip("kv", sides, fb_rows, strict=True):
            # a factor from another format would feed errors across the blocks that the writers
            # run apart (the decode-write kernel's chains side by side): refused, not ignored
            fb = side.feedback_block
            if rows is not None and fb and fb < D and torch.any(rows[:, ~block_mask(D, fb, rows.device)] != 0):
                raise ConfigError(f"{name} feedback factor reaches past the format's blocks of {fb} channels")
        if self._static_write is not None:  # the kernel reads these raw: [H, D, D] and [4], nothing broadcast
            for name, rows, lv in zip("kv", fb_rows, levels, strict=True):
                if rows is not None and tuple(rows.shape) != (H, D, D):
                    raise ConfigError(
                        f"{name} feedback factor is {tuple(rows.shape)}, the kernel reads [{H}, {D}, {D}]"
                    )
                if tuple(lv.shape) != (4,):
                    raise ConfigError(f"{name} levels are {tuple(lv.shape)}, need [4]")
        self._params, self._fb_rows, self._levels = new, fb_rows, levels

    # -- accounting --
    def _flushed(self, n: int) -> int:
        """FP2 tokens of a sequence of n tokens."""
        return self.rule.num_quantized(n)

    def _coded(self, n: int) -> int:
        """Tokens of a sequence of n tokens whose codes are in its pages (`num_quantized` of them
        attended as FP2, the rest written at arrival, W tokens ahead of their readers)."""
        m = n - self.spec.num_sinks
        return 0 if m <= 0 else m // self.rule.flush * self.rule.flush

    def _pages_needed(self, pos0: int, num_tokens: int) -> int:
        return -(-self._coded(pos0 + num_tokens) // self.page_size)

    def bits_per_elem(self, ctx: int) -> float:
        return bits_per_elem(self.spec, ctx, self.head_dim)

    # -- writing --
    def _write(self, seq_id, pos0, k, v):
        # All groups that complete in one append are quantized in one call: a group's F bf16 rows
        # quantize independently of every other group (blocks never straddle groups: token blocks
        # divide F), so this writes exactly the pages that token-by-token appends write, without a
        # Python-level pass per group (error feedback costs a D-step loop per call).
        S = self.spec.num_sinks
        n1 = pos0 + k.shape[0]
        f0, f1 = self._flushed(pos0), self._flushed(n1)
        c0, c1 = self._coded(pos0), self._coded(n1)  # f0 <= c0: the codes run ahead of the range
        n_sink = max(0, min(S, n1) - pos0)  # new tokens that are sinks
        n_tail = max(0, pos0 - S - f0)  # tail rows held before this append
        for pages, hp, side, params, x in (
            (self.k, self.hp_k, self.spec.k, self.params[0], k),
            (self.v, self.hp_v, self.spec.v, self.params[1], v),
        ):
            y = to_stored_space(x, params).to(torch.bfloat16)  # [T, H, D]
            if n_sink:
                hp[seq_id, :, pos0 : pos0 + n_sink] = y[:n_sink].transpose(0, 1)
            # tokens S + f0 .. n1 - 1, oldest first: the held tail, then the new non-sink tokens
            stream = torch.cat([hp[seq_id, :, S : S + n_tail].transpose(0, 1), y[n_sink:]])  # [., H, D]
            if c1 > c0:  # the groups completed by this append, at arrival
                self._flush(seq_id, pages, side, params, c0, stream[c0 - f0 : c1 - f0].float())
            rest = stream[f1 - f0 :]
            hp[seq_id, :, S : S + rest.shape[0]] = rest.transpose(0, 1)

    def _flush(
        self, seq_id: int, pages: SidePages, side: Fp2TensorSpec, params: SideParams, j0: int, y
    ) -> None:
        """Quantize y [N, H, D] (FP2 tokens j0 .. j0 + N - 1 of the sequence, N a multiple of F)
        into their page rows (at their arrival: `_write`)."""
        codes, scales, offsets = quantize_stored(y, side, params)  # codes [N, H, D]
        raw = encode_scale(scales, side.scale_dtype)
        bs = 1 if side.block_axis == "channel" else side.block_size  # tokens per scale row
        a = 0
        while a < y.shape[0]:  # one page at a time
            j = j0 + a
            page, r0 = self.tables.pages[seq_id][j // self.page_size], j % self.page_size
            b = min(y.shape[0], a + self.page_size - r0)
            rows = torch.arange(r0, r0 + b - a, device=codes.device)
            pages.store(torch.full_like(rows, page), rows, codes[a:b], check_range=True)
            dst = (page, slice(None), slice(r0 // bs, (r0 + b - a) // bs))
            pages.scales[dst] = raw[a // bs : b // bs].transpose(0, 1)
            if pages.offsets is not None:
                pages.offsets[dst] = offsets[a // bs : b // bs].to(torch.bfloat16).transpose(0, 1)
            a = b

    def _copy_page(self, src, dst):
        self.k.copy(src, dst)
        self.v.copy(src, dst)

    def _reset_slot(self, seq_id):
        self.hp_k[seq_id].zero_()
        self.hp_v[seq_id].zero_()

    def _copy_slot(self, src, dst):
        self.hp_k[dst] = self.hp_k[src]
        self.hp_v[dst] = self.hp_v[src]

    # -- reading --
    def _read_side(
        self, seq_id: int, pages: SidePages, hp: torch.Tensor, params: SideParams
    ) -> torch.Tensor:
        n = self.seq_len(seq_id)
        S = self.spec.num_sinks
        n_fp2 = self._flushed(n)
        side = pages.side
        parts = [hp[seq_id, :, : min(n, S)].float().transpose(0, 1)]  # sinks [<=S, H, D]
        if n_fp2:
            idx = torch.tensor(self.tables.pages[seq_id], dtype=torch.long, device=self.device)
            codes = pages.load(idx).transpose(1, 2)  # [pages, P, H, D]
            codes = codes.reshape(-1, self.num_kv_heads, self.head_dim)[:n_fp2]
            raw = pages.scales[idx]
            sc = decode_scale(raw, side.scale_dtype).transpose(1, 2)  # [pages, P or P/BS, H, ...]
            sc = sc.reshape(-1, *sc.shape[2:])
            off = None
            if pages.offsets is not None:
                off = pages.offsets[idx].float().transpose(1, 2).reshape(sc.shape)
            nb = n_fp2 if side.block_axis == "channel" else n_fp2 // side.block_size
            y = dequantize_blocks(
                _block_view(codes, side), sc[:nb], None if off is None else off[:nb], params.levels
            )
            parts.append(_unblock(y, side, codes.shape))
        n_tail = max(0, n - S - n_fp2)
        parts.append(hp[seq_id, :, S : S + n_tail].float().transpose(0, 1))
        return from_stored_space(torch.cat(parts), params)

    def gather(self, seq_id):
        return (
            self._read_side(seq_id, self.k, self.hp_k, self.params[0]),
            self._read_side(seq_id, self.v, self.hp_v, self.params[1]),
        )
