"""Rotary position embeddings with the checkpoint's frequency scaling.

Shape legend: T tokens, H heads, Dh head dim. The rotation follows the Hugging Face convention
(`rotate_half`: the first and second halves of the head dim form the pairs), and cos/sin are
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
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """Applies RoPE to q and k at given positions. Holds only the [Dh/2] frequencies."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, device: torch.device) -> None:
        self.inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)  # [Dh/2] fp32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, Dh] for integer `positions` [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, Dh] and k [T, Hkv, Dh] by `positions` [T]."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
