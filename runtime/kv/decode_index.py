"""Where a decode step's appends to the FP2 cache go, as device index tensors: per call
(`DecodeIndices`), in static buffers a captured CUDA graph reads (`StaticDecodeIndex`), and memoised
across a partition's layers (`DecodeIndexMemo`).

Dimensions: B sequences (Bp padded), Bf flushing sequences, Bc sequences completing a group of
F tokens (whose codes are written at arrival).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodram.runtime.device import Staging


@dataclass(frozen=True)
class DecodeIndices:
    """Where a decode append writes, on the cache's device: slot [B] and bf16 row [B] of each new
    token; for each token of the groups the step completes (F per such sequence; None: none) its
    slot, bf16 row, page and page row [Bc * F], whose codes are written now (at arrival); the
    slots of the sequences whose tail moves up [Bf] (None: none)."""

    slot: torch.Tensor
    row: torch.Tensor
    code_slot: torch.Tensor | None
    code_row: torch.Tensor
    page: torch.Tensor
    page_row: torch.Tensor
    fl_slot: torch.Tensor | None


class StaticDecodeIndex:
    """Where a fixed-shape decode write goes, per row of a padded batch [Bp] (int64 on the cache's
    device): hp slot and row of the new token, whether the row flushes its oldest tail token
    (nonzero: yes; the tail moves up), and the new token's own page and page row, where its codes
    go at arrival (the scratch page for a sink).
    Padding rows name the scratch slot. Static buffers, rows of one [5, Bp] device tensor filled by
    one copy per step: a captured graph reads them at every replay."""

    def __init__(self, bucket: int, device: torch.device) -> None:
        self._staging = Staging((5, bucket), torch.int64, device)
        self.packed = self._staging.dev  # [5, Bp]
        self.slot, self.row, self.flush, self.page, self.page_row = self.packed  # [Bp] each

    @classmethod
    def allocate(cls, bucket: int, device: torch.device) -> StaticDecodeIndex:
        return cls(bucket, device)

    def fill(self, rows: tuple[list[int], ...], scratch_slot: int, scratch_page: int) -> None:
        """(slots, rows, flush, pages, page rows) of B <= Bp rows in, padded with scratch rows."""
        slot, row, flush, page, page_row = rows
        pad = self.slot.shape[0] - len(slot)
        self._staging.upload(
            [
                [*slot, *[scratch_slot] * pad], [*row, *[0] * pad], [*flush, *[0] * pad],
                [*page, *[scratch_page] * pad], [*page_row, *[0] * pad],
            ]
        )  # fmt: skip

    def fill_scratch(self, scratch_slot: int, scratch_page: int) -> None:
        """Every row to the scratch slot and page (before a capture's warm-up runs the writes)."""
        self.fill(([], [], [], [], []), scratch_slot, scratch_page)


@dataclass
class DecodeIndexMemo:
    """The last decode append's indices (key: layout S, P, F; sequences, rows, completed groups,
    flushes), or the decode-write kernel's [5, B] index (key: "kernel", ...). A partition gives all
    of its layers' caches one memo, so a step copies its indices to the device once, not per
    layer."""

    key: tuple | None = None
    device: torch.device | None = None
    value: DecodeIndices | torch.Tensor | None = None

