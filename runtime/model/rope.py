"""Rotary position embeddings with the checkpoint's frequency scaling.

Shape legend: T tokens, H heads, Dh head dim. The rotation follows the Hugging Face convention
(rotate_half: the first and second halves of the head dim form the pairs; here a roll by Dh/2
against a sin whose first half is negated, bit-identical), and cos/sin are
computed in fp32 from integer positions, as transformers does, so greedy outputs match it.
"""

from __future__ import annotations

import math

import torch

from zerodram.runtime.model.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """The per-pair inverse frequencies [Dh/2] in fp32, scaled as `scaling` says."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if scaling.kind == "yarn":
        # Pair i turns head_dim / (2 pi) * ... times over the original context; pairs that turn
        # fewer than beta_slow times are interpolated (divided by factor), more than beta_fast kept.
        base, old_len = theta, scaling.original_max_position_embeddings

        def pair_at(rotations: float) -> float:
            return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = pair_at(scaling.beta_fast), pair_at(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # [Dh/2] 1: extrapolated (kept), 0: interpolated
        pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # 1 / inv
        return 1.0 / (scaling.factor * pos_freqs) * (1 - keep) + inv * keep
    return inv


def attention_factor(scaling: RopeScaling) -> float:
    """The factor on cos/sin (YaRN's mscale; 1 for the other kinds)."""
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(m: float = 1.0) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale()


class Rope:
    """Applies RoPE to q and k by the angles of `cos_sin` (note its signed sin: it pairs with
    `apply` only). Holds only the [Dh/2] frequencies."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, device: torch.device) -> None:
        self.inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)  # [Dh/2] fp32
        self.scale = attention_factor(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation angles for integer `positions` [T]: cos [T, 1, Dh], and sin [T, 1, Dh] with
        its first half negated (times the attention factor, computed in fp32).

        The sign makes the Hugging Face rotate_half a plain roll: cat(-x2, x1) * cat(s, s) equals
        roll(x, Dh/2) * cat(-s, s) bit for bit (a negation is exact), one kernel instead of two.
        Every layer of a forward pass rotates by the same angles: the caller computes them once
        per pass and hands them to each layer's `apply` (on a GPU, ~8 small kernels per layer
        fewer)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, Dh/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # [T, Dh]
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def apply(
        q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, Dh] and k [T, Hkv, Dh] by the angles `cos_sin` (from `cos_sin`)."""
        cos, sin = cos_sin
        half = q.shape[-1] // 2
        return q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
