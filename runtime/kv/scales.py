"""Rounding of block scales and offsets to their 8-bit storage formats.

E4M3 (OCP FP8, finite-only `e4m3fn`): 3 mantissa bits, range [2^-9, 448]; E8M0: a bare power of
two 2^(e-127). Scales are kept as fp32 *values* that are exactly representable in the storage
format, so quantizer, packer and kernel agree bit for bit.
"""

from __future__ import annotations

import torch

from zerodram.runtime.kv.format import ScaleDtype

E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9


def round_scale(s: torch.Tensor, dtype: ScaleDtype) -> torch.Tensor:
    """Round positive scales to the nearest representable value (fp32 result, same shape).

    E4M3: round-to-nearest-even, clamped into [2^-9, 448]. E8M0: nearest power of two in log
    space (ties up). Zero or tiny inputs become the smallest positive value, never 0, so that
    dequantization never divides by zero.
    """
    s = s.float()
    if dtype == "fp32":
        return s.clamp_min(torch.finfo(torch.float32).tiny)
    if dtype == "bf16":
        return s.clamp_min(2.0**-126).to(torch.bfloat16).float()
    if dtype == "e4m3":
        return s.clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn).float()
    if dtype == "e8m0":
        e = torch.floor(torch.log2(s.clamp_min(2.0**-127)) + 0.5).clamp(-127, 127)
        return torch.exp2(e)
    raise ValueError(f"unknown scale dtype {dtype!r}")


def encode_scale(s: torch.Tensor, dtype: ScaleDtype) -> torch.Tensor:
    """Storage bytes of already-rounded scales: uint8 for e4m3 / e8m0 (see docs/fp2-format.md)."""
    if dtype == "e4m3":
        return s.to(torch.float8_e4m3fn).view(torch.uint8)
    if dtype == "e8m0":
        return (torch.log2(s).round() + 127).to(torch.uint8)
    if dtype == "bf16":
        return s.to(torch.bfloat16)
    return s.float()


def decode_scale(raw: torch.Tensor, dtype: ScaleDtype) -> torch.Tensor:
    """Inverse of `encode_scale` (fp32 values)."""
    if dtype == "e4m3":
        return raw.view(torch.float8_e4m3fn).float()
    if dtype == "e8m0":
        return torch.exp2(raw.float() - 127)
    return raw.float()
