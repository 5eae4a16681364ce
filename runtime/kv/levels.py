"""The four FP2 levels (codebook): named lattices, e5m2-exact rounding, and Lloyd-Max fitting.

Levels are data, stored per (layer, K|V). They are kept exactly representable in FP8 e5m2, the
high byte of an fp16: the decode kernel expands a 2-bit code to an fp16 lattice value with one
byte permute from a 4-byte table (docs/fp2-format.md, "Decode recipe"). Only ratios matter (the
block scale absorbs any common factor), so a codebook is multiplied by the factor in [1, 2) that
makes its e5m2 rounding most faithful, then rounded.
"""

from __future__ import annotations

import functools

import torch

SIGNATURE = (-3.0, -0.5, 0.5, 3.0)
# MSE-optimal 2-bit levels for a unit Gaussian (Lloyd-Max).
LLOYD_MAX_GAUSS = (-1.510, -0.4528, 0.4528, 1.510)


def is_e5m2_exact(levels: torch.Tensor) -> bool:
    """True when every level survives an fp32 -> e5m2 -> fp32 round trip unchanged."""
    return bool((levels.float().to(torch.float8_e5m2).float() == levels.float()).all())


def round_levels_e5m2(levels: tuple[float, ...] | torch.Tensor) -> torch.Tensor:
    """Best e5m2-exact version of a sorted 4-level codebook, up to a common factor. # [4] fp32

    Raises:
        ValueError: not 4 strictly increasing finite levels.
    """
    lv = torch.as_tensor(levels, dtype=torch.float32).flatten()
    if lv.numel() != 4 or not torch.isfinite(lv).all() or not (lv[1:] > lv[:-1]).all():
        raise ValueError(f"need 4 strictly increasing finite levels, got {lv.tolist()}")
    lv = lv / lv.abs().max()
    best, best_err = lv, float("inf")
    for f in torch.linspace(1.0, 2.0, 257)[:-1]:
        cand = (lv * f).to(torch.float8_e5m2).float()
        if not (cand[1:] > cand[:-1]).all():
            continue
        # Compare shapes after renormalising: relative error of the ratios.
        err = float(((cand / (lv * f)) - 1).pow(2).sum())
        if err < best_err:
            best, best_err = cand, err
    return best


def named_levels(name: str) -> torch.Tensor:
    """e5m2-exact levels for 'sig' (the signature lattice) or 'lm' (Gaussian Lloyd-Max). # [4]"""
    return torch.tensor(_named_levels(name))


@functools.cache
def _named_levels(name: str) -> tuple[float, ...]:
    # cached: the 256-factor search takes ~20 ms, and every layer and side of a cache asks
    if name == "sig":
        return tuple(round_levels_e5m2(SIGNATURE).tolist())
    if name == "lm":
        return tuple(round_levels_e5m2(LLOYD_MAX_GAUSS).tolist())
    raise ValueError(f"levels {name!r} are not a named lattice (sig, lm); 'cal' needs calibration")


def midpoints(levels: torch.Tensor) -> torch.Tensor:
    """Decision thresholds between sorted levels. # [3]"""
    return (levels[1:] + levels[:-1]) / 2


def nearest_code(y: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Rounding rule: code = number of midpoints m_i with y >= m_i (ties go to the upper level).

    y: any shape, fp32; levels: [4] sorted. Returns uint8 codes in [0, 3], same shape.
    """
    mids = midpoints(levels.to(y.device))
    return torch.bucketize(y.contiguous(), mids, right=True).to(torch.uint8)


def fit_lloyd_max(samples: torch.Tensor, init: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """1-D k-means (Lloyd-Max) of 4 levels to normalised samples, starting at `init`. # [4]"""
    x = samples.float().flatten()
    lv = init.float().clone()
    for _ in range(iters):
        codes = nearest_code(x, lv).long()
        sums = torch.zeros(4).index_add_(0, codes, x)
        counts = torch.bincount(codes, minlength=4).float()
        lv = torch.where(counts > 0, sums / counts.clamp_min(1), lv)
        lv, _ = lv.sort()
    return lv


def gaussian_rms_factor(levels: torch.Tensor) -> float:
    """Scale / block-RMS ratio that minimises the MSE of a unit Gaussian on `levels` (cached)."""
    return _gaussian_rms_factor(tuple(float(x) for x in levels.flatten()))


@functools.lru_cache(maxsize=64)
def _gaussian_rms_factor(levels: tuple[float, ...]) -> float:
    lv = torch.tensor(levels)
    g = torch.randn(20_000, generator=torch.Generator().manual_seed(1234))
    s = torch.linspace(0.05, 3.0, 300)[:, None] / lv.abs().max()  # [C, 1]
    err = (g - s * lv[nearest_code(g / s, lv).long()]).pow(2).mean(-1)
    return float(s[err.argmin(), 0])
