"""The paged FP2 cache (layout of docs/fp2-format.md, "Physical layout").

Dimensions: T tokens, H KV heads, D head dim, P page size, S sinks, F tail capacity, BS block size.

Writes go to the bf16 high-precision region first: sinks, then the tail. When the tail holds
W + F tokens (window W, flush F) its oldest F are *flushed*: quantized in one go into the next F rows
of the sequence's FP2 pages, and the remaining W rows move up. Because every quantization reads the
same bf16 tail rows, appending token by token and appending a chunk produce identical pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerodram.kernels.feedback import load_feedback_kernel, supports_head_dim
from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.kv.cache import KVCache
from zerodram.runtime.kv.decode_index import DecodeIndexMemo, DecodeIndices, StaticDecodeIndex
from zerodram.runtime.kv.format import Fp2Spec, Fp2TensorSpec, bits_per_elem, tail_rule
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


class Fp2KVCache(KVCache):
    """FP2 pages plus a bf16 region of S + F rows per sequence slot.

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
        for name, side in (("k", spec.k), ("v", spec.v)):
            if side.outlier_frac > 0 or side.pre_rope:
                raise ConfigError(f"the paged FP2 cache does not support outliers or pre-RoPE ({name})")
            if side.block_axis == "channel" and self.head_dim % side.block_size:
                raise ConfigError(
                    f"{name} channel blocks of {side.block_size} do not divide head dim {self.head_dim}"
                )
        if self.page_size % spec.tail_tokens:
            raise ConfigError(f"tail of {spec.tail_tokens} tokens must divide the page size {self.page_size}")
        if self.head_dim % 16:
            raise ConfigError(f"head dim {self.head_dim} is not a multiple of 16 codes per word")
        self.spec = spec
        H, D, P, dev = self.num_kv_heads, self.head_dim, self.page_size, self.device
        if params is None:
            params = layer_params(spec, self.layer_idx, H, D)
        # One page and one slot past the pool's are never handed out: a fixed-shape decode write
        # (`write_decode_static`) sends its padding rows and its non-flushing rows there.
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
            ConfigError: a feedback factor or levels the decode-write kernel cannot read.
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
        fb_rows = tuple(
            (p.feedback.float() / p.feedback.float().diagonal(dim1=-2, dim2=-1)[..., None]).contiguous()
            if s.feedback and p.feedback is not None else None
            for s, p in zip(sides, new, strict=True)
        )  # fmt: skip
        levels = tuple(p.levels.float().contiguous() for p in new)
        if self._static_write is not None:  # the kernel reads these raw: [H, D, D] and [4], nothing broadcast
            for name, rows, lv in zip("kv", fb_rows, levels, strict=True):
                if rows is not None and tuple(rows.shape) != (H, D, D):
                    raise ConfigError(
                        f"{name} feedback factor is {tuple(rows.shape)}, the kernel reads [{H}, {D}, {D}]"
                    )
                if tuple(lv.shape) != (4,):
                    raise ConfigError(f"{name} levels are {tuple(lv.shape)}, need [4]")
        self._params, self._fb_rows, self._levels = new, fb_rows, levels

    def _static_writer(self, want: bool | None):
        """The decode-write kernel for `write_decode_static` (None: its torch body). `want` None:
        the kernel where the device and the format allow it; True: the kernel or ConfigError."""
        from zerodram.kernels.kv_write import DecodeWriteConfig, Fp2DecodeWrite, unsupported

        sides = (self.spec.k, self.spec.v)
        why = None
        if self.device.type != "cuda":
            why = f"the cache is on {self.device}"
        elif not self.static_decode_ok or any(s.asymmetric for s in sides):
            why = "the format is not flushed 1 token at a time into symmetric channel blocks"
        else:
            why = unsupported(
                self.head_dim, tuple(s.block_size for s in sides), tuple(s.scale_dtype for s in sides),
                tuple(s.scale_rule for s in sides),
            )  # fmt: skip
        if why is not None:
            if want:
                raise ConfigError(f"the FP2 decode-write kernel cannot serve this cache: {why}")
            return None
        if want is False:
            return None
        from zerodram.runtime.kv.quantize import MSE_FRACTIONS

        cfg = DecodeWriteConfig(
            self.head_dim, sides[0].block_size, sides[1].block_size, sides[0].scale_dtype, self.v.layout == "quad"
        )
        return Fp2DecodeWrite(cfg, tuple(s.scale_rule for s in sides), MSE_FRACTIONS, self.device)

    # -- accounting --
    def _flushed(self, n: int) -> int:
        """FP2 tokens of a sequence of n tokens."""
        return self.rule.num_quantized(n)

    def _pages_needed(self, pos0: int, num_tokens: int) -> int:
        return -(-self._flushed(pos0 + num_tokens) // self.page_size)

    def bits_per_elem(self, ctx: int) -> float:
        return bits_per_elem(self.spec, ctx, self.head_dim)

    # -- writing --
    def _write(self, seq_id, pos0, k, v):
        # All flushes of one append are quantized in one call: a flush quantizes its F bf16 rows
        # independently of every other flush (blocks never straddle flushes: token blocks divide
        # F), so this writes exactly the pages that token-by-token appends write, without a
        # Python-level pass per flush (error feedback costs a D-step loop per call).
        S = self.spec.num_sinks
        n1 = pos0 + k.shape[0]
        f0, f1 = self._flushed(pos0), self._flushed(n1)
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
            if f1 > f0:
                self._flush(seq_id, pages, side, params, f0, stream[: f1 - f0].float())
            rest = stream[f1 - f0 :]
            hp[seq_id, :, S : S + rest.shape[0]] = rest.transpose(0, 1)

    def _write_decode(self, seq_ids, pos0, k, v):
        # One token per sequence, every sequence at once: the same rows and pages as `_write`, in
        # a fixed number of tensor ops. A token goes to its sink row or the end of its tail; the
        # sequences whose tail then holds W + F rows flush their oldest F (one quantize call for
        # all of them: flushes are independent) and move the other W up.
        if self._static_write is not None:  # flush 1: the fixed-shape write's kernel, unpadded
            self._kernel_write(k, v, self._kernel_index(seq_ids, pos0))
            return
        idx = self._decode_indices(seq_ids, pos0)
        S, F = self.spec.num_sinks, self.rule.flush
        W = self.rule.window
        for pages, hp, side, params, x in (
            (self.k, self.hp_k, self.spec.k, self.params[0], k),
            (self.v, self.hp_v, self.spec.v, self.params[1], v),
        ):
            hp[idx.slot, :, idx.row] = to_stored_space(x, params).to(torch.bfloat16)  # [B, H, D]
            if idx.fl_slot is None:
                continue
            fl_slot, page_t, prow_t = idx.fl_slot, idx.page, idx.page_row
            y = (
                hp[fl_slot, :, S : S + F].transpose(1, 2).reshape(-1, hp.shape[1], hp.shape[3])
            )  # [Bf * F, H, D]
            codes, scales, offsets = quantize_stored(y.float(), side, params)
            pages.store(page_t, prow_t, codes, check_range=True)  # [Bf * F, H, D]
            raw = encode_scale(scales, side.scale_dtype)
            if side.block_axis == "channel":
                srow_page, srow = page_t, prow_t
            else:  # token blocks: one scale row per BS tokens, blocks never straddle flushes
                bs = side.block_size
                srow_page, srow = page_t[::bs], torch.div(prow_t[::bs], bs, rounding_mode="floor")
            pages.scales[srow_page, :, srow] = raw
            if pages.offsets is not None:
                pages.offsets[srow_page, :, srow] = offsets.to(torch.bfloat16)
            hp[fl_slot, :, S : S + W] = hp[fl_slot, :, S + F : S + F + W]  # the read is a copy

    # -- the fixed-shape decode write (a CUDA graph can capture it) --
    @property
    def static_decode_ok(self) -> bool:
        """Whether `write_decode_static` serves this format: tokens flushed one at a time (F = 1)
        into channel blocks, so that every decode write has the same shape."""
        return self.rule.flush == 1 and all(s.block_axis == "channel" for s in (self.spec.k, self.spec.v))

    def plan_decode_static(self, seq_ids: Sequence[int]) -> tuple[list[int], ...]:
        """Host half of a decode append: check, give pages, advance lengths (as `append_decode`,
        before the write itself) and return per row (slot, row, flushes, page, page row) lists for
        `write_decode_static`; a row that does not flush names the scratch page.

        Raises:
            KVInputError, KVCapacityError: as `append_decode` (nothing changes).
        """
        if not self.static_decode_ok:
            raise ConfigError(f"static decode writes need flush 1 and channel blocks, not {self.spec}")
        seq_ids = self._decode_seqs(seq_ids)
        pos0 = [self.tables.lens[sid] for sid in seq_ids]
        self._grow([(sid, self._pages_needed(p, 1)) for sid, p in zip(seq_ids, pos0, strict=True)])
        plan = self._static_rows(seq_ids, pos0)
        for sid, p in zip(seq_ids, pos0, strict=True):
            self.tables.lens[sid] = p + 1
        return plan

    def mirror_decode_static(self, seq_ids: Sequence[int], lead: Fp2KVCache, lead_ids: Sequence[int]) -> None:
        """Host half of the decode append that `lead`, another layer of the same partition, has
        just planned (`plan_decode_static`): the same pages and lengths here, so that a step plans
        once and not once per layer (planning costs ~10 Python calls per row). Its plan holds for
        this layer too: it names slots, pages by id and rows by length; per row the slot, the
        length and the newest page are checked equal (pages change only by growth, and growth
        hands out the newest).

        Raises:
            ZerodramError: this cache has parted from `lead` (another length or other pages).
        """
        lens, pages = self.tables.lens, self.tables.pages
        for sid, lid in zip(seq_ids, lead_ids, strict=True):
            n, want = lead.tables.lens[lid], lead.tables.pages[lid]
            have = pages.get(sid)
            if sid != lid:  # the plan (and a step's static index) names the lead's slots
                raise ZerodramError(
                    f"layer {self.layer_idx} keeps a sequence in slot {sid}, layer {lead.layer_idx} in "
                    f"slot {lid}: the layers' KV caches have parted"
                )
            if have is None or lens[sid] != n - 1:
                raise ZerodramError(
                    f"layer {self.layer_idx} sequence slot {sid} holds {lens.get(sid)} tokens, layer "
                    f"{lead.layer_idx}'s {n - 1}: the layers' KV caches have parted"
                )
            if len(have) < len(want):
                self._grow([(sid, len(want))])
            if len(have) != len(want) or have[-1:] != want[-1:]:  # pages change only by growth: the new one
                raise ZerodramError(
                    f"layer {self.layer_idx} sequence slot {sid} holds pages ...{have[-4:]}, layer "
                    f"{lead.layer_idx} ...{want[-4:]}: the layers' KV caches have parted"
                )
            lens[sid] = n

    def _static_rows(self, seq_ids: list[int], pos0: list[int]) -> tuple[list[int], ...]:
        """(slots, rows, flushes, pages, page rows) of one token per sequence at pos0 (pages given)."""
        S, P = self.spec.num_sinks, self.page_size
        rows, flush, page, page_row = [], [], [], []
        for sid, p in zip(seq_ids, pos0, strict=True):
            f0 = self._flushed(p)
            rows.append(p if p < S else p - f0)  # sink row, or S + tail length
            fl = self._flushed(p + 1) > f0
            flush.append(int(fl))
            page.append(self.tables.pages[sid][f0 // P] if fl else self.scratch_page)
            page_row.append(f0 % P if fl else 0)
        return seq_ids, rows, flush, page, page_row

    def write_decode_static(self, k: torch.Tensor, v: torch.Tensor, ix: StaticDecodeIndex) -> None:
        """Device half: k, v [Bp, H, D] (finite) written where `ix` says, in a fixed number of ops
        with fixed shapes and no host sync. Per row: the token to its row; then the oldest tail row
        quantized into (page, page row) and the tail moved up, where it flushes; elsewhere the same
        quantization lands in the scratch page and the tail stays. The same cache contents as
        `append_decode` of the real rows (tests/test_kv_cache.py)."""
        S, W = self.spec.num_sinks, self.rule.window
        if self._static_write is not None:  # the same, in one launch (kernels/kv_write.py)
            self._kernel_write(k, v, ix.packed)
            return
        keep = (ix.flush == 0)[:, None, None, None]  # [Bp, 1, 1, 1]
        for pages, hp, side, params, x in (
            (self.k, self.hp_k, self.spec.k, self.params[0], k),
            (self.v, self.hp_v, self.spec.v, self.params[1], v),
        ):
            hp[ix.slot, :, ix.row] = to_stored_space(x, params).to(torch.bfloat16)  # [Bp, H, D]
            codes, scales, offsets = quantize_stored(
                hp[ix.slot, :, S].float(), side, params
            )  # oldest tail row
            pages.store(ix.page, ix.page_row, codes, check_range=False)  # [Bp, H, D]
            pages.scales[ix.page, :, ix.page_row] = encode_scale(scales, side.scale_dtype)
            if pages.offsets is not None:
                pages.offsets[ix.page, :, ix.page_row] = offsets.to(torch.bfloat16)
            if W:
                tail = hp[ix.slot, :, S : S + W]  # [Bp, H, W, D] (a copy)
                hp[ix.slot, :, S : S + W] = torch.where(keep, tail, hp[ix.slot, :, S + 1 : S + 1 + W])

    def _kernel_write(self, k: torch.Tensor, v: torch.Tensor, packed: torch.Tensor) -> None:
        """k, v [B, H, D] through the decode-write kernel, where `packed` [5, B] int64 says."""
        kp, vp = self.params
        self._static_write(
            to_stored_space(k, kp).to(torch.bfloat16).contiguous(),
            to_stored_space(v, vp).to(torch.bfloat16).contiguous(),
            packed,
            self.hp_k, self.hp_v, self.k.codes, self.v.codes, self.k.scales, self.v.scales, *self._levels,
            *self._fb_rows, self.spec.num_sinks, self.rule.window,
        )  # fmt: skip

    def _kernel_index(self, seq_ids: list[int], pos0: list[int]) -> torch.Tensor:
        """The kernel's [5, B] index of an eager decode append (one copy per step: every layer asks
        for the same one, so it comes from `index_memo` after the first)."""
        plan = self._static_rows(seq_ids, pos0)
        key = ("kernel", self.spec.num_sinks, self.page_size, *map(tuple, plan))
        if self.index_memo.key != key or self.index_memo.device != self.device:
            packed = torch.tensor(plan, dtype=torch.int64).to(self.device, non_blocking=True)
            self.index_memo.key, self.index_memo.device, self.index_memo.value = key, self.device, packed
        return self.index_memo.value

    def _decode_indices(self, seq_ids: list[int], pos0: list[int]) -> DecodeIndices:
        """The device index tensors of a decode append; every layer of a step asks for the same
        ones, so they come from `index_memo` (shared by a partition's caches) after the first."""
        S, P, F = self.spec.num_sinks, self.page_size, self.rule.flush
        rows, flushing = [], []
        for sid, p in zip(seq_ids, pos0, strict=True):
            f0 = self._flushed(p)
            rows.append(p if p < S else p - f0)  # sink row, or S + tail length
            if self._flushed(p + 1) > f0:
                flushing.append((sid, self.tables.pages[sid][f0 // P], f0 % P))
        key = (S, P, F, tuple(seq_ids), tuple(rows), tuple(flushing))
        if self.index_memo.key == key and self.index_memo.device == self.device:
            return self.index_memo.value
        # one host buffer, one copy: slots, rows [B]; flushing slots [Bf]; their pages and page rows [Bf * F]
        fl_pages = [(page, r0 + j) for _, page, r0 in flushing for j in range(F)]
        host = torch.tensor(
            [
                *seq_ids,
                *rows,
                *(f[0] for f in flushing),
                *(p for p, _ in fl_pages),
                *(r for _, r in fl_pages),
            ],
            dtype=torch.long,
        )
        dev = host.to(self.device, non_blocking=True)
        B, Bf = len(seq_ids), len(flushing)
        o = 2 * B + Bf
        value = DecodeIndices(
            slot=dev[:B],
            row=dev[B : 2 * B],
            fl_slot=dev[2 * B : o] if Bf else None,
            page=dev[o : o + Bf * F],
            page_row=dev[o + Bf * F :],
        )
        self.index_memo.key, self.index_memo.device, self.index_memo.value = key, self.device, value
        return value

    def _flush(
        self, seq_id: int, pages: SidePages, side: Fp2TensorSpec, params: SideParams, j0: int, y
    ) -> None:
        """Quantize y [N, H, D] (FP2 tokens j0 .. j0 + N - 1 of the sequence, N a multiple of F)
        into their page rows."""
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
