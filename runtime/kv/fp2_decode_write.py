"""Decode-time writes of the paged FP2 cache: one token per sequence, every sequence at once.

Dimensions: B sequences of the step, Bp padded rows, Bf flushing sequences, Bc sequences whose
new token completes an F-token group (its codes are written at arrival), H KV heads, D head
dim, S sinks, W window, F flush, P page size.

Two ways in. `_write_decode` (behind `KVCache.append_decode`) writes the same rows and pages as a
token-by-token `_write`, in a fixed number of tensor ops, with host-built indices. The fixed-shape
write splits that in two so that a CUDA graph can capture the device half: `plan_decode_static`
(host: pages, lengths, per-row indices; `mirror_decode_static` for the other layers of the step)
and `write_decode_static` (device: fixed shapes, no host sync), which runs as one kernel
(kernels/kv_write.py) where the device and the format allow it, else as its torch body.

`Fp2DecodeWrites` is a part of `Fp2KVCache` (runtime/kv/fp2_cache.py), split out for size: its
methods use the cache's spec, rule, tables, pages (k, v), bf16 region (hp_k, hp_v), params,
index memo and scratch page and slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerodram.runtime.errors import ConfigError, ZerodramError
from zerodram.runtime.kv.decode_index import DecodeIndices, StaticDecodeIndex
from zerodram.runtime.kv.errors import KVInputError
from zerodram.runtime.kv.format import Fp2Spec
from zerodram.runtime.kv.quantize import quantize_stored, to_stored_space
from zerodram.runtime.kv.scales import encode_scale


class Fp2DecodeWrites:
    """The decode-time writes of `Fp2KVCache` (module docstring)."""

    def _write_decode(self, seq_ids, pos0, k, v):
        # One token per sequence, every sequence at once: the same rows and pages as `_write`, in
        # a fixed number of tensor ops. A token goes to its sink row or the end of its tail; the
        # sequences whose newest F-token group it completes quantize that group into its page rows
        # (one quantize call for all of them: groups are independent); the sequences whose tail
        # then holds W + F rows flush their oldest F (into the FP2 range: their codes are already
        # written) and move the other W up.
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
            if idx.code_slot is not None:
                y = hp[idx.code_slot, :, idx.code_row]  # [Bc * F, H, D]: the completed groups' rows
                codes, scales, offsets = quantize_stored(y.float(), side, params)
                page_t, prow_t = idx.page, idx.page_row
                pages.store(page_t, prow_t, codes, check_range=True)  # [Bc * F, H, D]
                raw = encode_scale(scales, side.scale_dtype)
                if side.block_axis == "channel":
                    srow_page, srow = page_t, prow_t
                else:  # token blocks: one scale row per BS tokens, blocks never straddle groups
                    bs = side.block_size
                    srow_page, srow = page_t[::bs], torch.div(prow_t[::bs], bs, rounding_mode="floor")
                pages.scales[srow_page, :, srow] = raw
                if pages.offsets is not None:
                    pages.offsets[srow_page, :, srow] = offsets.to(torch.bfloat16)
            if idx.fl_slot is not None and W:
                hp[idx.fl_slot, :, S : S + W] = hp[idx.fl_slot, :, S + F : S + F + W]  # the read is a copy

    # -- the fixed-shape decode write (a CUDA graph can capture it) --
    @property
    def static_decode_ok(self) -> bool:
        """Whether `write_decode_static` serves this format: tokens flushed one at a time (F = 1)
        into channel blocks, so that every decode write has the same shape."""
        return self.rule.flush == 1 and all(s.block_axis == "channel" for s in (self.spec.k, self.spec.v))

    def plan_decode_static(self, seq_ids: Sequence[int]) -> tuple[list[int], ...]:
        """Host half of a decode append: check, give pages, advance lengths (as `append_decode`,
        before the write itself) and return per row (slot, row, flushes, page, page row) lists for
        `write_decode_static`; a row whose new token is a sink names the scratch page.

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

    def mirror_decode_static(self, seq_ids: Sequence[int], lead: Fp2DecodeWrites, lead_ids: Sequence[int]) -> None:
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
        """(slots, rows, flushes, pages, page rows) of one token per sequence at pos0 (pages given):
        flush says the tail moves up (the FP2 range grows), the page and page row are the new
        token's own (its codes are written at arrival), or the scratch page for a sink."""
        S, P = self.spec.num_sinks, self.page_size
        rows, flush, page, page_row = [], [], [], []
        for sid, p in zip(seq_ids, pos0, strict=True):
            f0 = self._flushed(p)
            rows.append(p if p < S else p - f0)  # sink row, or S + tail length
            flush.append(int(self._flushed(p + 1) > f0))
            page.append(self.tables.pages[sid][(p - S) // P] if p >= S else self.scratch_page)
            page_row.append((p - S) % P if p >= S else 0)
        return seq_ids, rows, flush, page, page_row

    def write_decode_static(self, k: torch.Tensor, v: torch.Tensor, ix: StaticDecodeIndex) -> None:
        """Device half: k, v [Bp, H, D] (finite) written where `ix` says, in a fixed number of ops
        with fixed shapes and no host sync. Per row: the token to its row and its codes to (page,
        page row), the scratch page for a sink; the tail moved up where the row flushes. The same
        cache contents as `append_decode` of the real rows (tests/test_kv_cache.py).

        Raises:
            KVInputError: k, v not [Bp, H, D] fp32 / bf16 / fp16 on the cache's device, Bp the
                index's rows (`_check_static`; nothing written).
        """
        self._check_static(k, v, ix)
        S, W = self.spec.num_sinks, self.rule.window
        if self._static_write is not None:  # the same, in one launch (kernels/kv_write.py)
            self._kernel_write(k, v, ix.packed)
            return
        keep = (ix.flush == 0)[:, None, None, None]  # [Bp, 1, 1, 1]
        for pages, hp, side, params, x in (
            (self.k, self.hp_k, self.spec.k, self.params[0], k),
            (self.v, self.hp_v, self.spec.v, self.params[1], v),
        ):
            y = to_stored_space(x, params).to(torch.bfloat16)  # [Bp, H, D]
            hp[ix.slot, :, ix.row] = y
            codes, scales, offsets = quantize_stored(y.float(), side, params)  # at arrival
            pages.store(ix.page, ix.page_row, codes, check_range=False)  # [Bp, H, D]
            pages.scales[ix.page, :, ix.page_row] = encode_scale(scales, side.scale_dtype)
            if pages.offsets is not None:
                pages.offsets[ix.page, :, ix.page_row] = offsets.to(torch.bfloat16)
            if W:
                tail = hp[ix.slot, :, S : S + W]  # [Bp, H, W, D] (a copy)
                hp[ix.slot, :, S : S + W] = torch.where(keep, tail, hp[ix.slot, :, S + 1 : S + 1 + W])

    def pending_append(self, k: torch.Tensor, v: torch.Tensor, ix: StaticDecodeIndex):
        """`write_decode_static` not launched (a `PendingAppend`): for the decode-attention kernel to
        attend its tokens first, reading the tails as they are (runtime/attention/decode.py), and
        for the caller to launch the write after it (`PendingAppend.write_after`, on a stream of its
        own: nothing reads the new tokens' codes for W steps, nor the moved tails before the next
        step). The stored-space move happens now, on the stream, as for the write.

        Raises:
            ConfigError: this cache writes through its torch body (no kernel to defer), or a window
                of 0 (a token is attended as FP2 in the step it arrives: its codes come first).
        """
        if self._static_write is None:
            raise ConfigError("a pending decode append needs the decode-write kernel (a CUDA cache in a format it takes)")
        if self.rule.window == 0:
            raise ConfigError("a pending decode append needs a window: with none, the decode reads the new token's codes")
        self._check_static(k, v, ix)
        return self._static_write.pending(*self._kernel_args(k, v, ix.packed))

    def _check_static(self, k: torch.Tensor, v: torch.Tensor, ix: StaticDecodeIndex) -> None:
        # The one check of a fixed-shape write's inputs, for the torch body and the kernel alike (the
        # kernel's wrapper sees them only after the move to the stored space). Host only: no sync,
        # so a graph capture runs it. Their values are the caller's: finite, as `write_decode_static` says.
        self._check_pair(k, v)
        if k.shape[0] != ix.slot.shape[0]:
            raise KVInputError(f"K and V are {tuple(k.shape)}, the index has {ix.slot.shape[0]} rows: need one each")

    def _kernel_write(self, k: torch.Tensor, v: torch.Tensor, packed: torch.Tensor) -> None:
        """k, v [B, H, D] through the decode-write kernel, where `packed` [5, B] int64 says."""
        self._static_write(*self._kernel_args(k, v, packed))

    def _kernel_args(self, k: torch.Tensor, v: torch.Tensor, packed: torch.Tensor) -> tuple:
        kp, vp = self.params
        return (
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
        rows, coding, flushing = [], [], []
        for sid, p in zip(seq_ids, pos0, strict=True):
            f0 = self._flushed(p)
            row = p if p < S else p - f0  # sink row, or S + tail length
            rows.append(row)
            c0 = self._coded(p)
            if self._coded(p + 1) > c0:  # the token completes a group: its F rows end at `row`
                coding.append((sid, row - F + 1, self.tables.pages[sid][c0 // P], c0 % P))
            if self._flushed(p + 1) > f0:
                flushing.append(sid)
        key = (S, P, F, tuple(seq_ids), tuple(rows), tuple(coding), tuple(flushing))
        if self.index_memo.key == key and self.index_memo.device == self.device:
            return self.index_memo.value
        # one host buffer, one copy: slots, rows [B]; per group token (F per coding sequence) its
        # slot, row, page and page row [Bc * F] each; the flushing slots [Bf]
        toks = [(sid, r0 + j, page, pr0 + j) for sid, r0, page, pr0 in coding for j in range(F)]
        cols = [t[i] for i in range(4) for t in toks]  # slots, rows, pages, page rows
        host = torch.tensor([*seq_ids, *rows, *cols, *flushing], dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        B, N = len(seq_ids), len(toks)
        o = 2 * B + 4 * N
        value = DecodeIndices(
            slot=dev[:B],
            row=dev[B : 2 * B],
            code_slot=dev[2 * B : 2 * B + N] if N else None,
            code_row=dev[2 * B + N : 2 * B + 2 * N],
            page=dev[2 * B + 2 * N : 2 * B + 3 * N],
            page_row=dev[2 * B + 3 * N : o],
            fl_slot=dev[o:] if flushing else None,
        )
        self.index_memo.key, self.index_memo.device, self.index_memo.value = key, self.device, value
        return value

    def _static_writer(self, want: bool | None):
        """The decode-write kernel for `write_decode_static` (None: its torch body). `want` None:
        the kernel where the device and the format allow it; True: the kernel or ConfigError."""
        from zerodram.kernels.kv_write import Fp2DecodeWrite

        cfg, why = None, None
        if self.device.type != "cuda":
            why = f"the cache is on {self.device}"
        elif not self.static_decode_ok or any(s.asymmetric for s in (self.spec.k, self.spec.v)):
            why = "the format is not flushed 1 token at a time into symmetric channel blocks"
        else:
            cfg, why = decode_write_config(self.spec, self.head_dim, v_quad=self.v.layout == "quad")
        if why is not None:
            if want:
                raise ConfigError(f"the FP2 decode-write kernel cannot serve this cache: {why}")
            return None
        if want is False:
            return None
        from zerodram.runtime.kv.quantize import MSE_FRACTIONS

        return Fp2DecodeWrite(cfg, (self.spec.k.scale_rule, self.spec.v.scale_rule), MSE_FRACTIONS, self.device)


def decode_write_config(spec: Fp2Spec, head_dim: int, v_quad: bool):
    """(the decode-write kernel's build for this format, None), or (None, why it has none). Only
    the kernel's own limits: the device and the flush schedule are the caller's to check. Shared by
    the cache and `bench attention --write-kv`, so the timed build is the served one."""
    from zerodram.kernels.kv_write import DecodeWriteConfig, unsupported

    k, v = spec.k, spec.v
    # the chain's blocks, one build for both sides (a block of the whole head is none)
    fbs = {0 if s.feedback_block == head_dim else s.feedback_block for s in (k, v) if s.feedback}
    if len(fbs) > 1:
        return None, f"feedback blocks {sorted(fbs)} differ between keys and values"
    fb = min(fbs, default=0)
    why = unsupported(head_dim, (k.block_size, v.block_size), (k.scale_dtype, v.scale_dtype),
                      (k.scale_rule, v.scale_rule), fb)  # fmt: skip
    if why is not None:
        return None, why
    return DecodeWriteConfig(head_dim, k.block_size, v.block_size, k.scale_dtype, v_quad, fb), None
