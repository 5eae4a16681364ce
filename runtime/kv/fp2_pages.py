"""One side's (K or V) page pools of the FP2 cache and the value pages' layout (docs/fp2-format.md,
"Physical layout").

Dimensions: H KV heads, D head dim, P page size, BS block size.
"""

from __future__ import annotations

import torch

from zerodram.runtime.kv.format import Fp2TensorSpec
from zerodram.runtime.kv.pack import CodeLayout, pack_codes, store_quad_rows, unpack_codes, unpack_quad


def value_layout(side: Fp2TensorSpec, head_dim: int, page_size: int) -> CodeLayout:
    """The value pages' layout: "quad" where the decode kernel reads values and folds their scales
    into P (symmetric channel blocks of at least 16 channels, e4m3/e8m0 scales, no center, a head
    dim of 32s, pages of 4s), else "token" (formats only the gather path reads, which unpacks the
    token layout fastest)."""
    kernel = (
        side.block_axis == "channel" and not side.asymmetric and not side.center
        and side.scale_dtype in ("e4m3", "e8m0")
    )  # fmt: skip
    quad = kernel and side.block_size >= 16 and head_dim % 32 == 0 and page_size % 4 == 0
    return "quad" if quad else "token"


class SidePages:
    """Page storage of one side (K or V).

    layout: how a page's code words hold its tokens (docs/fp2-format.md, "Physical layout"):
    "token" (row t = token t's D/16 words) or "quad" (4 tokens interleaved by byte, the values'
    layout wherever the decode kernel can fold their scales: runtime/kv/pack.py).
    """

    def __init__(self, side: Fp2TensorSpec, num_pages: int, H: int, P: int, D: int, device, layout: CodeLayout) -> None:
        self.side, self.layout = side, layout
        bs = side.block_size
        self.codes = torch.zeros(
            num_pages, H, P, D // 16, dtype=torch.int32, device=device
        )  # [pages, H, P, D/16]
        # The layout's store and load, chosen once: a token's D/16 words in a row, or its byte of
        # each of its quad's words.
        if layout == "quad":
            self.store, self._unpack = self._store_quad, unpack_quad
        else:
            self.store, self._unpack = self._store_token, unpack_codes
        sshape = (num_pages, H, P, D // bs) if side.block_axis == "channel" else (num_pages, H, P // bs, D)
        sdt = {"e4m3": torch.uint8, "e8m0": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}
        self.scales = torch.zeros(sshape, dtype=sdt[side.scale_dtype], device=device)
        self.offsets = torch.zeros(sshape, dtype=torch.bfloat16, device=device) if side.asymmetric else None

    # store(page, row, codes, check_range=...): codes [N, H, D] uint8 to page row row[i] of page
    # page[i] (page, row: [N] int64); check_range reads the codes' max back (a host sync), as
    # `pack_codes` does, so pass False inside a CUDA-graph capture.

    def _store_token(self, page: torch.Tensor, row: torch.Tensor, codes: torch.Tensor, *, check_range: bool) -> None:
        self.codes[page, :, row] = pack_codes(codes, check_range=check_range)  # [N, H, D/16]

    def _store_quad(self, page: torch.Tensor, row: torch.Tensor, codes: torch.Tensor, *, check_range: bool) -> None:
        store_quad_rows(self.codes, page, row, codes, check_range=check_range)

    def load(self, pages: torch.Tensor) -> torch.Tensor:
        """The codes of whole pages [n] -> [n, H, P, D] uint8, in token and channel order."""
        return self._unpack(self.codes[pages])

    def copy(self, src: int, dst: int) -> None:
        self.codes[dst] = self.codes[src]
        self.scales[dst] = self.scales[src]
        if self.offsets is not None:
            self.offsets[dst] = self.offsets[src]


