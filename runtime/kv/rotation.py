"""Orthogonal rotation of the head dim: a normalized Hadamard matrix with random signs.

R = diag(signs) @ H_D / sqrt(D) (D a power of two). Keys are rotated on write (k @ R) and the
query before the decode kernel (q @ R), so scores are unchanged: (qR)(kR)^T = q k^T. Values are
rotated on write and the attention output rotated back (o @ R^T). Cost outside the kernel: one
D x D product (or a D log D fast transform) per written token and per query head per step.
"""

from __future__ import annotations

import torch


def hadamard(dim: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order `dim` (a power of two), entries +-1, fp32. # [D, D]"""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_signs(dim: int, seed: int) -> torch.Tensor:
    """Deterministic +-1 vector from a seed (torch CPU generator, so CPU and GPU agree). # [D]"""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1


def rotation_matrix(dim: int, seed: int) -> torch.Tensor:
    """R = diag(signs(seed)) @ H / sqrt(dim), orthogonal. # [D, D]"""
    return random_signs(dim, seed)[:, None] * hadamard(dim) / dim**0.5


def layer_seed(seed: int, layer_idx: int, side: str, per_layer: bool) -> int:
    """Seed of the rotation used by one layer and side ('k' or 'v')."""
    base = seed * 1_000_003 + (1 if side == "k" else 2)
    return base + (layer_idx * 7919 if per_layer else 0)
