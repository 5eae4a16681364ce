"""Packing of 2-bit codes: 16 codes per 32-bit word, element j of a 16-group at bits [2j, 2j+1].

The word is stored as int32 (torch has no uint32 arithmetic on every device); its bit pattern is
the uint32 of docs/fp2-format.md. Pages hold a token's words in a row (the token layout) or, for
values, four tokens' words interleaved by byte (the quad layout, below).
"""

from __future__ import annotations

from typing import Literal

import torch

from zerodram.runtime.device import constant_on
from zerodram.runtime.kv.errors import KVInputError

CODES_PER_WORD = 16
_SHIFTS = torch.arange(0, 32, 2, dtype=torch.int64)  # [16]
_FIELD_SHIFTS = torch.arange(0, 8, 2, dtype=torch.int64)  # [4] the 2-bit fields of a byte
_BYTE_SHIFTS = torch.arange(0, 32, 8, dtype=torch.int64)  # [4] the bytes of a word


def pack_codes(codes: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """codes [..., 16 * W] uint8 in [0, 3] -> words [..., W] int32 (bit pattern = uint32).

    check_range: read the codes' max back (a host sync); False for codes a quantizer made, inside
    a CUDA graph capture.

    Raises:
        KVInputError: last dim not a multiple of 16, wrong dtype, or (checked) a code above 3.
    """
    _check_codes(codes, check_range)
    c = codes.reshape(*codes.shape[:-1], -1, CODES_PER_WORD).long()
    words = (c << constant_on(_SHIFTS, c.device)).sum(-1)  # disjoint bits: sum == or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _check_codes(codes: torch.Tensor, check_range: bool) -> None:
    if codes.dtype != torch.uint8:
        raise KVInputError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % CODES_PER_WORD:
        raise KVInputError(f"last dim {codes.shape[-1]} is not a multiple of {CODES_PER_WORD}")
    if check_range and codes.numel() and int(codes.max()) > 3:
        raise KVInputError(f"codes must be in [0, 3], found {int(codes.max())}")


def unpack_codes(words: torch.Tensor) -> torch.Tensor:
    """words [..., W] int32 -> codes [..., 16 * W] uint8 (inverse of `pack_codes`)."""
    if words.dtype != torch.int32:
        raise KVInputError(f"code words must be int32, got {words.dtype}")
    w = words.long() & 0xFFFFFFFF
    c = (w[..., None] >> constant_on(_SHIFTS, w.device)) & 3
    return c.reshape(*words.shape[:-1], -1).to(torch.uint8)


# ---- value pages in quad layout ------------------------------------------------------------------
#
# The decode kernel's value operand wants, per lane, four tokens of a few channels at once
# (docs/fp2-kernel.md, "Quad value layout"). In the quad layout the [P, D/16] words of a (page,
# KV head) are P/4 quads of D/4 words; byte j of a quad's word holds token 4q + j, its four 2-bit
# fields (bits 2f, 2f+1) four channels. Word w = g * D/32 + k (g in 0..7, k in 0..D/32-1), field f
# holds channel 32k + 8f + g: rows g and g + 8 of M-tiles 2k and 2k+1 (16 channels each) of the
# kernel's output MMA. The same bytes as the token layout, in another order: a token
# is one byte in each of its quad's words, so a writer stores bytes, never a partial byte.

CodeLayout = Literal["token", "quad"]  # how a page's words hold its tokens (docs/fp2-format.md)
_QUAD_ORDERS: dict[int, torch.Tensor] = {}  # head dim -> quad_channel_order (lives for the process)


def quad_channel_order(head_dim: int) -> torch.Tensor:
    """[D] int64: the channel of byte position (word w, field f) = 4w + f of a quad-layout token.

    Raises:
        KVInputError: a head dim not divisible by 32.
    """
    if head_dim % 32:
        raise KVInputError(f"the quad layout needs a head dim divisible by 32, got {head_dim}")
    if head_dim not in _QUAD_ORDERS:
        w = torch.arange(head_dim // 4)
        g, k = w // (head_dim // 32), w % (head_dim // 32)
        f = torch.arange(4)
        _QUAD_ORDERS[head_dim] = (32 * k[:, None] + 8 * f[None] + g[:, None]).reshape(-1)
    return _QUAD_ORDERS[head_dim]


def quad_bytes(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., D] uint8 of one token each -> its bytes [..., D/4] uint8 in the quad layout (byte
    w goes to byte j = token % 4 of its quad's word w). No host sync: safe inside a graph capture."""
    D = codes.shape[-1]
    c = codes[..., constant_on(quad_channel_order(D), codes.device)].unflatten(-1, (D // 4, 4)).long()
    return (c << constant_on(_FIELD_SHIFTS, c.device)).sum(-1).to(torch.uint8)


def quad_byte_view(words: torch.Tensor) -> torch.Tensor:
    """Quad-layout value pages [NP, H, P, D/16] int32 -> a byte view [NP, H, P/4, D/4, 4]: token t's
    bytes are [..., t // 4, :, t % 4].

    Raises:
        KVInputError: pages of a token count not divisible by 4.
    """
    NP, H, P, W = words.shape
    _check_quads(P)
    return words.view(torch.uint8).view(NP, H, P // 4, 4 * W, 4)


def store_quad_rows(
    words: torch.Tensor, page: torch.Tensor, row: torch.Tensor, codes: torch.Tensor, *, check_range: bool = True
) -> None:
    """Write codes [N, H, D] uint8 as rows row[i] of pages page[i] (page, row: [N] int64) of
    quad-layout value pages [NP, H, P, D/16]: one byte of each of the row's quad words, the quad's
    other tokens untouched. check_range as `pack_codes` (False: no host sync, capture-safe).

    Raises:
        KVInputError: as `pack_codes`, or pages of a token count not divisible by 4.
    """
    _check_codes(codes, check_range)
    quad_byte_view(words)[page, :, torch.div(row, 4, rounding_mode="floor"), :, row % 4] = quad_bytes(codes)


def token_to_quad(words: torch.Tensor) -> torch.Tensor:
    """Value pages [..., P, D/16] int32 in the token layout -> the same pages in the quad layout.

    Raises:
        KVInputError: P not divisible by 4, or a head dim not divisible by 32.
    """
    *lead, P, W = words.shape
    _check_quads(P)
    byte = quad_bytes(unpack_codes(words)).unflatten(-2, (P // 4, 4))  # [..., quad, token j, word]
    return _bytes_to_words(byte.transpose(-1, -2).long()).reshape(*lead, P, W)


def unpack_quad(words: torch.Tensor) -> torch.Tensor:
    """Quad-layout value pages [..., P, D/16] int32 -> codes [..., P, D] uint8 in token and channel
    order (what `unpack_codes` gives for the token layout).

    Raises:
        KVInputError: P not divisible by 4, or a head dim not divisible by 32.
    """
    *lead, P, W = words.shape
    _check_quads(P)
    D = CODES_PER_WORD * W
    fields = unpack_codes(words).reshape(*lead, P // 4, D // 4, 4, 4)  # [..., quad, word, token j, field]
    ordered = fields.transpose(-3, -2).reshape(*lead, P, D)  # [..., token, byte position 4w + f]
    codes = torch.empty_like(ordered)
    codes[..., constant_on(quad_channel_order(D), words.device)] = ordered
    return codes


def quad_to_token(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `token_to_quad`: quad-layout value pages [..., P, D/16] -> the token layout."""
    return pack_codes(unpack_quad(words), check_range=False)


def _check_quads(page_size: int) -> None:
    if page_size % 4:
        raise KVInputError(f"the quad layout needs pages of a multiple of 4 tokens, got {page_size}")


def _bytes_to_words(byte: torch.Tensor) -> torch.Tensor:
    """[..., 4] int64 bytes (byte j at bits 8j) -> [...] int32 words."""
    words = (byte << constant_on(_BYTE_SHIFTS, byte.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
