"""Packing of 2-bit codes: 16 codes per 32-bit word, element j of a 16-group at bits [2j, 2j+1].

The word is stored as int32 (torch has no uint32 arithmetic on every device); its bit pattern is
the uint32 of docs/fp2-format.md.
"""

from __future__ import annotations

import torch

from zerodram.runtime.device import constant_on
from zerodram.runtime.kv.errors import KVInputError

CODES_PER_WORD = 16
_SHIFTS = torch.arange(0, 32, 2, dtype=torch.int64)  # [16]


def pack_codes(codes: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """codes [..., 16 * W] uint8 in [0, 3] -> words [..., W] int32 (bit pattern = uint32).

    check_range: read the codes' max back (a host sync); False for codes a quantizer made, inside
    a CUDA graph capture.

    Raises:
        KVInputError: last dim not a multiple of 16, wrong dtype, or (checked) a code above 3.
    """
    if codes.dtype != torch.uint8:
        raise KVInputError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % CODES_PER_WORD:
        raise KVInputError(f"last dim {codes.shape[-1]} is not a multiple of {CODES_PER_WORD}")
    if check_range and codes.numel() and int(codes.max()) > 3:
        raise KVInputError(f"codes must be in [0, 3], found {int(codes.max())}")
    c = codes.reshape(*codes.shape[:-1], -1, CODES_PER_WORD).long()
    words = (c << constant_on(_SHIFTS, c.device)).sum(-1)  # disjoint bits: sum == or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: torch.Tensor) -> torch.Tensor:
    """words [..., W] int32 -> codes [..., 16 * W] uint8 (inverse of `pack_codes`)."""
    if words.dtype != torch.int32:
        raise KVInputError(f"code words must be int32, got {words.dtype}")
    w = words.long() & 0xFFFFFFFF
    c = (w[..., None] >> constant_on(_SHIFTS, w.device)) & 3
    return c.reshape(*words.shape[:-1], -1).to(torch.uint8)
